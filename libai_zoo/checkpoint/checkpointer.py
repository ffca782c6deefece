"""Training checkpoints that survive crashes and layout changes.

    output_dir/
      model_0000500/         model + optimizer (torch.distributed.checkpoint: every rank writes
                             its own shards; DTensors keep their global shapes, so a checkpoint
                             loads at another dp × tp × pp) and trainer_state_rank{r}.pt
                             (iteration, RNG states, and the state of the run's other stateful
                             objects: LR schedule, loss scaler)
      last_checkpoint        the name of the newest complete checkpoint

A checkpoint counts only once complete (`commit`: written under ``<name>.tmp``, renamed when every
rank has finished, then named by `last_checkpoint`): a run killed while writing resumes from the
previous one.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as torch_dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from libai_zoo.utils import rng_state, set_rng_state

from . import commit

logger = logging.getLogger("libai_zoo")

# Where ZeroRedundancyOptimizer's whole state went before ZeRO-1 ran on FSDP2 (2026-11-23).
OLD_ZERO1_OPTIMIZER = "optimizer_zero1.pt"


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
    """Saves and loads this rank's model parts, their optimizer and the run's other state under
    `output_dir`.

    ``model_parts``: the modules this rank trains (one model, or its pipeline stages' pruned copies,
    which keep the full model's parameter names). ``stateful``: other objects with
    ``state_dict``/``load_state_dict`` saved per rank (the LR schedule, the loss scaler).
    ``aliases``: this rank's name of a parameter -> the name its optimizer state may be saved
    under instead (a pipeline's last stage holds a copy of the embedding tied to its head; a
    layout without that copy saves the state under the embedding's name).
    """

    def __init__(self, output_dir: str | Path, model_parts: Sequence[nn.Module],
                 optimizer: torch.optim.Optimizer | None = None, *, stateful: dict[str, object] | None = None,
                 aliases: dict[str, str] | None = None):
        self.output_dir = Path(output_dir)
        self.model = _one_module(list(model_parts))
        self.optimizer = optimizer
        self.stateful = stateful or {}
        self.aliases = aliases or {}

    def _sharded_optimizers(self, with_optimizer: bool = True) -> list[torch.optim.Optimizer]:
        """The optimizer, when its state is saved or loaded with the model's."""
        return [self.optimizer] if with_optimizer and self.optimizer is not None else []

    def _state(self, with_optimizer: bool = True) -> dict:
        """The FQN-keyed state DCP saves and loads: {"model": ..., ["optim": ...]}."""
        optimizers = self._sharded_optimizers(with_optimizer)
        model_state, optim_state = get_state_dict(self.model, optimizers)
        return {"model": model_state, "optim": optim_state} if optimizers else {"model": model_state}

    # ------------------------------------------------------------------------------------ saving
    def save(self, name: str, iteration: int, *, pointer: bool = True) -> Path:
        """Write checkpoint `name` after `iteration` steps (every rank must call this); with
        `pointer`, `last_checkpoint` names it once it is complete."""
        final = self.output_dir / name
        staged = commit.staging_dir(final)
        if _rank() == 0:
            commit.start(final)
        _barrier()
        with _one_process_ok():
            dcp.save(self._state(), checkpoint_id=str(staged))
        trainer_state = {"iteration": iteration, "rng": rng_state(),
                         **{key: obj.state_dict() for key, obj in self.stateful.items()}}
        torch.save(trainer_state, staged / f"trainer_state_rank{_rank()}.pt")
        _barrier()
        if _rank() == 0:
            commit.finish(final, pointer=pointer)
            logger.info("saved checkpoint %s", final)
        _barrier()
        return final

    def prune(self, max_to_keep: int | None) -> None:
        """Keep only the newest `max_to_keep` periodic checkpoints (model_XXXXXXX; model_best stays)."""
        if max_to_keep is None or _rank() != 0:
            return
        periodic = sorted(p for p in self.output_dir.glob("model_*") if p.is_dir() and p.name[6:].isdigit())
        for old in periodic[:-max_to_keep]:
            shutil.rmtree(old)

    # ----------------------------------------------------------------------------------- loading
    def remove_incomplete(self) -> None:
        """Delete the checkpoints whose writing was interrupted (every rank must call this)."""
        if _rank() == 0:
            commit.remove_incomplete(self.output_dir)
        _barrier()

    def last_checkpoint(self) -> Path | None:
        """The newest complete checkpoint (named by `last_checkpoint`), or None when there is none yet."""
        path = commit.pointed_to(self.output_dir)
        if path is not None and not path.is_dir():
            raise FileNotFoundError(f"{self.output_dir / commit.POINTER} names {path.name}, which does not exist: "
                                    f"restore it or delete {commit.POINTER} to start from scratch")
        return path

    def load(self, path: str | Path, *, with_optimizer: bool = False) -> None:
        """Load the model parts' weights (and, `with_optimizer`, the optimizer) from checkpoint `path`,
        whatever layout wrote it."""
        path = Path(path)
        if not (path / ".metadata").is_file():
            raise FileNotFoundError(f"{path} is not a libai_zoo checkpoint (no .metadata): pass a model_XXXXXXX "
                                    f"directory written by the trainer")
        if with_optimizer and (path / OLD_ZERO1_OPTIMIZER).is_file():
            raise ValueError(f"{path} was saved by train.zero_stage=1 before ZeRO-1 ran on FSDP2: its optimizer "
                             f"state cannot be resumed; start a new run from its weights with "
                             f"train.load_weight={path}")
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

    def resume(self, path: str | Path) -> int:
        """Restore everything a run saved in checkpoint `path` (model, optimizer, stateful objects,
        RNG states); return the number of steps it had done."""
        path = Path(path)
        states = [path / f"trainer_state_rank{_rank()}.pt", path / "trainer_state_rank0.pt"]
        state_file = next((file for file in states if file.is_file()), None)
        if state_file is None:
            raise ValueError(f"{path} holds model weights only (e.g. from tools/convert hf-to-zoo), not a run to "
                             f"resume: start from it with train.load_weight={path} instead of --resume")
        self.load(path, with_optimizer=True)
        state = torch.load(state_file, weights_only=True)
        for key, obj in self.stateful.items():
            obj.load_state_dict(state[key])
        set_rng_state(state["rng"])
        return state["iteration"]


def _one_module(parts: list[nn.Module]) -> nn.Module:
    """The model parts as one module whose parameter names are the full model's: what DCP's
    state-dict functions take to name one optimizer's parameters. The parts themselves when there
    is one; else a module whose children are the union of theirs (pipeline stages of one model
    keep its names and hold disjoint layers), sharing their submodules."""
    if len(parts) == 1 or all(part is parts[0] for part in parts):
        return parts[0]
    union = nn.Module()
    for name in dict.fromkeys(n for part in parts for n in part._modules):
        children = [part._modules[name] for part in parts if part._modules.get(name) is not None]
        if children:
            union.add_module(name, _one_module(children))
    for name in dict.fromkeys(n for part in parts for n in part._parameters):
        param = next((part._parameters[name] for part in parts if part._parameters.get(name) is not None), None)
        if param is not None:
            union.register_parameter(name, param)
    return union


def _rename_state(optim_state: dict, names: dict[str, str]) -> None:
    """Rename parameters in an FQN-keyed optimizer state dict (as get_state_dict returns it), in place."""
    for old, new in names.items():
        if old in optim_state.get("state", {}) and new not in optim_state["state"]:
            optim_state["state"][new] = optim_state["state"].pop(old)
            for group in optim_state.get("param_groups", []):
                group["params"] = [new if name == old else name for name in group["params"]]
