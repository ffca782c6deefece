"""One transformer layer: attention and MLP with residuals, in the three classic arrangements.

    pre-norm  (GPT-2, Llama):   x = x + attn(norm(x));  x = x + mlp(norm(x))
    post-norm (BERT):           x = norm(x + attn(x));  x = norm(x + mlp(x))
    parallel  (GPT-J, MegaScale): x = x + attn(norm(x)) + mlp(norm(x))

At tp>1 the sequential arrangements cost Megatron-LM's two all-reduces forward and two backward;
the parallel block shares one input sync and one output reduction between attention and MLP,
so it costs one each way. Under sequence parallelism every all-reduce is an all-gather +
reduce-scatter pair and x is this rank's part of the sequence.
"""

from __future__ import annotations

import torch
from torch import nn

from libai_zoo.distributed.collectives import column_input, row_output

from .attention import Attention
from .kv_cache import KVCache
from .mlp import MLP
from .norm import LayerNorm, RMSNorm
from .parallel_layer import ParallelLayer

NORMS = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}


class TransformerLayer(ParallelLayer, nn.Module):
    """Attention (+ optional cross-attention) and MLP blocks; see the module docstring.

    Children: ``attn_norm``, ``attn``, [``cross_attn_norm``, ``cross_attn``], [``mlp_norm``], ``mlp``.
    The parallel block has one norm (``attn_norm``) shared by both branches and applies
    ``hidden_dropout`` once to their sum. ``bias`` sets every bias; ``qkv_bias``, ``attention_out_bias``
    and ``mlp_bias`` override it per part (Qwen2: biases on q, k, v only).
    """

    def __init__(self, hidden_size: int, num_heads: int, ffn_hidden_size: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, norm: str = "layernorm", norm_eps: float = 1e-5,
                 pre_norm: bool = True, parallel_block: bool = False, activation: str = "gelu",
                 gated_mlp: bool = False, bias: bool = True, qkv_bias: bool | None = None,
                 attention_out_bias: bool | None = None, mlp_bias: bool | None = None,
                 attention_dropout: float = 0.0,
                 hidden_dropout: float = 0.0, causal: bool = False, rope_theta: float | None = None,
                 rope_scaling: dict | None = None, rotary_dim: int | None = None,
                 sliding_window: int | None = None, cross_attention: bool = False,
                 encoder_hidden_size: int | None = None, sequence_parallel: bool = True, device=None, dtype=None):
        super().__init__()
        if norm not in NORMS:
            raise ValueError(f"norm {norm!r} is not one of {sorted(NORMS)}")
        if parallel_block and (cross_attention or not pre_norm):
            raise ValueError("parallel_block=True is a pre-norm self-attention layer: "
                             "it does not combine with cross_attention or pre_norm=False")
        qkv_bias = bias if qkv_bias is None else qkv_bias
        attention_out_bias = bias if attention_out_bias is None else attention_out_bias
        mlp_bias = bias if mlp_bias is None else mlp_bias
        self.pre_norm, self.parallel_block = pre_norm, parallel_block
        self.sequence_parallel = sequence_parallel
        fused_comm = not parallel_block
        factory = dict(sequence_parallel=sequence_parallel, device=device, dtype=dtype)

        def make_norm():
            return NORMS[norm](hidden_size, norm_eps, **factory)

        self.attn_norm = make_norm()
        heads = dict(num_kv_heads=num_kv_heads, head_dim=head_dim, bias=qkv_bias, out_bias=attention_out_bias,
                     dropout=attention_dropout)
        self.attn = Attention(hidden_size, num_heads, causal=causal, rope_theta=rope_theta,
                              rope_scaling=rope_scaling, rotary_dim=rotary_dim, sliding_window=sliding_window,
                              sync_input=fused_comm,
                              reduce_output=fused_comm, **heads, **factory)
        if cross_attention:
            self.cross_attn_norm = make_norm()
            self.cross_attn = Attention(hidden_size, num_heads, cross_attention=True,
                                        kv_input_size=encoder_hidden_size, **heads, **factory)
        else:
            self.cross_attn = None
        self.mlp_norm = None if parallel_block else make_norm()
        self.mlp = MLP(hidden_size, ffn_hidden_size, activation=activation, gated=gated_mlp, bias=mlp_bias,
                       sync_input=fused_comm, reduce_output=fused_comm, **factory)
        self.dropout = nn.Dropout(hidden_dropout)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        """Residual-branch dropout; on a sequence shard (SP) from this tp rank's own random stream."""
        if self.sp and self.training and self.dropout.p:
            with self.tp.rng.fork():
                return self.dropout(x)
        return self.dropout(x)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, encoder_hidden_states: torch.Tensor | None = None,
                encoder_attention_mask: torch.Tensor | None = None, kv_cache: KVCache | None = None) -> torch.Tensor:
        x = hidden_states
        if self.parallel_block:
            return x + self._dropout(self._parallel_branches(self.attn_norm(x), attention_mask, position_ids, kv_cache))
        cross = dict(encoder_hidden_states=encoder_hidden_states, attention_mask=encoder_attention_mask)
        if self.pre_norm:
            x = x + self._dropout(self.attn(self.attn_norm(x), attention_mask, position_ids, kv_cache=kv_cache))
            if self.cross_attn is not None:
                x = x + self._dropout(self.cross_attn(self.cross_attn_norm(x), **cross))
            return x + self._dropout(self.mlp(self.mlp_norm(x)))
        x = self.attn_norm(x + self._dropout(self.attn(x, attention_mask, position_ids, kv_cache=kv_cache)))
        if self.cross_attn is not None:
            x = self.cross_attn_norm(x + self._dropout(self.cross_attn(x, **cross)))
        return self.mlp_norm(x + self._dropout(self.mlp(x)))

    def _parallel_branches(self, h: torch.Tensor, attention_mask, position_ids, kv_cache) -> torch.Tensor:
        """attn(h) + mlp(h) with one input sync and one output reduction for both."""
        if self.tp is not None:
            h = column_input(h, self.tp, self.sp)
        y = self.attn(h, attention_mask, position_ids, kv_cache=kv_cache) + self.mlp(h)
        if self.tp is not None:
            y = row_output(y, self.tp, self.sp)
        return self.mlp.down.add_bias(self.attn.out.add_bias(y))
