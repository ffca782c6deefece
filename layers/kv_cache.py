"""Keys and values of past positions, so generation computes each new token's attention only."""

from __future__ import annotations

import torch


class KVCache:
    """One attention layer's cache, preallocated for `max_length` positions on first use.

    Holds this rank's heads only (whatever tp gave the layer). `update` appends the new
    positions' keys and values and returns those of every position so far.
    """

    def __init__(self, max_length: int):
        self.max_length = max_length
        self.length = 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, S_new, ...] -> keys, values [B, length + S_new, ...] (views of the cache)."""
        end = self.length + k.shape[1]
        if end > self.max_length:
            raise ValueError(f"KV cache holds {self.max_length} positions, {end} were asked for: "
                             f"make it longer (prompt length + max_new_tokens)")
        if self.keys is None:
            self.keys = k.new_empty(k.shape[0], self.max_length, *k.shape[2:])
            self.values = v.new_empty(v.shape[0], self.max_length, *v.shape[2:])
        self.keys[:, self.length:end] = k
        self.values[:, self.length:end] = v
        self.length = end
        return self.keys[:, :end], self.values[:, :end]
