"""Preemption: on SIGTERM or SIGINT (what a scheduler sends before it takes the nodes back, and
what torchrun forwards to its workers), finish the running step, save a checkpoint on every rank
and exit with `EXIT_PREEMPTED`, so the job script can requeue the run, which resumes by itself.

The signal may reach only some ranks; after every step the ranks agree (one max-reduction of a
flag) so that all of them stop after the same step. A second SIGINT stops at once. A rank that has
not reached that agreement `GRACE` seconds after the signal exits (code 1): it is stuck in a
collective with a dead peer (torchrun stops the survivors of a failure with SIGTERM), and NCCL
would otherwise hold it until torchrun's SIGKILL.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import torch
import torch.distributed as dist

from .trainer_base import HookBase

logger = logging.getLogger("libai_zoo")

EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: a temporary failure, try again
GRACE = 20.0  # seconds: under torchrun's default --shutdown-timeout of 30


class Preempted(Exception):
    """The run stopped on a signal after saving a checkpoint; restarting it resumes there."""

    exit_code = EXIT_PREEMPTED


class Preemption(HookBase):
    """Catches SIGTERM/SIGINT during training; after the step they arrived in, every rank saves
    (`save(steps_done)`, a collective) and raises `Preempted`."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, save, device: torch.device):
        self.save, self.device = save, device
        self.received: int | None = None
        self._previous: dict[int, object] = {}
        self._watchdog: threading.Timer | None = None

    def before_train(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.info("training outside the main thread: SIGTERM/SIGINT keep their handlers (no checkpoint on them)")
            return
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

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

    def after_step(self) -> None:
        flag = torch.tensor([0 if self.received is None else self.received], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return
        if self._watchdog is not None:  # every rank got here: the save may take its time
            self._watchdog.cancel()
        done = self.trainer.iter + 1
        path = self.save(done)
        raise Preempted(f"stopped on {signal.Signals(int(flag.item())).name} after {done} steps; checkpoint "
                        f"{path} is saved: run the same command again to resume")

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def _stuck(signum: int) -> None:
    logger.error("%s arrived %.0f s ago and this rank has not finished its step (a collective waits for a dead "
                 "peer?): exiting without a checkpoint", signal.Signals(signum).name, GRACE)
    for handler in logger.handlers:
        handler.flush()
    os._exit(1)
