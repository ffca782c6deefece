"""Fused weights that any equal tensor-parallel split cuts into whole units.

A fused QKV weight is laid out per KV-head group, [g0: q heads, k, v | g1: q heads, k, v | ...],
and a fused gate/up weight per neuron, [gate0, up0, gate1, up1, ...]. Splitting either by rows
into tp equal parts gives each rank whole groups, whatever tp is (Megatron-LM's QKV order), so
the same checkpoint loads at any tensor-parallel size. These two functions convert between that
layout and the separate tensors a Hugging Face checkpoint holds.
"""

from __future__ import annotations

import torch


def interleave_groups(parts: list[torch.Tensor], num_groups: int) -> torch.Tensor:
    """Fuse weights or biases along dim 0 group by group: each part is cut into `num_groups`
    equal row blocks and the blocks of group i of every part are put next to each other."""
    blocks = [p.reshape(num_groups, p.shape[0] // num_groups, *p.shape[1:]) for p in parts]
    fused = torch.cat(blocks, dim=1)
    return fused.reshape(-1, *fused.shape[2:])


def split_groups(fused: torch.Tensor, num_groups: int, rows: list[int]) -> list[torch.Tensor]:
    """Undo `interleave_groups`: `rows` are the total row counts of the original parts."""
    grouped = fused.reshape(num_groups, -1, *fused.shape[1:])
    pieces = grouped.split([r // num_groups for r in rows], dim=1)
    return [p.reshape(-1, *fused.shape[1:]) for p in pieces]
