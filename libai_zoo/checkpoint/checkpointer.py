"""Training checkpoints that survive crashes and layout changes.

    output_dir/
      model_0000500/         model + optimizer (torch.distributed.checkpoint: every rank writes
                             its own shards; DTensors keep their global shapes, so a checkpoint
                             loads at another tp) and trainer_state_rank{r}.pt (iteration,
                             schedule, loss scaler, RNG states, data position)
      last_checkpoint        the name of the newest complete checkpoint

A checkpoint is written to ``<name>.tmp`` and renamed when every rank has finished, and only
then does `last_checkpoint` move (itself replaced atomically): a run killed while writing
resumes from the previous checkpoint.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as torch_dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

logger = logging.getLogger("libai_zoo")

POINTER = "last_checkpoint"
# ZeroRedundancyOptimizer's state is consolidated on rank 0 and saved whole (DCP cannot shard it).
ZERO1_OPTIMIZER = "optimizer_zero1.pt"


def _is_zero1(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer).__name__ == "ZeroRedundancyOptimizer"


def _rank() -> int:
    return torch_dist.get_rank() if torch_dist.is_initialized() else 0


def _barrier() -> None:
    if torch_dist.is_initialized():
        torch_dist.barrier()


@contextmanager
def _one_process_ok():
    """DCP warns when it runs without a process group; for a one-process run that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class Checkpointer:
    """Saves and loads a model, its optimizer and a per-rank trainer state under `output_dir`."""

    def __init__(self, output_dir: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 *, aliases: dict[str, str] | None = None):
        """``aliases``: this rank's name of a parameter -> the name its optimizer state may be saved
        under instead (a pipeline's last stage holds a copy of the embedding tied to its head; a
        layout without that copy saves the state under the embedding's name)."""
        self.output_dir = Path(output_dir)
        self.model, self.optimizer = model, optimizer
        self.aliases = aliases or {}

    def _sharded_optimizers(self, with_optimizer: bool = True) -> list[torch.optim.Optimizer]:
        """The optimizer when DCP saves it with the model (ZeRO-1's is saved whole, see `_zero1`)."""
        if not with_optimizer or self.optimizer is None or _is_zero1(self.optimizer):
            return []
        return [self.optimizer]

    def _state(self, with_optimizer: bool = True) -> dict:
        """The FQN-keyed state DCP saves and loads: {"model": ..., ["optim": ...]}."""
        optimizers = self._sharded_optimizers(with_optimizer)
        model_state, optim_state = get_state_dict(self.model, optimizers)
        return {"model": model_state, "optim": optim_state} if optimizers else {"model": model_state}

    def save(self, name: str, trainer_state: dict, *, pointer: bool = True) -> Path:
        """Write checkpoint `name` (every rank must call this); move `last_checkpoint` to it if `pointer`."""
        final, tmp = self.output_dir / name, self.output_dir / f"{name}.tmp"
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        with _one_process_ok():
            dcp.save(self._state(), checkpoint_id=str(tmp))
        torch.save(trainer_state, tmp / f"trainer_state_rank{_rank()}.pt")
        if self.optimizer is not None and _is_zero1(self.optimizer):
            self.optimizer.consolidate_state_dict(to=0)  # every rank sends its shard to rank 0
            if _rank() == 0:
                torch.save(self.optimizer.state_dict(), tmp / ZERO1_OPTIMIZER)
        _barrier()
        if _rank() == 0:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            if pointer:
                (self.output_dir / f"{POINTER}.tmp").write_text(name)
                os.replace(self.output_dir / f"{POINTER}.tmp", self.output_dir / POINTER)
            logger.info("saved checkpoint %s", final)
        _barrier()
        return final

    def last_checkpoint(self) -> Path | None:
        """The checkpoint `last_checkpoint` names, or None when there is none yet."""
        pointer = self.output_dir / POINTER
        if not pointer.is_file():
            return None
        path = self.output_dir / pointer.read_text().strip()
        if not path.is_dir():
            raise FileNotFoundError(f"{pointer} names {path.name}, which does not exist: restore it or delete "
                                    f"{pointer} to start from scratch")
        return path

    def load(self, path: str | Path, *, with_optimizer: bool = True) -> dict:
        """Load model (and optimizer) from checkpoint `path`; return this rank's trainer state ({} if none)."""
        path = Path(path)
        if not (path / ".metadata").is_file():
            raise FileNotFoundError(f"{path} is not a libai_zoo checkpoint (no .metadata): pass a model_XXXXXXX "
                                    f"directory written by the trainer")
        optimizers = self._sharded_optimizers(with_optimizer)
        state = self._state(with_optimizer)
        if "optim" in state:
            _rename_state(state["optim"], self.aliases)
        with _one_process_ok():
            dcp.load(state, checkpoint_id=str(path))
        if "optim" in state:
            _rename_state(state["optim"], {saved: own for own, saved in self.aliases.items()})
        set_state_dict(self.model, optimizers, model_state_dict=state["model"],
                       optim_state_dict=state.get("optim", {}))
        if with_optimizer and self.optimizer is not None and _is_zero1(self.optimizer):
            if not (path / ZERO1_OPTIMIZER).is_file():
                raise FileNotFoundError(f"{path} holds no {ZERO1_OPTIMIZER}: it was not saved under "
                                        f"train.zero_stage=1; resume with the stage it was saved with")
            self.optimizer.load_state_dict(torch.load(path / ZERO1_OPTIMIZER, weights_only=True))
        own = path / f"trainer_state_rank{_rank()}.pt"
        fallback = path / "trainer_state_rank0.pt"
        for file in (own, fallback):
            if file.is_file():
                return torch.load(file, weights_only=True)
        return {}

    def prune(self, max_to_keep: int | None) -> None:
        """Keep only the newest `max_to_keep` periodic checkpoints (model_XXXXXXX; model_best stays)."""
        if max_to_keep is None or _rank() != 0:
            return
        periodic = sorted(p for p in self.output_dir.glob("model_*") if p.is_dir() and p.name[6:].isdigit())
        for old in periodic[:-max_to_keep]:
            shutil.rmtree(old)

    def remove_incomplete(self) -> None:
        """Delete checkpoints whose writing was interrupted (rank 0)."""
        if _rank() == 0 and self.output_dir.is_dir():
            for tmp in self.output_dir.glob("*.tmp"):
                logger.warning("removing %s: an interrupted checkpoint write", tmp)
                shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink()
        _barrier()


def _rename_state(optim_state: dict, names: dict[str, str]) -> None:
    """Rename parameters in an FQN-keyed optimizer state dict (as get_state_dict returns it), in place."""
    for old, new in names.items():
        if old in optim_state.get("state", {}) and new not in optim_state["state"]:
            optim_state["state"][new] = optim_state["state"].pop(old)
            for group in optim_state.get("param_groups", []):
                group["params"] = [new if name == old else name for name in group["params"]]
