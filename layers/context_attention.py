"""Attention under context parallelism: this rank's queries against the whole sequence's keys.

    q, k, v of this rank's two chunks (rotary already at their global positions)
      -> k and v all-gathered over cp into the sequence's order (one collective; backward
         reduce-scatters dK and dV back to the ranks' chunks: `distributed.gather_sequence`)
      -> each local chunk's queries against the keys it may see, masked by global position
      -> the chunks' outputs side by side, as this rank's tokens came

All-gather, not a ring (Llama 3's choice, "The Llama 3 Herd of Models" §3.3.2): it moves the K
and V a ring passes, in one collective, and under grouped-query attention they are 1/g of the
query heads' width, small next to the attention's compute; every mask (causal, sliding window,
packed documents, padding) is then one process's rows for this rank's queries, built from global
positions, with no per-step block schedule, partial outputs or log-sum-exp merge to get right; and
one SDPA call per chunk keeps the fused kernels. The price: each rank holds the whole sequence's K and V of its heads while a layer
runs (and saves it for backward), and the exchange is not overlapped with compute as a ring's is.

The mask is the attention layer's own (`ContextMask`), made from the whole sequence: the model
code hands the layers their inputs unchanged (`attention_masks.layer_attention_mask`). Causal chunk i of
the 2·cp sees the keys [0, end of chunk i) (under a sliding window w, only from its first query's
position − w + 1 on: the rest is never computed); with no other rule its queries get a lower-right
aligned causal bias (`torch.nn.attention.bias.causal_lower_right`, made through this module's
mask factory `causal_bias`, which `causal_biases_made_by` swaps: the planner's fake tensors cannot
make one), which SDPA runs with a flash kernel where the device has one (SDPA's own ``is_causal``
aligns top-left: wrong with fewer queries than keys). Any other rule (sliding window, documents,
padding), and a layer that computes its scores itself (soft-cap, sinks), gets an explicit boolean
mask per chunk, made once per forward for all the layers of one kind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.nn.attention.bias import causal_lower_right

from libai_zoo.distributed.context_parallel import ContextParallel, all_gather_sequence, gather_sequence

#: one SDPA call of a rank's queries: (first query, end of its queries, first and end of the keys it sees, mask)
Segment = tuple[int, int, int, int, "torch.Tensor | None"]

_causal_bias: Callable[[int, int], torch.Tensor] = causal_lower_right


def causal_bias(queries: int, keys: int) -> torch.Tensor:
    """The mask factory of a causal chunk with no other rule: the lower-right aligned causal bias
    of `queries` queries over `keys` keys (torch's `causal_lower_right`, a `CausalBias` holding
    no data), or what the factory given to `causal_biases_made_by` makes."""
    return _causal_bias(queries, keys)


@contextmanager
def causal_biases_made_by(factory: Callable[[int, int], torch.Tensor]) -> Iterator[None]:
    """Meanwhile `ContextMask` makes its lower-right causal biases as ``factory(queries, keys)``
    (the seam of `causal_bias`): the planner makes torch's outside its fake tensor mode."""
    global _causal_bias
    previous, _causal_bias = _causal_bias, factory
    try:
        yield
    finally:
        _causal_bias = previous


