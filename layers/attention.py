"""Multi-head attention with heads split over tensor parallelism.

    x [B, S, h] -> qkv (column-parallel: whole heads per rank) -> SDPA on local heads
      -> out (row-parallel) -> all-reduce -> [B, S, h]

More tp ranks than KV heads (Gemma 3 270M: one KV head) is allowed when tp is a multiple of the
KV heads: each KV head is then replicated on the tp / num_kv_heads ranks that share its group, as
inference engines do (vLLM). The fused `qkv` stays one parameter of its true shape, held whole
(replicated over tp) on every rank; a rank computes only its rows (its q heads and its group's
k and v: `Linear.replicate_rows_`), so its gradient is partial: `distributed.finalize_grads` sums
it over tp, which gives a q row its one owner's gradient and a shared k/v row the sum over the
ranks sharing it. Checkpoints (Hugging Face, DCP at any layout) hold one copy of each head, the
gradient norm counts it once (replicated), and ZeRO shards it over dp like any replicated weight.
The price is memory: every rank holds all of q's rows of that layer, not 1/tp of them.

Grouped-query attention (num_kv_heads < num_heads), rotary positions (Llama), causal and
padding masks, sliding windows (MegaScale/Mistral), q/k normalisation (per head: Qwen3, Gemma 3;
over the whole projection: OLMo 2), a softmax scale of one's own (Gemma 2's query_pre_attn_scalar,
Granite's attention_multiplier), logit soft-capping (Gemma 2), Swin V2's scaled cosine attention
(a learned temperature per head, split over tp with the q heads) and its q and v biases without a
k bias, cross-attention and a KV cache for generation. The kernel is
`torch.nn.functional.scaled_dot_product_attention`; with no mask beyond causality it gets
``is_causal=True`` so the flash kernels apply. Under context parallelism
(``cp`` set) a self-attention all-gathers k and v over cp and masks its local queries by global
position (`context_attention`: causal, windows, packed documents, padding; why all-gather there).

SDPA has no soft-cap and no attention sinks (gpt-oss: a learned logit per head that joins each
query's softmax denominator, so a query may give its keys less than all of its attention). A layer
with a cap or sinks (`explicit_attention`) computes its scores explicitly (exact, the softmax in
float32 as transformers' eager Gemma 2 and gpt-oss attention; O(S²) memory per head). The sinks are split
over tp with the q heads (a rank's q heads are one contiguous block in every layout, replicated KV
heads included).
Torch's flex attention (the cap as its score_mod) was tried for it and is not used: on CPU (torch
2.13) it has no backward, and on an H200 (torch 2.11, 2026-11-26) compiled flex matched the
explicit form on the tiny Gemma 2 but failed to compile at Gemma 2's own sizes (head_dim 256,
S = 2048). The explicit form matches transformers' eager Gemma 2 there within 1.6e-6
(`benchmarks/bench_families.py`). Flex can come back after a GPU check at the floor torch.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from libai_zoo.distributed import TensorParallel, local

from .attention_masks import sdpa_mask
from .context_attention import ContextMask, context_attention
from .kv_cache import KVCache
from .linear import Linear
from .norm import NORMS
from .parallel_layer import ParallelLayer, indivisible
from .rotary import RotaryEmbedding, apply_rotary

QK_NORMS = (None, "head", "projection")


class Attention(ParallelLayer, nn.Module):
    """Self- or cross-attention.

    Self-attention fuses Q, K and V in one column-parallel weight `qkv`, laid out per KV group
    (`fuse_qkv`, Megatron-LM's order), so a tp split gives each rank whole groups at any tp and
    one checkpoint serves every layout; cross-attention has `q` on the hidden states and a
    grouped `kv` (`fuse_kv`) on the encoder states (whole sequence, replicated). `out` is
    row-parallel. ``sliding_window=w`` lets a query see keys less than w positions away (only
    earlier ones when causal). ``rope_theta`` turns on rotary positions on the first
    ``rotary_dim`` channels of each head (default all), ``rope_scaling`` rescales them
    (`RotaryEmbedding`). ``qk_norm``: RMSNorm on q and k before rotary, over each head ("head")
    or over the whole projection ("projection"), of kind ``qk_norm_kind`` (an RMSNorm of `norm.NORMS`: Gemma 3's "rmsnorm_1p", OLMo 2's
    "rmsnorm_fp32_weight").
    ``softmax_scale`` replaces 1/sqrt(head_dim); ``softcap`` caps the scores at ±softcap
    (cap·tanh(s/cap)); ``sinks=True`` gives each head a learned logit `sinks` [num_heads] that
    joins every query's softmax and is then dropped (gpt-oss). ``cosine=True`` scores each query
    and key by their cosine times a learned per-head temperature, exp(min(`logit_scale`, ln 100))
    with `logit_scale` [num_heads], softmax scale 1 (Swin V2's scaled cosine attention).
    ``key_bias=False`` (with ``bias``): q and v have biases, k none (Swin V2; under cosine
    attention a k bias would matter): `q_bias` and `v_bias` beside a bias-free `qkv`.
    ``sync_input``/``reduce_output`` as in `Linear`.
    """

    def __init__(self, hidden_size: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, bias: bool = True, out_bias: bool | None = None,
                 causal: bool = False, cross_attention: bool = False, kv_input_size: int | None = None,
                 dropout: float = 0.0, rope_theta: float | None = None, rope_scaling: dict | None = None,
                 rotary_dim: int | None = None, sliding_window: int | None = None,
                 softmax_scale: float | None = None, softcap: float | None = None, sinks: bool = False,
                 qk_norm: str | None = None, qk_norm_eps: float = 1e-6, qk_norm_kind: str = "rmsnorm",
                 cosine: bool = False, key_bias: bool = True, sync_input: bool = True,
                 reduce_output: bool = True, sequence_parallel: bool = True, device=None, dtype=None):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads = {num_heads} is not a multiple of num_kv_heads = {num_kv_heads}")
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"hidden_size = {hidden_size} is not divisible by num_heads = {num_heads}; "
                                 f"pass head_dim explicitly")
            head_dim = hidden_size // num_heads
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window = {sliding_window} must be a positive number of positions")
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm {qk_norm!r} is not one of {QK_NORMS}")
        if qk_norm and not qk_norm_kind.startswith("rmsnorm"):
            raise ValueError(f"qk_norm_kind {qk_norm_kind!r}: q/k norms are RMSNorms (one of "
                             f"{sorted(k for k in NORMS if k.startswith('rmsnorm'))})")
        if qk_norm and cross_attention:
            raise ValueError("qk_norm is for self-attention: build the cross-attention without it")
        if cosine and softmax_scale is not None:
            raise ValueError("cosine attention scales its scores by the learned logit_scale: build it without "
                             "softmax_scale")
        if not key_bias and (cross_attention or not bias):
            raise ValueError("key_bias=False leaves out the k bias of a self-attention with biases (bias=True)")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.kv_replicas = 1  # tp ranks sharing each KV head (set by shard_ when tp > num_kv_heads)
        self.causal, self.cross_attention = causal, cross_attention
        self.dropout, self.sliding_window = dropout, sliding_window
        self.softmax_scale = 1.0 if cosine else softmax_scale
        self.softcap = softcap
        self.sinks = nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype)) if sinks else None
        # Swin V2: the log of each head's temperature (clamped at ln 100 where it is used)
        self.logit_scale = nn.Parameter(torch.full((num_heads,), math.log(10.0), device=device, dtype=dtype)) \
            if cosine else None
        self.key_bias = key_bias
        self.sequence_parallel = sequence_parallel
        col = dict(parallel="col", sync_input=sync_input, sequence_parallel=sequence_parallel,
                   device=device, dtype=dtype)
        if cross_attention:
            self.q = Linear(hidden_size, num_heads * head_dim, bias, **col)
            # Encoder states are the whole sequence, replicated over tp: a plain copy_to_tp input.
            self.kv = Linear(kv_input_size or hidden_size, 2 * num_kv_heads * head_dim, bias, "col",
                             sequence_parallel=False, device=device, dtype=dtype)
        else:
            self.qkv = Linear(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias and key_bias, **col)
        self.q_bias = self.v_bias = None
        if not key_bias:
            self.q_bias = nn.Parameter(torch.zeros(num_heads * head_dim, device=device, dtype=dtype))
            self.v_bias = nn.Parameter(torch.zeros(num_kv_heads * head_dim, device=device, dtype=dtype))
        self.out = Linear(num_heads * head_dim, hidden_size, bias if out_bias is None else out_bias, "row",
                          reduce_output=reduce_output, sequence_parallel=sequence_parallel,
                          device=device, dtype=dtype)
        self.rotary = RotaryEmbedding(rotary_dim or head_dim, rope_theta, rope_scaling) if rope_theta else None
        self.qk_norm = qk_norm
        if qk_norm:  # q and k come out of the column-parallel qkv: whole sequence, this rank's heads
            per_head = qk_norm == "head"
            norm = dict(eps=qk_norm_eps, split_input=per_head, split_dim=not per_head,
                        sequence_parallel=False, device=device, dtype=dtype)
            self.q_norm = NORMS[qk_norm_kind](head_dim if per_head else num_heads * head_dim, **norm)
            self.k_norm = NORMS[qk_norm_kind](head_dim if per_head else num_kv_heads * head_dim, **norm)

    @property
    def attention_width(self) -> int:
        """heads × head width: one token's scores and weighted values cost 4 × it × the keys' FLOPs."""
        return self.num_heads * self.head_dim

    def tp_problems(self, tp_size: int) -> list[str]:
        problems = indivisible(self.num_heads, tp_size, "num_heads", "choose a tp that divides the number of heads")
        kv = self.num_kv_heads
        if kv % tp_size == 0 or problems:
            return problems
        if self.cross_attention:
            return [f"num_kv_heads = {kv} of a cross-attention is not divisible by tp = {tp_size}: "
                    f"choose a tp that divides it (each rank needs whole KV groups)"]
        if tp_size % kv:
            return [f"num_kv_heads = {kv} is not divisible by tp = {tp_size}, nor tp by it: choose a tp that "
                    f"divides the KV heads, or a multiple of them (each KV head is then replicated on "
                    f"tp / num_kv_heads ranks)"]
        if self.qk_norm == "projection" or not self.key_bias:
            what = "a k norm over the whole projection" if self.key_bias else "separate q and v biases (key_bias=False)"
            return [f"num_kv_heads = {kv} is not divisible by tp = {tp_size}: {what} needs whole KV heads on each "
                    f"rank (replicated ones are not supported there); choose a tp that divides the KV heads"]
        return []

    def cp_problems(self, cp_size: int) -> list[str]:
        if self.cross_attention:
            return ["a cross-attention does not run under context parallelism (its encoder states are not split "
                    "over cp): train this model with cp = 1"]
        return []

    def shard_(self, tp: TensorParallel) -> None:
        """Split the heads over tp; with fewer KV heads than tp ranks, replicate each KV head on
        the ranks its group's q heads are split over (see the module docstring)."""
        if not self.cross_attention and self.num_kv_heads % tp.size:
            self.kv_replicas = tp.size // self.num_kv_heads
            self.qkv.replicate_rows_(self._qkv_rows(tp.rank))
        for per_head in ("sinks", "logit_scale", "q_bias", "v_bias"):  # this rank's heads: one block of rows
            tp.shard_parameter(self, per_head, 0)
        super().shard_(tp)

    def _qkv_rows(self, rank: int) -> list[tuple[int, int]]:
        """The rows of the grouped `qkv` that tp rank `rank` computes when KV heads are replicated:
        its share of its group's q heads, then the group's k and v."""
        d, per_group = self.head_dim, self.num_heads // self.num_kv_heads
        group, share = divmod(rank, self.kv_replicas)
        mine = per_group // self.kv_replicas
        start = group * (per_group + 2) * d
        return [(start + share * mine * d, start + (share + 1) * mine * d),
                (start + per_group * d, start + (per_group + 2) * d)]

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None, kv_cache: KVCache | None = None) -> torch.Tensor:
        """hidden_states [B, S, h]; attention_mask [B, S_k] (1 = attend, 0 = padding) or a 4-D
        boolean/additive mask; position_ids [B, S] for rotary; encoder_hidden_states for cross;
        kv_cache holds earlier positions (S_k = cached + S) and takes this call's keys and values (a
        cross-attention's: the encoder's, taken on the first call and read on the later ones)."""
        q, k, v = self._project(hidden_states, encoder_hidden_states, kv_cache)
        if self.qk_norm:
            q, k = self._norm_qk(q, k)
        if self.logit_scale is not None:
            q, k = self._cosine_qk(q, k)
        past, last_position = 0 if kv_cache is None else kv_cache.length, None
        if self.cp is not None:
            attention_mask = ContextMask.of(self.cp, attention_mask, position_ids, kv_cache)
            position_ids, last_position = attention_mask.positions(position_ids, q.shape[1], q.device)
        if self.rotary is not None:
            if position_ids is None:
                position_ids = torch.arange(past, past + q.shape[1], device=q.device)[None]
            # broadcast over groups and heads, cast once for q and k
            cos, sin = (t[:, :, None, None].to(q.dtype) for t in self.rotary(position_ids, last_position))
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            v = v.contiguous()  # q and k are new tensors now: copying v lets the fused qkv output go
        if kv_cache is not None and not self.cross_attention:
            k, v = kv_cache.update(k, v)
        # [B, S, groups, heads per group, d] -> [B, heads, S, d]; a view when rotary made q contiguous
        q, k, v = (t.flatten(2, 3).transpose(1, 2) for t in (q, k, v))
        sinks = local(self.sinks)
        if self.cp is not None:
            def core(q, k, v, mask):
                return self.core_attention(q, k, v, mask, False, self.softmax_scale, self.softcap, sinks)

            out = context_attention(self.cp, q, k, v, attention_mask, core, causal=self.causal,
                                    sliding_window=self.sliding_window,
                                    explicit=self.softcap is not None or sinks is not None)
        else:
            mask, is_causal = sdpa_mask(attention_mask, q.shape[2], k.shape[2], q.device, causal=self.causal,
                                        sliding_window=self.sliding_window)
            out = self.core_attention(q, k, v, mask, is_causal, self.softmax_scale, self.softcap, sinks)
        return self.out(out.transpose(1, 2).flatten(2))

    def core_attention(self, *args) -> torch.Tensor:
        """`attend` for this layer: the seam selective recomputation ("core_attn") checkpoints."""
        return attend(self, *args)

    def _norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, S, groups, heads, d] and k normalised per head, or over this rank's part of the
        whole projection (heads in order: the grouped layout keeps a rank's q heads contiguous)."""
        if self.qk_norm == "head":
            return self.q_norm(q), self.k_norm(k)
        return self.q_norm(q.flatten(2)).view_as(q), self.k_norm(k.flatten(2)).view_as(k)

    def _cosine_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, S, groups, heads, d] and k of unit length, q times its head's temperature, so that
        q·k (at softmax scale 1) is the cosine times exp(min(logit_scale, ln 100))."""
        temperature = local(self.logit_scale).clamp(max=math.log(100.0)).exp().view(*q.shape[2:4], 1)
        return F.normalize(q, dim=-1) * temperature.to(q.dtype), F.normalize(k, dim=-1)

    def _project(self, x: torch.Tensor, encoder_states: torch.Tensor | None, kv_cache: KVCache | None):
        """This rank's q [B, S, groups, q heads per group, d] and k, v [B, S_k, groups, 1, d] (a
        cross-attention's from its cache once filled: the encoder's, projected on the first call).

        `split` (not indexing) takes the parts apart, so backward writes one gradient buffer
        instead of zero-filling one per part."""
        d = self.head_dim
        if self.cross_attention:
            q = self.q(x).unflatten(-1, (-1, 1, d))
            if kv_cache is not None and kv_cache.length:
                return q, *kv_cache.cached()
            if encoder_states is None:
                raise ValueError("cross-attention needs encoder_hidden_states")
            k, v = self.kv(encoder_states).unflatten(-1, (-1, 2, d)).split(1, dim=-2)
            return (q, k, v) if kv_cache is None else (q, *kv_cache.update(k, v))
        per_group = self.num_heads // self.num_kv_heads // self.kv_replicas  # this rank's q heads per group
        qkv = self.qkv(x).unflatten(-1, (-1, per_group + 2, d))
        if self.q_bias is not None:  # [q heads of group g, no k bias, v] per group, as the grouped layout
            q_bias, v_bias = local(self.q_bias).view(-1, per_group, d), local(self.v_bias).view(-1, 1, d)
            qkv = qkv + torch.cat([q_bias, torch.zeros_like(v_bias), v_bias], dim=1)
        return qkv.split([per_group, 1, 1], dim=-2)

    def extra_repr(self) -> str:
        kinds = ["cross" if self.cross_attention else "self"] + (["causal"] if self.causal else [])
        if self.sliding_window:
            kinds.append(f"window={self.sliding_window}")
        if self.softcap:
            kinds.append(f"softcap={self.softcap}")
        if self.sinks is not None:
            kinds.append("sinks")
        if self.logit_scale is not None:
            kinds.append("cosine")
        if not self.key_bias:
            kinds.append("no key bias")
        if self.kv_replicas > 1:
            kinds.append(f"kv_replicas={self.kv_replicas}")
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"{', '.join(kinds)}{self.parallel_repr()}")


def attend(layer: ParallelLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           is_causal: bool, scale: float | None, softcap: float | None = None,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The attention core of `layer` (its ``dropout``, training mode and tp): q [B, H, S, d], k [B, H_kv, S_k, d],
    v [B, H_kv, S_k, d_v] -> [B, H, S, d_v]; SDPA, or `explicit_attention` for a soft-cap or sinks."""
    dropout = layer.dropout if layer.training else 0.0
    # This rank's heads draw their own dropout masks (the tp rank's stream), as one process would.
    with layer.tp.rng.fork() if layer.tp is not None and dropout else nullcontext():
        if softcap is None and sinks is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal,
                                                  scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        return explicit_attention(q, k, v, mask, scale, dropout, causal=is_causal, softcap=softcap, sinks=sinks)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float | None, dropout: float, *, causal: bool = False, softcap: float | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA computed explicitly, for what SDPA cannot do: q [B, H, S, d], k and v [B, H_kv, S_k, d],
    mask boolean (True = attend) or additive, or `causal`. ``softcap`` caps the scores at ±softcap
    (cap·tanh(s/cap), Gemma 2); ``sinks`` [H] is one more logit per head in each query's softmax,
    dropped after it (gpt-oss: a query that sees nothing gives its keys zero weight). The softmax
    in float32 as transformers' eager attention does."""
    if causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).nan_to_num(0.0).to(q.dtype)
    else:
        sink = sinks.to(scores.dtype)[:, None, None].expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype)
    return F.dropout(probs, dropout) @ v if dropout else probs @ v
