"""Attention under context parallelism: this rank's queries against the whole sequence's keys.

    q, k, v of this rank's two chunks (rotary already at their global positions)
      -> k and v all-gathered over cp into the sequence's order (one collective; backward
         reduce-scatters dK and dV back to the ranks' chunks: `distributed.gather_sequence`)
      -> each local chunk's queries against the keys it may see, masked by global position
      -> the chunks' outputs side by side, as this rank's tokens came

All-gather, not a ring (Llama 3's choice, "The Llama 3 Herd of Models" §3.3.2): under grouped-query
attention K and V are 1/g of the query heads, so gathering them costs less than passing them round
a ring would save; every mask (causal, sliding window, packed documents, padding) is then one
process's rows for this rank's queries, built from global positions, with no per-step block
schedule, partial outputs or log-sum-exp merge to get right; and one SDPA call per chunk keeps the
fused kernels. The price: each rank holds the whole sequence's K and V of its heads while a layer
runs (and saves it for backward), and the exchange is not overlapped with compute as a ring's is.

The mask is the attention layer's own (`ContextMask`), made from the whole sequence: the model
code hands the layers their inputs unchanged (`attention.layer_attention_mask`). Causal chunk i of
the 2·cp sees the keys [0, end of chunk i); with no other rule its queries get a lower-right
aligned causal bias (`torch.nn.attention.bias.causal_lower_right`), which SDPA runs with a flash
kernel where the device has one (SDPA's own ``is_causal`` aligns top-left: wrong with fewer
queries than keys). Any other rule (sliding window, documents, padding), and a layer that computes
its scores itself (soft-cap, sinks), gets an explicit boolean mask per chunk, made once per forward
for all the layers of one kind.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.attention.bias import causal_lower_right

from libai_zoo.distributed.context_parallel import ContextParallel, all_gather_sequence, gather_sequence

#: one SDPA call of a rank's queries: (first query, end of its queries, end of the keys it sees, its mask)
Segment = tuple[int, int, int, "torch.Tensor | None"]


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
        self.documents = None
        if attention_mask is None and position_ids is not None:
            positions = all_gather_sequence(position_ids, cp, -1)
            starts = torch.diff(positions, prepend=positions[..., :1] - 1, dim=-1) != 1
            if starts.any():
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

    def segments(self, length: int, device: torch.device, *, causal: bool, sliding_window: int | None,
                 explicit: bool) -> list[Segment]:
        """The SDPA calls of a layer over this rank's `length` queries: per chunk when causal (its
        keys end where the chunk does), else one over the whole sequence; a mask is a
        `causal_lower_right` bias or None where only causality rules (unless ``explicit``: then a
        boolean one), else boolean [B or 1, 1, queries, keys] (True = attend)."""
        key = (length, device, causal, sliding_window, explicit)
        if key not in self._segments:
            self._segments[key] = self._build(length, device, causal, sliding_window, explicit)
        return self._segments[key]

    def _build(self, length: int, device: torch.device, causal: bool, window: int | None,
               explicit: bool) -> list[Segment]:
        total, half = length * self.cp.size, length // 2
        everywhere = self.cp.positions(total, device)  # this rank's tokens' places in the sequence
        if causal:
            spans = [(j * half, (j + 1) * half, (chunk + 1) * half) for j, chunk in enumerate(self.cp.chunks)]
        else:
            spans = [(0, length, total)]
        plain = window is None and self.documents is None and self.key_padding is None
        segments = []
        for start, stop, end in spans:
            if plain and not explicit:
                segments.append((start, stop, end, causal_lower_right(stop - start, end) if causal else None))
                continue
            q_pos, k_pos = everywhere[start:stop, None], torch.arange(end, device=device)[None]
            allowed = torch.ones(stop - start, end, dtype=torch.bool, device=device)
            if causal:
                allowed &= k_pos <= q_pos
            if window is not None:
                allowed &= (q_pos - k_pos if causal else (q_pos - k_pos).abs()) < window
            allowed = allowed[None, None]
            if self.documents is not None:
                docs = self.documents
                allowed = allowed & (docs[:, everywhere[start:stop]][:, None, :, None] == docs[:, None, None, :end])
            if self.key_padding is not None:
                allowed = allowed & self.key_padding[:, None, None, :end]
            segments.append((start, stop, end, allowed))
        return segments


def global_positions(cp: ContextParallel, position_ids: torch.Tensor | None, length: int,
                     device: torch.device) -> torch.Tensor:
    """The position_ids given (global under cp: the data split them), else this rank's `length`
    tokens' places in an unpacked sequence of cp × length."""
    return position_ids if position_ids is not None else cp.positions(length * cp.size, device)[None]


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
    outs = [core(q[:, :, start:stop], k[:, :, :end], v[:, :, :end], bias) for start, stop, end, bias in segments]
    if len(outs) == 1:
        return outs[0]
    # joined token-major, so the caller's [B, S, H · d_v] is a view of it, not one more copy
    return torch.cat([out.transpose(1, 2) for out in outs], dim=1).transpose(1, 2)
