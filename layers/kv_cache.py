"""Keys and values of past positions, so generation computes each new token's attention only;
an encoder-decoder's decoder also keeps its cross-attentions' keys and values of the encoder's
output, projected once at the first step (`EncoderDecoderCache`)."""

from __future__ import annotations

from dataclasses import dataclass

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
        return self.cached()

    def cached(self) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [B, length, ...] of every position so far (views of the cache)."""
        return self.keys[:, :self.length], self.values[:, :self.length]


@dataclass
class EncoderDecoderCache:
    """A decoder's caches for generation, one per layer of each kind: its self-attentions' (one
    more position per step) and its cross-attentions' (the encoder's keys and values, projected at
    the first step and read at every later one: a cross-attention given a filled cache projects
    only its queries)."""

    self_attention: list[KVCache]
    cross_attention: list[KVCache]

    @classmethod
    def empty(cls, num_layers: int, max_length: int, encoder_length: int) -> EncoderDecoderCache:
        """Caches for `num_layers` decoder layers generating up to `max_length` positions after an
        encoder output of `encoder_length` positions."""
        return cls([KVCache(max_length) for _ in range(num_layers)],
                   [KVCache(encoder_length) for _ in range(num_layers)])

    @property
    def length(self) -> int:
        """The decoder positions cached so far."""
        return self.self_attention[0].length
