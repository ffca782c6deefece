"""Megatron-LM's `torch_dist` checkpoint directories, read and written without running a pickle.

Megatron-LM (Megatron-Core models, `--ckpt-format torch_dist`, its default) writes one directory
per iteration:

    MEGATRON_DIR/
      latest_checkpointed_iteration.txt     "1000", or "release"
      iter_0001000/ (or release/)
        .metadata, __R_I.distcp             a torch.distributed.checkpoint: every tensor under its
                                            global name and shape, whatever tp/pp/ep saved it
        common.pt                           torch.save of what is not sharded: "args" (the run's
                                            argparse.Namespace), "iteration", "checkpoint_version", ...
        metadata.json                       {"sharded_backend": "torch_dist", ...}

The layers of a homogeneous decoder are stacked into one tensor per kind with a leading layer
axis (`decoder.layers.self_attention.linear_qkv.weight`: [num_layers, rows, cols]);
heterogeneous models keep `decoder.layers.{i}.*`. `read_tensors` and `write_checkpoint` take and
give per-layer names (`decoder.layers.{i}.*`) either way.

Safety: DCP's own reader unpickles `.metadata` with `pickle.load`; `SafeReader` allows in it only
torch.distributed.checkpoint's metadata classes, torch.Size and dtypes. Tensors come through
``torch.load(weights_only=True)``, and `common.pt` through ``weights_only`` with
argparse.Namespace and Megatron's enums (read as text; no Megatron code runs).
"""

from __future__ import annotations

import importlib
import json
import pickle
import re
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, load, save
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .megatron_files import load_file

COMMON = "common.pt"
METADATA_JSON = "metadata.json"
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
           "common_backend_version": 1}
# What a Megatron-Core GPT model's tensors are named under (the rest: optimizer, rng, ... not read).
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")
LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)$")
STACKED = "decoder.layers."
# The layer modules that keep an `_extra_state` (Transformer Engine's FP8 metadata; None in
# Megatron-Core's local layers): its loader requires one per layer and linear module (per expert
# for the experts), for either layer spec; core attention's is Transformer Engine's.
LINEAR_MODULE = re.compile(r"(.*linear_(?:qkv|proj|fc1|fc2))\.weight$")
CORE_ATTENTION = "self_attention.core_attention"
EXPERTS = "mlp.experts.experts."


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata`: its metadata dataclasses and enums, torch.Size, dtypes, layouts
    and paths, each by name."""

    ALLOWED = {
        "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                                  "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex",
                                                  "StorageMeta", "_MEM_FORMAT_ENCODING"},
        "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "collections": {"OrderedDict"},
        "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath"},
        "pathlib._local": {"PosixPath", "PurePosixPath", "WindowsPath"},
    }

    def find_class(self, module: str, name: str):
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if name in self.ALLOWED.get(module, ()):
            return getattr(importlib.import_module(module), name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a torch.distributed.checkpoint metadata class; "
                                     f"it is not unpickled for safety")


class SafeReader(FileSystemReader):
    """torch.distributed.checkpoint's file reader with `.metadata` unpickled by an allow-list."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as file:
                metadata = _MetadataUnpickler(file).load()
        except pickle.UnpicklingError as error:
            raise ValueError(f"{path}: {error}") from None
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


def read_common(directory: Path) -> dict:
    """`common.pt` through ``torch.load(weights_only=True)`` (`megatron_files.load_file`)."""
    path = directory / COMMON
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no {COMMON}: a Megatron-LM torch_dist checkpoint keeps its run "
                                f"arguments there; copy the whole iteration directory")
    return load_file(path, mmap=False)


def is_torch_dist(directory: Path) -> bool:
    """Whether `directory` is a torch_dist iteration directory."""
    if (directory / METADATA_JSON).is_file():
        backend = json.loads((directory / METADATA_JSON).read_text()).get("sharded_backend")
        if backend != "torch_dist":
            raise ValueError(f"{directory} is a Megatron-Core checkpoint in the {backend!r} format; torch_dist (and "
                             f"per-rank torch files) are read: convert it with Megatron-LM's --ckpt-convert-format "
                             f"torch_dist")
        return True
    return (directory / ".metadata").is_file() and (directory / COMMON).is_file()


def tensor_shapes(directory: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Every tensor of the checkpoint (model, optimizer, ...): global shape and dtype, from `.metadata`."""
    metadata = SafeReader(str(directory)).read_metadata()
    return {key: (item.size, item.properties.dtype) for key, item in metadata.state_dict_metadata.items()
            if isinstance(item, TensorStorageMetadata)}


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a torch_dist checkpoint, whole, under per-layer names (stacked layers
    unstacked along their leading axis; `_extra_state` left out)."""
    keys = {key: spec for key, spec in tensor_shapes(directory).items()
            if key.startswith(MODEL_PREFIXES) and "_extra_state" not in key}
    state = {key: torch.empty(size, dtype=dtype) for key, (size, dtype) in keys.items()}
    with warnings.catch_warnings():  # DCP warns that it runs without a process group: here that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load(state, storage_reader=SafeReader(str(directory)))
    tensors = {}
    for key, tensor in state.items():
        if key.startswith(STACKED) and not LAYER.match(key):
            tensors.update({f"{STACKED}{i}.{key[len(STACKED):]}": layer for i, layer in enumerate(tensor)})
        else:
            tensors[key] = tensor
    return tensors


def write_checkpoint(directory: Path, tensors: dict[str, torch.Tensor], common: dict, *,
                     stacked: bool = True) -> None:
    """Write a torch_dist iteration directory Megatron-Core loads: per-layer names stacked into
    `decoder.layers.*` [num_layers, ...] (every layer has the same tensors), or kept per layer
    when not `stacked` (Megatron-Core's heterogeneous layers: dense and MoE ones), an empty
    `_extra_state` per layer module, `common` as common.pt."""
    layers: dict[int, dict[str, torch.Tensor]] = {}
    flat = {}
    for name, tensor in tensors.items():
        match = LAYER.match(name)
        if match:
            layers.setdefault(int(match[1]), {})[match[2]] = tensor
        else:
            flat[name] = tensor
    count = len(layers)
    for i, layer in sorted(layers.items()):
        prefix, (at, of) = (STACKED, (i, count)) if stacked else (f"{STACKED}{i}.", (0, 1))
        if not stacked:
            flat.update({prefix + name: tensor for name, tensor in layer.items()})
        # what Megatron-Core's loader asks for besides tensors: a list of the objects, where None
        # means "nothing to restore" to its local layers and to Transformer Engine's
        for module in sorted({m[1] for m in map(LINEAR_MODULE.match, layer) if m} | {CORE_ATTENTION}):
            if module.startswith(EXPERTS):
                experts = layer[f"{module}.weight"].shape[0]
                shards = [f"{at}.{e}_{of}.{experts}" if stacked else f"{e}_{experts}" for e in range(experts)]
            else:
                shards = [f"{at}_{of}"]
            flat.update({f"{prefix}{module}._extra_state/shard_{shard}": [None] for shard in shards})
    if stacked:
        for name in layers[0] if layers else ():
            flat[STACKED + name] = torch.stack([layers[i][name] for i in range(count)])
    directory.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        save(flat, storage_writer=FileSystemWriter(str(directory)))
    torch.save(common, directory / COMMON)
    (directory / METADATA_JSON).write_text(json.dumps(BACKEND))
