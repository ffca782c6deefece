"""Preemption: SIGTERM or SIGINT (what a scheduler sends before it takes the nodes back, and what
torchrun forwards to its workers) stops the run after the running step, every rank saving first
(docs/design.md §5); the process then exits with `EXIT_PREEMPTED` so the job script can requeue
the run, which resumes by itself.

The signal may reach only some ranks: after every step the ranks agree (one max-reduction of a
flag). A second SIGINT stops at once. A rank that has not reached that agreement `GRACE` seconds
after the signal exits (code 1): it is stuck in a collective with a dead peer (torchrun stops the
survivors of a failure with SIGTERM), and NCCL would otherwise hold it until torchrun's SIGKILL.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

logger = logging.getLogger("libai_zoo")

EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: a temporary failure, try again
GRACE = 20.0  # seconds: under torchrun's default --shutdown-timeout of 30


class Preempted(Exception):
    """The run stopped on a signal after saving a checkpoint; restarting it resumes there."""

    exit_code = EXIT_PREEMPTED


class Preemption:
    """Catches SIGTERM/SIGINT while `catching()`; `agreed()` tells every rank alike whether one
    arrived on any rank. ``group``: the run's ranks (the parallel context's `world_group`; None
    alone)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None):
        self.device, self.group = device, group
        self.received: int | None = None
        self._watchdog: threading.Timer | None = None

    @contextmanager
    def catching(self) -> Iterator[None]:
        """Catch the signals inside the block (in the main thread; elsewhere they keep their handlers)."""
        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        else:
            logger.info("training outside the main thread: SIGTERM/SIGINT keep their handlers (no checkpoint on them)")
        try:
            yield
        finally:
            if self._watchdog is not None:
                self._watchdog.cancel()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.received = signum
        logger.warning("received %s: finishing this step, then saving a checkpoint and exiting",
                       signal.Signals(signum).name)
        if self._watchdog is None:
            self._watchdog = threading.Timer(GRACE, _stuck, (signum,))
            self._watchdog.daemon = True
            self._watchdog.start()

    def agreed(self) -> signal.Signals | None:
        """The signal some rank received, the same on every rank (a collective); None: none did."""
        flag = torch.tensor([0 if self.received is None else self.received], device=self.device)
        if self.group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if not flag.item():
            return None
        if self._watchdog is not None:  # every rank got here: the save may take its time
            self._watchdog.cancel()
        return signal.Signals(int(flag.item()))


def _stuck(signum: int) -> None:
    logger.error("%s arrived %.0f s ago and this rank has not finished its step (a collective waits for a dead "
                 "peer?): exiting without a checkpoint", signal.Signals(signum).name, GRACE)
    for handler in logger.handlers:
        handler.flush()
    os._exit(1)
