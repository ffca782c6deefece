"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2), heads split over tensor parallelism.

    x -> q_a_proj -> q_a_layernorm -> q_b_proj (col) -> q [heads: nope | rope]     (or q_proj (col) on x)
    x -> kv_a_proj_with_mqa -> [kv latent | k_rope] ; kv_a_layernorm(kv latent) -> kv_b_proj (col)
         -> k_nope, v [heads]; k = [k_nope | k_rope, one rotary key shared by all heads]
    rotary on the rope channels of q and k -> SDPA on local heads -> out (row) -> [B, S, h]

q and kv pass through low-rank latents (``q_lora_rank``, ``kv_lora_rank``), each normalised;
only ``qk_rope_head_dim`` channels of each head carry positions (decoupled rotary), and values
have their own width (``v_head_dim``). The softmax scale is qk_head_dim^-0.5 unless given (DeepSeek
multiplies it by YaRN's mscale²: the model passes it).

Over tp, heads split: q_b_proj (or q_proj) and kv_b_proj are column-parallel, out row-parallel.
The down-projections and their norms are replicated and run on the layer's input as it comes
(under sequence parallelism this rank's tokens, their weight gradients partial as a norm's); their
latents then go through one sync to the column layers (all-gathered over the sequence under SP, as
Megatron-LM's MLA does: the latents are narrower than the hidden state). A KV cache holds the
expanded per-head keys and values of this rank's heads.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import attend
from .attention_masks import sdpa_mask
from .context_attention import ContextMask, context_attention
from .kv_cache import KVCache
from .linear import Linear, column_inputs
from .norm import RMSNorm
from .parallel_layer import ParallelLayer, indivisible
from .rotary import RotaryEmbedding, apply_rotary, deinterleave


class LatentAttention(ParallelLayer, nn.Module):
    """Causal self-attention through low-rank q and kv latents; see the module docstring.

    ``q_lora_rank=None`` projects q directly (``q_proj``, DeepSeek-V2-Lite). ``bias`` puts biases on
    the two down-projections, ``out_bias`` on ``out`` (DeepSeek's attention_bias sets both).
    ``rope_interleave``: the rotary channels come in interleaved pairs (DeepSeek's checkpoints).
    ``latent_norm_eps``: the latent norms' epsilon. ``reduce_output`` as in `Linear`.
    """

    def __init__(self, hidden_size: int, num_heads: int, *, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, q_lora_rank: int | None = None, bias: bool = False,
                 out_bias: bool | None = None, causal: bool = True, dropout: float = 0.0,
                 rope_theta: float = 10000.0, rope_scaling: dict | None = None, rope_interleave: bool = True,
                 softmax_scale: float | None = None, latent_norm_eps: float = 1e-6, reduce_output: bool = True,
                 sequence_parallel: bool = True, device=None, dtype=None):
        super().__init__()
        self.num_heads, self.q_lora_rank, self.kv_lora_rank = num_heads, q_lora_rank, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.causal, self.dropout, self.rope_interleave = causal, dropout, rope_interleave
        self.softmax_scale = softmax_scale
        self.sequence_parallel = sequence_parallel
        factory = dict(sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        q_width = num_heads * self.qk_head_dim
        if q_lora_rank is None:
            self.q_proj = Linear(hidden_size, q_width, False, "col", **factory)
        else:
            self.q_a_proj = Linear(hidden_size, q_lora_rank, bias, "data", **factory)
            self.q_a_layernorm = RMSNorm(q_lora_rank, latent_norm_eps, **factory)
            self.q_b_proj = Linear(q_lora_rank, q_width, False, "col", sync_input=False, **factory)
        self.kv_a_proj_with_mqa = Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias, "data", **factory)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, latent_norm_eps, **factory)
        self.kv_b_proj = Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), False, "col",
                                sync_input=False, **factory)
        self.out = Linear(num_heads * v_head_dim, hidden_size, bias if out_bias is None else out_bias, "row",
                          reduce_output=reduce_output, **factory)
        self.rotary = RotaryEmbedding(qk_rope_head_dim, rope_theta, rope_scaling)

    @property
    def attention_width(self) -> float:
        """heads × the mean of the q·k and v head widths, as `Attention.attention_width` counts FLOPs."""
        return self.num_heads * (self.qk_head_dim + self.v_head_dim) / 2

    #: `attend` for this layer: the seam selective recomputation ("core_attn") checkpoints.
    core_attention = attend

    def tp_problems(self, tp_size: int) -> list[str]:
        return indivisible(self.num_heads, tp_size, "num_heads", "choose a tp that divides the number of heads")

    def _latents(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[normalised q latent], normalised kv latent, k_rope: over the whole sequence, replicated
        over tp (one sync for all of them)."""
        kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latents = [self.kv_a_layernorm(kv), k_rope]
        if self.q_lora_rank is not None:
            latents.insert(0, self.q_a_layernorm(self.q_a_proj(x)))
        if self.tp is None:
            return latents
        readers = [[self.kv_b_proj], []] if self.q_lora_rank is None else [[self.q_b_proj], [self.kv_b_proj], []]
        return column_inputs(self.tp, self.sp, *zip(latents, readers))

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, encoder_hidden_states: torch.Tensor | None = None,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        """As `Attention.forward` (self-attention only): hidden_states [B, S, h], attention_mask
        [B, S_k] or 4-D, position_ids [B, S], kv_cache for generation."""
        if encoder_hidden_states is not None:
            raise ValueError("LatentAttention is self-attention: it takes no encoder_hidden_states")
        latents = self._latents(hidden_states)
        kv, k_rope = latents[-2:]
        q = self.q_proj(hidden_states) if self.q_lora_rank is None else self.q_b_proj(latents[0])
        q_nope, q_rope = q.unflatten(-1, (-1, self.qk_head_dim)).split([self.qk_nope_head_dim,
                                                                        self.qk_rope_head_dim], dim=-1)
        k_nope, v = self.kv_b_proj(kv).unflatten(-1, (-1, self.qk_nope_head_dim + self.v_head_dim)).split(
            [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_rope = k_rope[:, :, None]  # [B, S, 1, rope]: one rotary key for every head
        if self.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        past, last_position = 0 if kv_cache is None else kv_cache.length, None
        if self.cp is not None:
            attention_mask = ContextMask.of(self.cp, attention_mask, position_ids, kv_cache)
            position_ids, last_position = attention_mask.positions(position_ids, q.shape[1], q.device)
        if position_ids is None:
            position_ids = torch.arange(past, past + q.shape[1], device=q.device)[None]
        # broadcast over heads, cast once for q and k
        cos, sin = (t[:, :, None].to(q.dtype) for t in self.rotary(position_ids, last_position))
        q = torch.cat((q_nope, apply_rotary(q_rope, cos, sin)), dim=-1)
        k = torch.cat((k_nope, apply_rotary(k_rope, cos, sin).expand(*k_nope.shape[:-1], -1)), dim=-1)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, d]
        scale = self.softmax_scale or self.qk_head_dim ** -0.5
        if self.cp is not None:  # the expanded per-head k and v gathered (their latents would be narrower)
            out = context_attention(self.cp, q, k, v, attention_mask,
                                    lambda q, k, v, mask: self.core_attention(q, k, v, mask, False, scale),
                                    causal=self.causal)
        else:
            mask, is_causal = sdpa_mask(attention_mask, q.shape[2], k.shape[2], q.device, causal=self.causal)
            out = self.core_attention(q, k, v, mask, is_causal, scale)
        return self.out(out.transpose(1, 2).flatten(2))

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}, "
                f"qk_head_dim={self.qk_nope_head_dim}+{self.qk_rope_head_dim}, v_head_dim={self.v_head_dim}"
                f"{', causal' if self.causal else ''}{self.parallel_repr()}")
