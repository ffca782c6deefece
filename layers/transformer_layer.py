"""One transformer layer: attention and MLP with residuals, in the arrangements today's models use.

    pre-norm  (GPT-2, Llama):         x = x + attn(norm(x));            x = x + mlp(norm(x))
    post-norm (BERT):                 x = norm(x + attn(x));            x = norm(x + mlp(x))
    sandwich  (Gemma 2 and 3):        x = x + norm(attn(norm(x)));      x = x + norm(mlp(norm(x)))
    output    (OLMo 2):               x = x + norm(attn(x));            x = x + norm(mlp(x))
    parallel  (GPT-J, MegaScale):     x = x + attn(norm(x)) + mlp(norm(x))        one norm
              (Pythia, GPT-NeoX-20B): x = x + attn(norm1(x)) + mlp(norm2(x))      two norms

Each branch's output may be scaled before the residual add (``residual_multiplier``, Granite).
With ``moe`` the MLP is a Mixture of Experts (`MoE`); called with ``router_stats`` (a [3, E]
tensor) such a layer returns (x, router_stats + its own statistics), a dense layer (x,
router_stats): the statistics travel with the hidden states through the layers and pipeline stages.
At tp>1 the sequential arrangements cost Megatron-LM's two all-reduces forward and two backward;
the parallel block shares one input sync and one output reduction between attention and MLP
(with two norms, their outputs travel side by side through the one sync), so it costs one each
way. Under sequence parallelism every all-reduce is an all-gather + reduce-scatter pair and x is
this rank's part of the sequence.
"""

from __future__ import annotations

import torch
from torch import nn

from libai_zoo.distributed.collectives import row_output

from .attention import Attention
from .context_attention import ContextMask
from .kv_cache import KVCache
from .latent_attention import LatentAttention
from .linear import column_inputs
from .mlp import MLP
from .moe import MoE
from .norm import NORMS
from .parallel_layer import ParallelLayer

NORM_POSITIONS = ("pre", "post", "sandwich", "output")
ATTENTION_KINDS = ("standard", "latent")


