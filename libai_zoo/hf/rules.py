"""How one libai_zoo parameter is made from Hugging Face tensors, and turned back into them.

Each model lists its rules in a `WeightMap` (models/hf_maps/: one file per model).

A rule knows both directions and, for loading, how to read only the part of the Hugging Face
tensors that makes up one tensor-parallel shard of the parameter: `load` gets ``shard =
(dim, index, count)`` (this rank holds slice `index` of `count` along `dim`) or None for the
whole tensor, and a `read(name, dim, start, end)` that reads a range of a checkpoint tensor.
Fused QKV is grouped per KV head (`libai_zoo.layers.fuse_qkv`), so a shard of it is made from
the same shard of each of q, k and v: no rank ever reads another rank's heads.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from libai_zoo.dist import local_range
from libai_zoo.layers import fuse_qkv, split_qkv

Read = Callable[..., torch.Tensor]
Shard = tuple[int, int, int] | None


class Rule:
    """Base: `zoo` is the parameter name, `hf` the checkpoint names it is made from."""

    zoo: str

    @property
    def hf(self) -> tuple[str, ...]:
        raise NotImplementedError

    def load(self, read: Read, shard: Shard, zoo_shape: torch.Size) -> torch.Tensor:
        raise NotImplementedError

    def save(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def hf_shapes(self, zoo_shape: torch.Size) -> dict[str, torch.Size]:
        """The checkpoint shapes a parameter of `zoo_shape` corresponds to."""
        return {name: t.shape for name, t in self.save(torch.empty(zoo_shape, device="meta")).items()}


@dataclass
class Same(Rule):
    """One checkpoint tensor in the same layout."""

    zoo: str
    name: str

    @property
    def hf(self) -> tuple[str, ...]:
        return (self.name,)

    def load(self, read, shard, zoo_shape):
        if shard is None:
            return read(self.name)
        dim, index, count = shard
        return read(self.name, dim, *local_range(zoo_shape[dim], index, count))

    def save(self, tensor):
        return {self.name: tensor}


@dataclass
class Transposed(Same):
    """A 2-D checkpoint tensor stored [in, out], as GPT-2's Conv1D does; nn.Linear keeps [out, in]."""

    def load(self, read, shard, zoo_shape):
        if shard is None:
            return read(self.name).t().contiguous()
        dim, index, count = shard
        return read(self.name, 1 - dim, *local_range(zoo_shape[dim], index, count)).t().contiguous()

    def save(self, tensor):
        return {self.name: tensor.t().contiguous()}


@dataclass
class Reshaped(Same):
    """A replicated parameter kept in another shape (ViT's patch convolution as a linear layer)."""

    hf_shape: tuple[int, ...] = ()

    def load(self, read, shard, zoo_shape):
        if shard is not None:
            raise ValueError(f"{self.zoo} is replicated: it cannot be loaded by shards")
        return read(self.name).reshape(zoo_shape)

    def save(self, tensor):
        return {self.name: tensor.reshape(self.hf_shape)}


@dataclass
class QKV(Rule):
    """Separate q, k, v projections (weights or biases) -> the grouped fused `qkv` of `Attention`."""

    zoo: str
    q: str
    k: str
    v: str
    num_heads: int
    num_kv_heads: int

    @property
    def hf(self) -> tuple[str, ...]:
        return (self.q, self.k, self.v)

    def load(self, read, shard, zoo_shape):
        index, count = _row_shard(self.zoo, shard)
        head_dim = zoo_shape[0] // (self.num_heads + 2 * self.num_kv_heads)
        rows = {self.q: self.num_heads * head_dim, self.k: self.num_kv_heads * head_dim,
                self.v: self.num_kv_heads * head_dim}
        parts = [read(name, 0, *local_range(size, index, count)) for name, size in rows.items()]
        return fuse_qkv(*parts, self.num_kv_heads // count)

    def save(self, tensor):
        return dict(zip(self.hf, split_qkv(tensor, self.num_heads, self.num_kv_heads)))


@dataclass
class PackedQKV(Rule):
    """GPT-2's c_attn: [q | k | v] side by side in one Conv1D ([in, 3h] weight, [3h] bias)."""

    zoo: str
    name: str
    num_heads: int

    @property
    def hf(self) -> tuple[str, ...]:
        return (self.name,)

    def load(self, read, shard, zoo_shape):
        index, count = _row_shard(self.zoo, shard)
        width = zoo_shape[0] // 3
        out_dim = len(zoo_shape) - 1  # Conv1D keeps the output features last
        start, end = local_range(width, index, count)
        parts = [read(self.name, out_dim, part * width + start, part * width + end) for part in range(3)]
        return fuse_qkv(*(p.t() if out_dim else p for p in parts), self.num_heads // count)

    def save(self, tensor):
        packed = torch.cat(split_qkv(tensor, self.num_heads, self.num_heads))
        return {self.name: packed.t().contiguous() if packed.dim() == 2 else packed}


def _row_shard(zoo: str, shard: Shard) -> tuple[int, int]:
    if shard is None:
        return 0, 1
    dim, index, count = shard
    if dim != 0:
        raise ValueError(f"{zoo} is a fused QKV projection: it is split by output rows, not along dim {dim}")
    return index, count


class WeightMap:
    """The rules of one model, plus checkpoint names that may be present and carry nothing
    (buffers saved by old versions, tied copies): regular expressions in `ignore`."""

    def __init__(self, rules: list[Rule], ignore: tuple[str, ...] = ()):
        self.rules = rules
        self._ignore = [re.compile(pattern) for pattern in ignore]

    def ignored(self, name: str) -> bool:
        return any(pattern.fullmatch(name) for pattern in self._ignore)


def linear(zoo: str, hf: str, *, bias: bool = True, transposed: bool = False) -> list[Rule]:
    """Rules of a linear layer (or norm): `zoo`.weight/.bias from `hf`.weight/.bias."""
    weight = (Transposed if transposed else Same)(f"{zoo}.weight", f"{hf}.weight")
    return [weight, Same(f"{zoo}.bias", f"{hf}.bias")] if bias else [weight]


def qkv(zoo: str, q: str, k: str, v: str, num_heads: int, num_kv_heads: int, *, bias: bool = True) -> list[Rule]:
    """Rules of a fused `qkv` from three projections' .weight (and .bias)."""
    suffixes = ("weight", "bias") if bias else ("weight",)
    return [QKV(f"{zoo}.{s}", f"{q}.{s}", f"{k}.{s}", f"{v}.{s}", num_heads, num_kv_heads) for s in suffixes]
