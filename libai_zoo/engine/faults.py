"""Fault injection: make a rank die, hang, diverge or lag at a chosen step, to prove that a run
survives it. Off unless the environment variable ``LIBAI_ZOO_FAULT`` is set (then a hook is
registered; otherwise nothing runs at all).

    LIBAI_ZOO_FAULT="kill:rank=1:step=5"          SIGKILL rank 1 when step 5 starts
    LIBAI_ZOO_FAULT="hang:rank=1:step=5"          SIGSTOP it (a hung process)
    LIBAI_ZOO_FAULT="term:rank=0:step=5"          SIGTERM it (what a scheduler sends before preemption)
    LIBAI_ZOO_FAULT="nan:rank=0:step=5:count=3"   a non-finite loss in steps 5, 6 and 7
    LIBAI_ZOO_FAULT="slow:rank=2:step=1:seconds=0.5"   sleep 0.5 s in every step from step 1
    several faults: separated by ";"

A fault fires once per output directory (a marker under ``output_dir/faults/`` remembers it), so
the run restarted after it does not meet it again.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .trainer_base import HookBase

logger = logging.getLogger("libai_zoo")

ENV = "LIBAI_ZOO_FAULT"
KINDS = ("kill", "hang", "term", "nan", "slow")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    count: int = 1          # nan: how many steps in a row
    seconds: float = 0.0    # slow: the delay added to every step from `step` on

    @property
    def marker(self) -> str:
        return f"{self.kind}-rank{self.rank}-step{self.step}"


def parse_faults(spec: str) -> list[Fault]:
    """The faults a ``LIBAI_ZOO_FAULT`` value describes; a malformed one is an error naming the format."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        kind, *fields = item.split(":")
        try:
            values = dict(field.split("=", 1) for field in fields)
            fault = Fault(kind, int(values.pop("rank")), int(values.pop("step")), int(values.pop("count", 1)),
                          float(values.pop("seconds", 0.0)))
        except (KeyError, ValueError) as error:
            raise ValueError(f"{ENV}={spec!r}: cannot read {item!r} ({error}); write KIND:rank=R:step=K "
                             f"[:count=N][:seconds=S] with KIND one of {', '.join(KINDS)}") from error
        if kind not in KINDS or values:
            raise ValueError(f"{ENV}={spec!r}: {item!r} has kind {kind!r} or keys {sorted(values)} that do not "
                             f"exist; KIND is one of {', '.join(KINDS)}, keys rank, step, count, seconds")
        faults.append(fault)
    return faults


class FaultInjector(HookBase):
    """Fires this rank's `faults` when their step starts."""

    def __init__(self, faults: list[Fault], rank: int, output_dir: Path):
        self.faults = [fault for fault in faults if fault.rank == rank]
        self.markers = Path(output_dir) / "faults"
        self._poisoned_steps = 0
        self._poison = False  # the running step's training forward passes turn NaN
        self._hook = None

    def before_train(self) -> None:
        if any(fault.kind == "nan" for fault in self.faults):
            self._hook = next(iter(self.trainer.layers)).register_forward_hook(self._not_finite)

    def before_step(self) -> None:
        step = self.trainer.iter + 1
        for fault in self.faults:
            if fault.kind == "slow" and step >= fault.step:
                time.sleep(fault.seconds)
            elif step == fault.step and self._first_time(fault):
                logger.warning("fault injection: %s at step %d", fault.kind, step)
                if fault.kind == "nan":
                    self._poisoned_steps = fault.count
                else:
                    for handler in logging.getLogger("libai_zoo").handlers:
                        handler.flush()
                    os.kill(os.getpid(), {"kill": signal.SIGKILL, "hang": signal.SIGSTOP,
                                          "term": signal.SIGTERM}[fault.kind])
        self._poison = self._poisoned_steps > 0
        if self._poison:
            self._poisoned_steps -= 1

    def _not_finite(self, module, inputs, output):
        """A forward hook that, in a poisoned step, turns a layer's output into NaN (and with it the
        loss and every gradient); an evaluation (eval mode) after the step is left alone."""
        if not (self._poison and module.training):
            return None
        if isinstance(output, tuple):
            return (output[0] * torch.nan, *output[1:])
        return output * torch.nan

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _first_time(self, fault: Fault) -> bool:
        marker = self.markers / fault.marker
        if marker.exists():
            return False
        self.markers.mkdir(parents=True, exist_ok=True)
        marker.touch()
        return True


def fault_injector(rank: int, output_dir: Path) -> FaultInjector | None:
    """The hook for ``LIBAI_ZOO_FAULT``, or None when it is not set."""
    spec = os.environ.get(ENV)
    return FaultInjector(parse_faults(spec), rank, output_dir) if spec else None
