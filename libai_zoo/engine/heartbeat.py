"""Heartbeats: each rank leaves (beat number, step, phase, time) in the rendezvous store, so a rank
whose collective times out can say which ranks never arrived and what they were last doing.

Every rank beats at the same points of a step (the same phases in the same order), so the beat
numbers are comparable: the ranks behind the furthest one are the ones the others wait for.
"""

from __future__ import annotations

import datetime
import logging
import time

import torch.distributed as dist

logger = logging.getLogger("libai_zoo")

READ_TIMEOUT = datetime.timedelta(seconds=10)  # reading the beats after a failure must not hang too


class Heartbeat:
    """This rank's heartbeat in `store` (None: a one-process run, nothing to record)."""

    def __init__(self, store: dist.Store | None, rank: int, world_size: int):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.count = 0

    def beat(self, step: int, phase: str) -> None:
        """Record that this rank reached `phase` of step `step` (1-based)."""
        if self.store is None:
            return
        self.count += 1
        self.store.set(f"rank{self.rank}", f"{self.count}|{step}|{phase}|{time.time():.3f}")

    def laggards(self) -> list[str]:
        """One line per rank behind the furthest one: its last step and phase and how long ago."""
        if self.store is None:
            return []
        self.store.set_timeout(READ_TIMEOUT)
        keys = [f"rank{r}" for r in range(self.world_size)]
        try:
            values = [self.store.get(key).decode() if self.store.check([key]) else None for key in keys]
        except (RuntimeError, TimeoutError) as error:
            return [f"the rendezvous store did not answer ({error}): the host that keeps it may be down"]
        beats = {r: value.split("|", 3) for r, value in enumerate(values) if value is not None}
        furthest = max((int(b[0]) for b in beats.values()), default=0)
        now = time.time()
        lines = [f"rank {r} never reported (it did not start, or died before its first step)"
                 for r in range(self.world_size) if r not in beats]
        lines += [f"rank {r} last seen {now - float(stamp):.1f} s ago in step {step} ({phase})"
                  for r, (count, step, phase, stamp) in sorted(beats.items()) if int(count) < furthest]
        return lines

    def report(self, error: BaseException) -> None:
        """Log which ranks the failed collective waited for (every rank that failed calls this)."""
        lines = self.laggards()
        if lines:
            logger.error("rank %d stopped on %s; the ranks it waited for:\n  %s", self.rank,
                         type(error).__name__, "\n  ".join(lines))
        elif self.store is not None:
            logger.error("rank %d stopped on %s; every rank had reached the same point", self.rank,
                         type(error).__name__)