class ContextMask:
    """What attention under cp masks by, gathered once over cp and shared by every layer of a
    forward: the whole sequence's padding (a 2-D attention_mask, 1 = token) and, for packed samples
    (no attention_mask and position_ids that restart: transformers' rule, as `packed_causal_mask`),
    the document of every token. Each kind of layer (causal or not, its window) builds its masks at
    its first call (`segments`) and the others reuse them. ``padding`` is this rank's own part of
    the attention_mask (a token mask for MoE routing)."""

    def __init__(self, cp: ContextParallel, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor | None):
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(f"under context parallelism attention takes a 2-D padding attention_mask [B, S] "
                             f"(1 = token), not a {attention_mask.dim()}-D one: pass the padding, or pack the "
                             f"samples with restarting position_ids (documents are masked by those)")
        self.cp, self.padding = cp, attention_mask
        self.key_padding = None if attention_mask is None else all_gather_sequence(attention_mask.bool(), cp, -1)
        self.documents = self.last_position = None
        if position_ids is not None:
            positions = all_gather_sequence(position_ids, cp, -1)
            self.last_position = positions.max()
            starts = torch.diff(positions, prepend=positions[..., :1] - 1, dim=-1) != 1
            if attention_mask is None and starts.any():
                self.documents = starts.cumsum(-1)  # [B, S]: which packed sequence each token belongs to
        self._segments: dict[tuple, list[Segment]] = {}

    @classmethod
    def of(cls, cp: ContextParallel, attention_mask: torch.Tensor | ContextMask | None,
           position_ids: torch.Tensor | None, kv_cache: object | None) -> ContextMask:
        """The mask a layer under cp uses: the model's (made once per forward), or its own from the
        inputs it was given (a layer called on its own)."""
        if kv_cache is not None:
            raise ValueError("generation (a KV cache) is not supported under context parallelism: "
                             "generate with the model unsplit (cp = 1)")
        if isinstance(attention_mask, ContextMask):
            return attention_mask
        return cls(cp, attention_mask, position_ids)

    def positions(self, position_ids: torch.Tensor | None, length: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's position_ids for rotary (as given: global under cp, the data split them; else
        its `length` tokens' places in an unpacked sequence), and the whole sequence's last position,
        by which longrope picks its frequencies (not by this rank's last)."""
        if position_ids is None:
            total = length * self.cp.size
            return self.cp.positions(total, device)[None], torch.tensor(total - 1, device=device)
        return position_ids, self.last_position

    def segments(self, length: int, device: torch.device, *, causal: bool, sliding_window: int | None,
                 explicit: bool) -> list[Segment]:
        """The SDPA calls of a layer over this rank's `length` queries: per chunk when causal (its
        keys end where the chunk does, and under a sliding window begin where its first query's
        window does), else one over the whole sequence; a mask is a lower-right causal bias
        (`causal_bias`) or None where only causality rules (unless ``explicit``: then a boolean
        one), else boolean [B or 1, 1, queries, keys] (True = attend)."""
        key = (length, device, causal, sliding_window, explicit)
        if key not in self._segments:
            self._segments[key] = self._build(length, device, causal, sliding_window, explicit)
        return self._segments[key]

    def _build(self, length: int, device: torch.device, causal: bool, window: int | None,
               explicit: bool) -> list[Segment]:
        total, half = length * self.cp.size, length // 2
        everywhere = self.cp.positions(total, device)  # this rank's tokens' places in the sequence
        if causal:  # chunk `chunk` of the 2·cp is this rank's j-th: its keys end where it does
            spans = [(j * half, (j + 1) * half, 0 if window is None else max(0, chunk * half - window + 1),
                      (chunk + 1) * half) for j, chunk in enumerate(self.cp.chunks)]
        else:
            spans = [(0, length, 0, total)]
        plain = window is None and self.documents is None and self.key_padding is None
        segments = []
        for start, stop, begin, end in spans:
            if plain and not explicit:
                segments.append((start, stop, begin, end, causal_bias(stop - start, end) if causal else None))
                continue
            q_pos, k_pos = everywhere[start:stop, None], torch.arange(begin, end, device=device)[None]
            allowed = torch.ones(stop - start, end - begin, dtype=torch.bool, device=device)
            if causal:
                allowed &= k_pos <= q_pos
            if window is not None:
                allowed &= (q_pos - k_pos if causal else (q_pos - k_pos).abs()) < window
            allowed = allowed[None, None]
            if self.documents is not None:
                docs = self.documents
                allowed = allowed & (docs[:, everywhere[start:stop]][:, None, :, None]
                                     == docs[:, None, None, begin:end])
            if self.key_padding is not None:
                allowed = allowed & self.key_padding[:, None, None, begin:end]
            segments.append((start, stop, begin, end, allowed))
        return segments


def context_attention(cp: ContextParallel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: ContextMask,
                      core: Callable[..., torch.Tensor], *, causal: bool, sliding_window: int | None = None,
                      explicit: bool = False) -> torch.Tensor:
    """This rank's queries q [B, H, S_loc, d] (its two chunks) against the whole sequence's keys:
    k [B, H_kv, S_loc, d] and v [B, H_kv, S_loc, d_v] all-gathered over cp in one collective, then
    ``core(q, k, v, mask)`` (the layer's SDPA, or its explicit scores when ``explicit``) once per
    `ContextMask.segments`; returns [B, H, S_loc, d_v]."""
    if q.shape[2] % 2:
        raise ValueError(f"{q.shape[2]} tokens on a cp rank are not two equal chunks: make the sequence length "
                         f"a multiple of 2·cp = {2 * cp.size}")
    width = k.shape[-1]
    kv = gather_sequence(torch.cat((k.movedim(2, 0), v.movedim(2, 0)), dim=-1), cp, dim=0)
    k, v = (t.movedim(0, 2) for t in kv.split([width, kv.shape[-1] - width], dim=-1))
    segments = mask.segments(q.shape[2], q.device, causal=causal, sliding_window=sliding_window, explicit=explicit)
    outs = [core(q[:, :, start:stop], k[:, :, begin:end], v[:, :, begin:end], mask)
            for start, stop, begin, end, mask in segments]
    if len(outs) == 1:
        return outs[0]
    # joined token-major, so the caller's [B, S, H · d_v] is a view of it, not one more copy
    return torch.cat([out.transpose(1, 2) for out in outs], dim=1).transpose(1, 2)
