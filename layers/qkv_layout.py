"""The layout of fused attention projections: how q, k and v (or a cross-attention's k and v) lie
in one weight.

`Attention`'s `qkv` is grouped per KV head, Megatron-LM's order ([g0: its q heads, k0, v0 | g1: ...]),
so any equal tp split of its rows holds whole groups and one checkpoint serves every layout;
`fuse_qkv`/`split_qkv` go between it and separate Q, K, V weights (or biases), `fuse_kv`/`split_kv`
do the same for a cross-attention's `kv`.
"""

from __future__ import annotations

import torch


def _interleave_groups(parts: list[torch.Tensor], num_groups: int) -> torch.Tensor:
    """Cut each part into `num_groups` row blocks and put block i of every part side by side."""
    blocks = [p.reshape(num_groups, p.shape[0] // num_groups, *p.shape[1:]) for p in parts]
    fused = torch.cat(blocks, dim=1)
    return fused.reshape(-1, *fused.shape[2:])


def _split_groups(fused: torch.Tensor, num_groups: int, rows: list[int]) -> list[torch.Tensor]:
    grouped = fused.reshape(num_groups, -1, *fused.shape[1:])
    pieces = grouped.split([r // num_groups for r in rows], dim=1)
    return [p.reshape(-1, *fused.shape[1:]) for p in pieces]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Separate Q, K, V weights (or biases), heads along dim 0, -> the grouped `qkv` layout:
    [g0: its q heads, k0, v0 | g1: ... ], so any equal tp split of the rows holds whole groups."""
    return _interleave_groups([q, k, v], num_kv_heads)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int) -> list[torch.Tensor]:
    """The grouped `qkv` weight (or bias) -> [q, k, v], inverse of `fuse_qkv`."""
    head_dim = qkv.shape[0] // (num_heads + 2 * num_kv_heads)
    kv_rows = num_kv_heads * head_dim
    return _split_groups(qkv, num_kv_heads, [num_heads * head_dim, kv_rows, kv_rows])


def fuse_kv(k: torch.Tensor, v: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Separate K, V weights (or biases) -> the grouped `kv` layout of cross-attention [k0, v0 | k1, v1 | ...]."""
    return _interleave_groups([k, v], num_kv_heads)


def split_kv(kv: torch.Tensor, num_kv_heads: int) -> list[torch.Tensor]:
    """The grouped cross-attention `kv` weight (or bias) -> [k, v], inverse of `fuse_kv`."""
    return _split_groups(kv, num_kv_heads, [kv.shape[0] // 2] * 2)

