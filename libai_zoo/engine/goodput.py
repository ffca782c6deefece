"""Goodput: how much of a job's wall time went into training steps that count.

    effective training time ratio = time in steps that were kept / wall time since the job started

A job is one launch of the command; the attempts torchrun restarts its workers for
(``TORCHELASTIC_RESTART_COUNT`` > 0) belong to it. Time is lost to restarts (from the last sign of
life of the failed attempt until the next one starts training again), to replayed steps (those done
after the checkpoint a restart or a rollback went back to: their time is lost, the steps are done
again), to checkpoint stalls and to evaluation. ``output_dir/goodput.json`` carries the account
across restarts; any other start (a rerun, even one that resumes from a checkpoint) is a new job
with a new account, so idle time between jobs is no restart and the lost time is within the job's
wall time. Steps replayed across a crash and a manual rerun are not counted (they fall in two jobs).
Its figures go into metrics.json as ``goodput/*`` and the end of the run reports them.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

from .trainer_base import HookBase

logger = logging.getLogger("libai_zoo")

FILE = "goodput.json"


class Goodput(HookBase):
    """Keeps the job's time account in `output_dir`/goodput.json (the main process only).

    ``started_at``: when this process started (time.time()), so that start-up counts as lost. The
    step's checkpoint stall and evaluation time are the trainer's records: its checkpoint manager's
    `last_saved` and its `last_evaluation` (done after the step, before the hooks)."""

    def __init__(self, output_dir: str | Path, started_at: float):
        self.path = Path(output_dir) / FILE
        self.started_at = started_at
        self.account: dict = {}

    def before_train(self) -> None:
        start_iter = self.trainer.start_iter
        resumes = self.trainer.resumes  # False: a new run over an old directory
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0  # torchrun restarted this job
        previous = json.loads(self.path.read_text()) if restarted and resumes and self.path.is_file() else None
        if previous is not None and previous.get("job") == _job():  # not an earlier job's, whose attempt 0 died early
            self.account = previous
            now = time.time()
            lost = now - self.account["last_time"]
            self.account["restarts"] += 1
            self.account["restart_lost_s"] += lost
            self.account["last_time"] = now  # an attempt that dies before its first step is not counted twice
            self._go_back(start_iter)
            logger.info("goodput: restart %d of this job; %.1f s lost since the last attempt's last sign of life",
                        self.account["restarts"], lost)
        else:  # a new job (attempt 0), even when it resumes from a checkpoint
            self.account = {"job": _job(), "job_start": self.started_at, "productive_s": 0.0, "restarts": 0,
                            "restart_lost_s": 0.0, "replayed_steps": 0, "replayed_s": 0.0, "checkpoint_s": 0.0,
                            "eval_s": 0.0, "productive_at": {}, "last_iter": start_iter, "last_time": self.started_at}
        self._save()

    def checkpointed(self, iteration: int) -> None:
        """The state after `iteration` steps is saved: a restart goes back to it."""
        self.account["productive_at"][str(iteration)] = self.account["productive_s"]
        self._save()

    def rolled_back(self, iteration: int, reached: int) -> None:
        """The run went back from step `reached` to the checkpoint of `iteration`: the steps after it are lost."""
        self.account["last_iter"] = reached
        self._go_back(iteration)

    def _go_back(self, iteration: int) -> None:
        account = self.account
        # the time kept at that checkpoint (its own record; else all of it when nothing came after)
        kept = account["productive_at"].get(str(iteration),
                                            account["productive_s"] if iteration >= account["last_iter"] else 0.0)
        account["replayed_steps"] += max(account["last_iter"] - iteration, 0)
        account["replayed_s"] += max(account["productive_s"] - kept, 0.0)
        account["productive_s"] = kept
        account["last_iter"] = iteration

    def after_step(self) -> None:
        account, done = self.account, self.trainer.iter + 1
        saved = self.trainer.checkpoint_manager.last_saved  # outside the step's time, like the evaluation
        saved = saved if saved is not None and saved.iteration == done else None
        evaluated = self.trainer.last_evaluation
        if saved is not None:
            account["checkpoint_s"] += saved.stall_s
        if evaluated is not None and evaluated.iteration == done:
            account["eval_s"] += evaluated.seconds
        account["productive_s"] += self.trainer.step_time
        account["last_iter"] = done
        account["last_time"] = time.time()
        if saved is not None:
            account["productive_at"][str(done)] = account["productive_s"]
        self.trainer.storage.put_scalars(**{f"goodput/{key}": value for key, value in self.figures().items()})
        self._save()

    def figures(self) -> dict[str, float]:
        """The account so far: the ratio and where the rest of the time went."""
        account = self.account
        wall = max(time.time() - account["job_start"], 1e-9)
        return {"ratio": account["productive_s"] / wall, "wall_s": wall, "productive_s": account["productive_s"],
                "restarts": account["restarts"], "restart_lost_s": account["restart_lost_s"],
                "replayed_steps": account["replayed_steps"], "replayed_s": account["replayed_s"],
                "checkpoint_s": account["checkpoint_s"], "eval_s": account["eval_s"]}

    def after_train(self) -> None:
        f = self.figures()
        logger.info("goodput: effective training time ratio %.3f (%.1f s of training steps kept in %.1f s since "
                    "the job started; lost: %d restart(s) %.1f s, %d replayed step(s) %.1f s, checkpoint stalls "
                    "%.1f s, evaluation %.1f s)", f["ratio"], f["productive_s"], f["wall_s"], f["restarts"],
                    f["restart_lost_s"], f["replayed_steps"], f["replayed_s"], f["checkpoint_s"], f["eval_s"])

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.account))
        os.replace(tmp, self.path)


def _job() -> str:
    """Which job this process belongs to: the attempts torchrun restarts share their agent (their
    parent process) on this host."""
    return f"{socket.gethostname()}:{os.getppid()}"
