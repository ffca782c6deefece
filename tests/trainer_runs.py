"""Running DefaultTrainer from tests: a hook that stops a run as a killed job would, and the
losses a run logged."""

from __future__ import annotations

import json
from pathlib import Path

from libai_zoo import distributed
from libai_zoo.engine import DefaultTrainer, HookBase


class Interrupt(HookBase):
    """Stop the run after `steps` steps (after that step's checkpoint and, registered last, its
    line in metrics.json), raising KeyboardInterrupt."""

    def __init__(self, steps: int):
        self.steps = steps

    def report_step(self) -> None:
        if self.trainer.iter + 1 == self.steps:
            raise KeyboardInterrupt(f"stopped after {self.steps} steps")


def run_trainer(cfg, *, resume: bool = False, interrupt_after: int | None = None,
                hooks: list[HookBase] = ()) -> DefaultTrainer:
    """Build, resume or load, and train (with extra `hooks`); the parallel context is torn down
    whatever happens."""
    trainer = DefaultTrainer(cfg)
    trainer.register_hooks(list(hooks) + ([Interrupt(interrupt_after)] if interrupt_after is not None else []))
    try:
        trainer.resume_or_load(resume=resume)
        trainer.train()
    finally:
        distributed.destroy()
    return trainer


def records(output_dir: Path) -> list[dict]:
    """The lines of a run's metrics.json."""
    return [json.loads(line) for line in (Path(output_dir) / "metrics.json").read_text().splitlines()]


def losses(output_dir: Path, scalar: str = "loss") -> dict[int, float]:
    """{iteration: loss} (or another `scalar`, e.g. "grad_norm") of a run's metrics.json ({} when
    the rank wrote none)."""
    if not (Path(output_dir) / "metrics.json").is_file():
        return {}
    return {r["iteration"]: r[scalar] for r in records(output_dir)}
