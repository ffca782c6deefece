"""The masks attention layers take.

`sdpa_mask`: one layer's mask for SDPA (causality, sliding windows, padding or a given mask), or
SDPA's ``is_causal`` fast path; `packed_causal_mask`: the block-diagonal causal mask of sequences
packed in a row, made once per forward; `layer_attention_mask`: the mask a model hands its layers,
under context parallelism a `ContextMask` of the whole sequence.
"""

from __future__ import annotations

import torch
from torch import nn

from .context_attention import ContextMask
from .parallel_layer import ParallelLayer


def sdpa_mask(attention_mask: torch.Tensor | None, q_len: int, k_len: int, device, *, causal: bool,
              sliding_window: int | None = None) -> tuple[torch.Tensor | None, bool]:
    """(attn_mask, is_causal) for SDPA; queries are the last q_len of the k_len positions."""
    if attention_mask is None and sliding_window is None:
        if not causal:
            return None, False
        if q_len == k_len:
            return None, True
        if q_len == 1:  # one new token after cached ones sees them all
            return None, False
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        allowed &= k_pos <= q_pos
    if sliding_window is not None:
        distance = q_pos - k_pos if causal else (q_pos - k_pos).abs()
        allowed &= distance < sliding_window
    if attention_mask is None:
        return allowed, False
    if attention_mask.dim() == 2:  # [B, S_k] padding mask, 1 = token
        # A query that may see nothing (left padding) gets zeros from SDPA (torch >= 2.5), as in transformers.
        return allowed & attention_mask[:, None, None, :].bool(), False
    if attention_mask.dtype == torch.bool:
        return allowed & attention_mask, False
    return attention_mask.masked_fill(~allowed, float("-inf")), False



def packed_causal_mask(attention_mask: torch.Tensor | None,
                       position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The mask every layer of a causal LM takes, made once per forward.

    transformers' convention (`masking_utils.find_packed_sequence_indices`): with no attention_mask,
    position_ids [B, S] that do not step by one (that restart) mark several sequences packed in a
    row; a token then sees only the earlier tokens of its own sequence. That gives a block-diagonal
    causal mask [B, 1, S, S] (True = attend) that `Attention` takes as it is, also after a sequence
    parallel gather (it spans the whole sequence). Without packing (one sequence per row) it returns
    None, so attention keeps SDPA's ``is_causal`` fast path; an attention_mask is returned as given.
    """
    if attention_mask is not None or position_ids is None:
        return attention_mask
    starts = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1
    sequence = starts.cumsum(-1)  # which packed sequence each token belongs to
    if not sequence[:, -1].any():
        return None
    length = position_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return ((sequence[:, :, None] == sequence[:, None, :]) & causal)[:, None]


def layer_attention_mask(module: nn.Module, attention_mask: torch.Tensor | None,
                         position_ids: torch.Tensor | None) -> torch.Tensor | ContextMask | None:
    """The attention_mask every layer of `module` (a model, or its stack of layers) takes, made once
    per forward: `packed_causal_mask`'s in one process; under context parallelism (the ``cp`` of its
    first parallel layer: `distributed.shard` sets it on all of them) a `ContextMask`, the whole
    sequence's padding and documents gathered over cp, from which each attention layer masks its
    queries by global position (a rank's local position_ids jump between its two chunks)."""
    cp = next((m.cp for m in module.modules() if isinstance(m, ParallelLayer)), None)
    if cp is None:
        return packed_causal_mask(attention_mask, position_ids)
    return ContextMask(cp, attention_mask, position_ids)
