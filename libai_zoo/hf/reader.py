"""Read a Hugging Face model directory: its config.json, and its tensors whole or one slice at a time.

Accepts what `transformers` writes: ``model.safetensors``, sharded
``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``, and the legacy
``pytorch_model.bin`` (optionally sharded with its index), the latter only through
``torch.load(weights_only=True)``. Slices come from ``safe_open(...).get_slice``, so a
tensor-parallel rank reads only the bytes of its own shard; `bytes_read` counts them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from libai_zoo.utils.transformers_versions import DTYPE_KEYS

CONFIG = "config.json"
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE, PICKLE_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def read_config(path: str | Path) -> dict:
    """config.json of the Hugging Face model directory `path`, with errors that say what it lacks."""
    path = Path(path)
    config_file = path / CONFIG
    if not config_file.is_file():
        what = "does not exist" if not path.exists() else f"has no {CONFIG}"
        raise FileNotFoundError(f"{path} {what}: a Hugging Face model directory holds {CONFIG} and the weights "
                                f"({SAFETENSORS}, or shards with {SAFETENSORS_INDEX}); the recipes' stand-ins are "
                                f"written by `python tools/make_tiny_hf_model.py KIND {path}` (each recipe's "
                                f"docstring gives its line)")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_file} is not valid JSON ({error}): restore it from the model's source") from None


@dataclass(frozen=True)
class Container:
    """A larger model whose directories hold a zoo model (Gemma 3's multimodal model holds its
    text model): the zoo model's config is the container config's `config_key`, its tensors are
    those under `prefix`, and those under `skipped` (the container's other parts) are not read."""

    config_key: str
    prefix: str
    skipped: tuple[str, ...] = ()

    def inner_config(self, config: dict) -> dict:
        """The held model's config out of the container's, with the container's dtype and head
        tying (transformers ties the container's head by the container's tie_word_embeddings)."""
        outer = {key: config[key] for key in (*DTYPE_KEYS, "tie_word_embeddings") if key in config}
        return {**config[self.config_key], **outer}

    def names(self, keys: list[str]) -> dict[str, str]:
        """The held model's name of each checkpoint tensor (the prefix dropped) -> the checkpoint's
        name; the skipped parts left out."""
        return {key.removeprefix(self.prefix): key for key in keys if not key.startswith(self.skipped)}


class HFWeightReader:
    """Names, shapes, dtypes and (sliced) contents of the weights in `path`; use as a context manager."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.bytes_read = 0
        self._handles: dict[str, object] = {}
        self._file_of = self._index()

    def _index(self) -> dict[str, str]:
        for single, index in ((SAFETENSORS, SAFETENSORS_INDEX), (PICKLE, PICKLE_INDEX)):
            if (self.path / index).is_file():
                weight_map = json.loads((self.path / index).read_text())["weight_map"]
                missing = sorted({f for f in weight_map.values() if not (self.path / f).is_file()})
                if missing:
                    raise FileNotFoundError(f"{self.path / index} lists weight files that are not in {self.path}: "
                                            f"{', '.join(missing)}; copy the whole checkpoint directory")
                return weight_map
            if (self.path / single).is_file():
                return {name: single for name in self._open(single).keys()}
        raise FileNotFoundError(f"no weights in {self.path}: expected {SAFETENSORS}, {SAFETENSORS_INDEX} "
                                f"(sharded), {PICKLE} or {PICKLE_INDEX}")

    def _open(self, file: str):
        if file not in self._handles:
            try:
                if file.endswith(".safetensors"):
                    self._handles[file] = safe_open(str(self.path / file), framework="pt", device="cpu")
                else:
                    self._handles[file] = torch.load(self.path / file, map_location="cpu", weights_only=True,
                                                     mmap=True)
            except (SafetensorError, RuntimeError) as error:
                raise ValueError(f"{self.path / file} is truncated or corrupt ({error}): copy or download it "
                                 f"again") from None
        return self._handles[file]

    def keys(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        handle = self._open(self._file_of[name])
        if isinstance(handle, dict):
            return tuple(handle[name].shape)
        return tuple(handle.get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype's name ("float32", "bfloat16", ...)."""
        handle = self._open(self._file_of[name])
        if isinstance(handle, dict):
            return str(handle[name].dtype).removeprefix("torch.")
        stored = handle.get_slice(name).get_dtype()
        return SAFETENSORS_DTYPES.get(stored, stored)

    def read(self, name: str, ranges: dict[int, tuple[int, int]] | None = None) -> torch.Tensor:
        """The tensor `name`, or only its block {dim: [start, end)} (other dims whole)."""
        file = self._file_of[name]
        handle = self._open(file)
        index = tuple(slice(*ranges.get(d, (None, None))) for d in range(max(ranges) + 1)) if ranges else ()
        if isinstance(handle, dict):
            tensor = handle[name][index].clone()
        else:
            try:
                sliced = handle.get_slice(name)
                tensor = sliced[index] if index else sliced[:]
            except SafetensorError as error:
                raise ValueError(f"{self.path / file} is truncated or corrupt: reading {name} failed ({error}); "
                                 f"copy or download it again") from None
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> HFWeightReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