class TransformerLayer(ParallelLayer, nn.Module):
    """Attention (+ optional cross-attention) and MLP blocks; see the module docstring.

    Children: [``attn_norm``], ``attn``, [``attn_out_norm``], [``cross_attn_norm``, ``cross_attn``],
    [``mlp_norm``], ``mlp``, [``mlp_out_norm``]: ``*_norm`` normalizes a branch's input (pre,
    sandwich) or the residual sum (post), ``*_out_norm`` a branch's output (sandwich, output). The
    parallel block has ``attn_norm`` shared by both branches, or also ``mlp_norm`` with
    ``parallel_norms=2``, and applies ``hidden_dropout`` once to their sum. ``bias`` sets every
    bias; ``qkv_bias``, ``attention_out_bias`` and ``mlp_bias`` override it per part (Qwen2:
    biases on q, k, v only). ``attention`` passes further `Attention` options (q/k norms, softmax
    scale, soft-capping), or with ``attention_kind="latent"`` those of `LatentAttention` (DeepSeek's
    multi-head latent attention: its ranks and head widths); the cross-attention shares its softmax
    scale. ``moe`` makes the MLP an `MoE` of these arguments (hidden size and factory arguments
    added, ``activation`` unless it gives one). ``mlp_dropout`` drops the MLP's activated neurons (T5).
    """

    def __init__(self, hidden_size: int, num_heads: int, ffn_hidden_size: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, norm: str = "layernorm", norm_eps: float = 1e-5,
                 norm_position: str = "pre", parallel_block: bool = False, parallel_norms: int = 1,
                 activation: str = "gelu", gated_mlp: bool = False, bias: bool = True, qkv_bias: bool | None = None,
                 attention_out_bias: bool | None = None, mlp_bias: bool | None = None,
                 attention_dropout: float = 0.0, hidden_dropout: float = 0.0, mlp_dropout: float = 0.0,
                 residual_multiplier: float = 1.0,
                 causal: bool = False, rope_theta: float | None = None,
                 rope_scaling: dict | None = None, rotary_dim: int | None = None,
                 sliding_window: int | None = None, attention: dict | None = None, attention_kind: str = "standard",
                 cross_attention: bool = False, encoder_hidden_size: int | None = None, moe: dict | None = None,
                 sequence_parallel: bool = True, device=None, dtype=None):
        super().__init__()
        if norm not in NORMS:
            raise ValueError(f"norm {norm!r} is not one of {sorted(NORMS)}")
        if norm_position not in NORM_POSITIONS:
            raise ValueError(f"norm_position {norm_position!r} is not one of {NORM_POSITIONS}")
        if parallel_block and (cross_attention or norm_position != "pre"):
            raise ValueError("parallel_block=True is a pre-norm self-attention layer: "
                             "it does not combine with cross_attention or another norm_position")
        if parallel_block and moe is not None:
            raise ValueError("parallel_block=True shares one sync between attention and a dense MLP: "
                             "an MoE layer is sequential (parallel_block=False)")
        if attention_kind not in ATTENTION_KINDS:
            raise ValueError(f"attention_kind {attention_kind!r} is not one of {ATTENTION_KINDS}")
        if parallel_norms not in (1, 2):
            raise ValueError(f"parallel_norms = {parallel_norms}: a parallel block has one norm or two")
        qkv_bias = bias if qkv_bias is None else qkv_bias
        attention_out_bias = bias if attention_out_bias is None else attention_out_bias
        mlp_bias = bias if mlp_bias is None else mlp_bias
        self.norm_position, self.parallel_block = norm_position, parallel_block
        self.residual_multiplier = residual_multiplier
        self.sequence_parallel = sequence_parallel
        fused_comm = not parallel_block
        factory = dict(sequence_parallel=sequence_parallel, device=device, dtype=dtype)

        def make_norm(when: bool = True):
            return NORMS[norm](hidden_size, norm_eps, **factory) if when else None

        inputs_normed = norm_position != "output"
        outputs_normed = norm_position in ("sandwich", "output")
        self.attn_norm = make_norm(inputs_normed)
        heads = dict(num_kv_heads=num_kv_heads, head_dim=head_dim, bias=qkv_bias, out_bias=attention_out_bias,
                     dropout=attention_dropout)
        if attention_kind == "latent":
            if parallel_block or cross_attention or sliding_window or rotary_dim or head_dim or num_kv_heads:
                raise ValueError("latent attention sets its own head widths (qk_nope_head_dim, qk_rope_head_dim, "
                                 "v_head_dim in `attention`) and is a sequential self-attention: build it without "
                                 "num_kv_heads, head_dim, rotary_dim, sliding_window, cross_attention, parallel_block")
            self.attn = LatentAttention(hidden_size, num_heads, causal=causal, rope_theta=rope_theta,
                                        rope_scaling=rope_scaling, bias=qkv_bias, out_bias=attention_out_bias,
                                        dropout=attention_dropout, **(attention or {}), **factory)
        else:
            self.attn = Attention(hidden_size, num_heads, causal=causal, rope_theta=rope_theta,
                                  rope_scaling=rope_scaling, rotary_dim=rotary_dim, sliding_window=sliding_window,
                                  sync_input=fused_comm, reduce_output=fused_comm, **(attention or {}), **heads,
                                  **factory)
        self.attn_out_norm = make_norm(outputs_normed)
        if cross_attention:
            self.cross_attn_norm = make_norm()
            self.cross_attn = Attention(hidden_size, num_heads, cross_attention=True,
                                        kv_input_size=encoder_hidden_size,
                                        softmax_scale=(attention or {}).get("softmax_scale"), **heads, **factory)
        else:
            self.cross_attn = None
        self.mlp_norm = make_norm(inputs_normed and (not parallel_block or parallel_norms == 2))
        if moe is None:
            self.mlp = MLP(hidden_size, ffn_hidden_size, activation=activation, gated=gated_mlp, bias=mlp_bias,
                           dropout=mlp_dropout, sync_input=fused_comm, reduce_output=fused_comm, **factory)
        else:
            self.mlp = MoE(hidden_size, **{"activation": activation, **moe}, **factory)
        self.mlp_out_norm = make_norm(outputs_normed)
        self.dropout = nn.Dropout(hidden_dropout)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        """Residual-branch dropout; on a sequence shard (SP) from this tp rank's own random stream."""
        if self.sp and self.training and self.dropout.p:
            with self.tp.rng.fork():
                return self.dropout(x)
        return self.dropout(x)

    def _residual(self, x: torch.Tensor, branch: torch.Tensor, out_norm: nn.Module | None) -> torch.Tensor:
        """x + the branch's output (normalized in sandwich/output placement, scaled, dropped out)."""
        if out_norm is not None:
            branch = out_norm(branch)
        if self.residual_multiplier != 1.0:
            branch = branch * self.residual_multiplier
        return x + self._dropout(branch)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, encoder_hidden_states: torch.Tensor | None = None,
                encoder_attention_mask: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                router_stats: torch.Tensor | None = None,
                cross_kv_cache: KVCache | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``kv_cache``: the self-attention's cache; ``cross_kv_cache``: the cross-attention's (the
        encoder's keys and values, projected on the first call only)."""
        x, stats = self._layer(hidden_states, attention_mask, position_ids, encoder_hidden_states,
                               encoder_attention_mask, kv_cache, cross_kv_cache)
        if router_stats is None:
            return x
        return x, router_stats if stats is None else router_stats + stats

    def _layer(self, x: torch.Tensor, attention_mask, position_ids, encoder_hidden_states, encoder_attention_mask,
               kv_cache, cross_kv_cache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the layer's output, its router statistics or None)."""
        if self.parallel_block:
            return self._residual(x, self._parallel_branches(x, attention_mask, position_ids, kv_cache), None), None
        # a 2-D mask of the tokens' padding (not while generating: it then covers the cached positions too)
        if isinstance(attention_mask, ContextMask):  # under cp: this rank's tokens'
            token_mask = attention_mask.padding
        else:
            token_mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 \
                and kv_cache is None else None
        cross = dict(encoder_hidden_states=encoder_hidden_states, attention_mask=encoder_attention_mask,
                     kv_cache=cross_kv_cache)
        if self.norm_position == "post":
            x = self.attn_norm(x + self._dropout(self.attn(x, attention_mask, position_ids, kv_cache=kv_cache)))
            if self.cross_attn is not None:
                x = self.cross_attn_norm(x + self._dropout(self.cross_attn(x, **cross)))
            y, stats = self._mlp(x, token_mask)
            return self.mlp_norm(x + self._dropout(y)), stats
        h = x if self.attn_norm is None else self.attn_norm(x)
        x = self._residual(x, self.attn(h, attention_mask, position_ids, kv_cache=kv_cache), self.attn_out_norm)
        if self.cross_attn is not None:
            x = x + self._dropout(self.cross_attn(self.cross_attn_norm(x), **cross))
        y, stats = self._mlp(x if self.mlp_norm is None else self.mlp_norm(x), token_mask)
        return self._residual(x, y, self.mlp_out_norm), stats

    def _mlp(self, h: torch.Tensor, token_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The MLP's output, and its router statistics when it is an MoE."""
        if isinstance(self.mlp, MoE):
            return self.mlp(h, token_mask)
        return self.mlp(h), None

    def _parallel_branches(self, x: torch.Tensor, attention_mask, position_ids, kv_cache) -> torch.Tensor:
        """attn(norm(x)) + mlp(norm(x)) (or mlp(norm2(x))) with one input sync and one output
        reduction for both."""
        h = self.attn_norm(x)
        h2 = None if self.mlp_norm is None else self.mlp_norm(x)
        if self.tp is not None:
            if h2 is None:
                h, = column_inputs(self.tp, self.sp, (h, [self.attn.qkv, *self.mlp.column_layers]))
            else:  # both normalized inputs through one sync, side by side
                h, h2 = column_inputs(self.tp, self.sp, (h, [self.attn.qkv]), (h2, self.mlp.column_layers))
        y = self.attn(h, attention_mask, position_ids, kv_cache=kv_cache) + self.mlp(h if h2 is None else h2)
        if self.tp is not None:
            y = row_output(y, self.tp, self.sp)
        return self.mlp.down.add_bias(self.attn.out.add_bias(y))
