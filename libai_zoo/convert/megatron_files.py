"""Megatron-LM's per-rank `torch` checkpoint files: finding a checkpoint's iteration and shard files
and reading them safely. Megatron-Core's converter (`megatron_core.py`), the legacy GPT converter
(`megatron_legacy_gpt.py`), `torch_dist.py` (`common.pt`) and `describe.py` all read through here.

The layout read, as Megatron-LM's checkpointing writes it:

    MEGATRON_DIR/
      latest_checkpointed_iteration.txt      "1000", or "release"
      iter_0001000/ (or release/)
        mp_rank_{t:02d}/model_optim_rng.pt             pp = 1: one file per tensor-parallel rank t
        mp_rank_{t:02d}_{p:03d}/model_optim_rng.pt     pp > 1: one per (tensor rank t, pipeline rank p)

    each file: {"args": argparse.Namespace (num_layers, hidden_size, num_attention_heads, ...),
                "checkpoint_version": 3.0, "iteration": 1000, "model": {...}, "optimizer", "rng_state", ...}

Every file goes through ``torch.load(weights_only=True)`` with only `argparse.Namespace` allowed
beyond tensors (and, with ``allow_numpy``, numpy arrays: Megatron saves its RNG state with them).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import torch

TRACKER = "latest_checkpointed_iteration.txt"
SHARD_FILE = "model_optim_rng.pt"
SHARD_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?$")
# A layer's tensor in a pipeline stage's file: (local layer index, the name within the layer).
LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)$")


def _numpy_globals() -> list:
    """What numpy arrays and dtypes unpickle through (numpy 2 and numpy 1 spellings): data only."""
    import numpy as np

    try:
        from numpy._core import multiarray
    except ImportError:  # numpy 1
        from numpy.core import multiarray

    return [multiarray._reconstruct, (multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
            multiarray.scalar, (multiarray.scalar, "numpy.core.multiarray.scalar"), np.ndarray, np.dtype,
            *(type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64))]


class MegatronEnum(str):
    """A Megatron enum member in `args` (e.g. attention_backend = AttnBackend.auto), kept as text."""


def _enum_stand_in(qualified_name: str):
    return lambda value: MegatronEnum(f"{qualified_name.rsplit('.', 1)[-1]}.{value}")


def load_file(path: str | Path, *, allow_numpy: bool = False, mmap: bool = True) -> dict:
    """One Megatron .pt file through ``torch.load(weights_only=True)``, allowing argparse.Namespace
    (Megatron's "args"), Megatron's enums in it (read as `MegatronEnum` text: no Megatron code
    runs) and, with `allow_numpy`, numpy arrays."""
    path = Path(path)
    try:
        needed = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception as error:
        raise ValueError(f"{path} is not a readable torch checkpoint file: {error}") from error
    enums = [name for name in needed if name.startswith("megatron.") and ".enums." in name]
    allowed = [argparse.Namespace, *((_enum_stand_in(name), name) for name in enums),
               *(_numpy_globals() if allow_numpy else [])]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as error:
        import pickle

        if not isinstance(error, pickle.UnpicklingError):
            raise ValueError(f"{path} is not a readable torch checkpoint file: {error}") from error
        unsafe = [name for name in needed if name != "argparse.Namespace" and name not in enums]
        if unsafe and all(name.startswith("numpy.") for name in unsafe) and not allow_numpy:
            raise ValueError(f"{path} pickles numpy objects ({', '.join(unsafe)}; Megatron-LM saves its RNG state "
                             f"with them): pass --allow-numpy to load them as data (no code runs), or save the "
                             f"checkpoint with --no-save-rng") from None
        raise ValueError(f"{path} pickles objects that are not loaded for safety (weights_only): "
                         f"{', '.join(unsafe) or error}; only tensors, containers, argparse.Namespace and Megatron's "
                         f"enums are read") from None


@dataclass
class MegatronCheckpoint:
    """Where the shards of one Megatron-LM checkpoint are, and its run arguments."""

    directory: Path                       # iter_XXXXXXX or release
    iteration: str                        # "1000" or "release"
    tp: int
    pp: int
    files: dict[tuple[int, int], Path]    # (tensor rank, pipeline rank) -> model_optim_rng.pt
    args: argparse.Namespace | None = None
    checkpoint_version: float = 0.0
    allow_numpy: bool = False
    source: str = ""                      # how the iteration was found

    def arg(self, name: str, default=None):
        return getattr(self.args, name, default) if self.args is not None else default

    def load(self, tp_rank: int, pp_rank: int) -> dict:
        return load_file(self.files[tp_rank, pp_rank], allow_numpy=self.allow_numpy)


def shard_dir_name(tp_rank: int, pp_rank: int, pp: int) -> str:
    """Megatron-LM's name of the directory of one (tensor, pipeline) rank's file."""
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def iteration_directory(path: Path) -> tuple[Path, str, str]:
    """(iteration directory, iteration, how it was found) for a checkpoint root or an iteration directory."""
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist: pass a Megatron-LM checkpoint directory (holding {TRACKER} "
                                f"and iter_XXXXXXX/mp_rank_XX/{SHARD_FILE})")
    tracker = path / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text == "release":
            directory = path / "release"
        elif text.isdigit():
            directory = path / f"iter_{int(text):07d}"
        else:
            raise ValueError(f"{tracker} holds {text!r}; Megatron-LM writes an iteration number or 'release'")
        if not directory.is_dir():
            raise FileNotFoundError(f"{tracker} names iteration {text}, but {directory} does not exist: restore it, "
                                    f"or pass the iteration directory to convert")
        return directory, text, f"{TRACKER}"
    if any(SHARD_DIR.match(p.name) for p in path.glob("mp_rank_*")):
        name = path.name
        iteration = (name[5:].lstrip("0") or "0") if name.startswith("iter_") else name
        return path, iteration, "the directory given"
    if (path / ".metadata").is_file():  # a torch_dist iteration directory (megatron_core.py reads it)
        name = path.name
        return path, (name[5:].lstrip("0") or "0") if name.startswith("iter_") else name, "the directory given"
    iterations = sorted(p.name for p in path.glob("iter_*") if p.is_dir())
    hint = f"; it holds {', '.join(iterations)}: pass one of them" if iterations else ""
    raise FileNotFoundError(f"{path} is not a Megatron-LM checkpoint: no {TRACKER} and no mp_rank_XX "
                            f"directories{hint}")


def find_checkpoint(path: str | Path, *, allow_numpy: bool = False) -> MegatronCheckpoint:
    """Locate the shard files of the checkpoint at `path` (a checkpoint root or an iteration
    directory), read the run arguments from the first, and check that every shard of the tp × pp
    grid is there; a missing one is an error naming the expected file."""
    directory, iteration, source = iteration_directory(Path(path))
    found: dict[tuple[int, int], Path] = {}
    odd = []
    for sub in sorted(directory.glob("mp_rank_*")):
        match = SHARD_DIR.match(sub.name)
        if not match or not sub.is_dir():
            odd.append(sub.name)
            continue
        found[int(match[1]), int(match[2]) if match[2] is not None else -1] = sub / SHARD_FILE
    if odd:
        raise ValueError(f"{directory} holds {', '.join(odd)}: expert-parallel or unknown shard directories; this "
                         f"converter reads mp_rank_TT (pp = 1) and mp_rank_TT_PPP (pp > 1)")
    if not found:
        raise FileNotFoundError(f"{directory} holds no mp_rank_XX directories: it is not a Megatron-LM checkpoint")
    stages_named = {p for _, p in found}
    if -1 in stages_named and len(stages_named) > 1:
        raise ValueError(f"{directory} mixes mp_rank_TT and mp_rank_TT_PPP directories: keep one checkpoint per "
                         f"iteration directory")
    plain_names = stages_named == {-1}
    found = {(t, max(p, 0)): file for (t, p), file in found.items()}
    first = next((file for _, file in sorted(found.items()) if file.is_file()), None)
    if first is None:
        raise FileNotFoundError(f"no {SHARD_FILE} in any mp_rank directory of {directory}: expected "
                                f"{directory / shard_dir_name(0, 0, 1 if plain_names else 2) / SHARD_FILE}")
    state = load_file(first, allow_numpy=allow_numpy)
    args = state.get("args")
    tp = getattr(args, "tensor_model_parallel_size", None) or max(t for t, _ in found) + 1
    pp = getattr(args, "pipeline_model_parallel_size", None) or (1 if plain_names else max(p for _, p in found) + 1)
    if (pp == 1) != plain_names:
        raise ValueError(f"{first}: args.pipeline_model_parallel_size = {pp}, but the shard directories are named "
                         f"{'mp_rank_TT (pp = 1)' if plain_names else 'mp_rank_TT_PPP (pp > 1)'}: the checkpoint "
                         f"is inconsistent")
    expected = {(t, p): directory / shard_dir_name(t, p, pp) / SHARD_FILE for t in range(tp) for p in range(pp)}
    missing = [str(file) for key, file in expected.items() if not file.is_file()]
    if missing:
        raise FileNotFoundError(f"Megatron-LM checkpoint {directory} (tp = {tp}, pp = {pp}) is missing "
                                f"{len(missing)} shard file(s): {', '.join(missing)}; copy the whole checkpoint")
    extra = sorted(str(file.parent.name) for key, file in found.items() if key not in expected)
    if extra:
        raise ValueError(f"{directory} holds {', '.join(extra)}, outside the tp = {tp} × pp = {pp} grid that "
                         f"args names: the checkpoint is inconsistent")
    if any(key.startswith("model") and key[5:].isdigit() for key in state):
        raise ValueError(f"{first} holds model0, model1, ...: a virtual-pipeline (interleaved) checkpoint, which "
                         f"this converter does not read; re-save it without virtual pipeline stages")
    return MegatronCheckpoint(directory, iteration, tp, pp, expected, args, float(state.get("checkpoint_version", 0)),
                              allow_numpy, source)


def flatten(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """Nested state dicts -> {"a.b.c": tensor}; non-tensors and TransformerEngine's _extra_state are left out."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        elif isinstance(value, torch.Tensor) and not name.endswith("_extra_state"):
            flat[name] = value
    return flat

