"""One transformer layer: attention and MLP with residuals, in the arrangements today's models use.

    pre-norm  (GPT-2, Llama):         x = x + attn(norm(x));            x = x + mlp(norm(x))
    post-norm (BERT):                 x = norm(x + attn(x));            x = norm(x + mlp(x))
    sandwich  (Gemma 2 and 3):        x = x + norm(attn(norm(x)));      x = x + norm(mlp(norm(x)))
    output    (OLMo 2):               x = x + norm(attn(x));            x = x + norm(mlp(x))
    parallel  (GPT-J, MegaScale):     x = x + attn(norm(x)) + mlp(norm(x))        one norm
              (Pythia, GPT-NeoX-20B): x = x + attn(norm1(x)) + mlp(norm2(x))      two norms

A `LayerSpec` (`spec.py`) describes the layer: its attention, its MLP and the arrangement.
Each branch's output may be scaled before the residual add (``residual_multiplier``, Granite).
With an `MoESpec` the MLP is a Mixture of Experts (`MoE`); called with ``router_stats`` (a [3, E]
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
from .spec import LatentAttentionSpec, LayerSpec, arguments


class TransformerLayer(ParallelLayer, nn.Module):
    """Attention (+ optional cross-attention) and MLP blocks, as `spec` (a `LayerSpec`) describes
    them; see the module docstring.

    Children: [``attn_norm``], ``attn``, [``attn_out_norm``], [``cross_attn_norm``, ``cross_attn``],
    [``mlp_norm``], ``mlp``, [``mlp_out_norm``]: ``*_norm`` normalizes a branch's input (pre,
    sandwich) or the residual sum (post), ``*_out_norm`` a branch's output (sandwich, output). The
    parallel block has ``attn_norm`` shared by both branches, or also ``mlp_norm`` with
    ``parallel_norms=2``, and applies ``hidden_dropout`` once to their sum. ``attn`` is an
    `Attention` (`AttentionSpec`) or a `LatentAttention` (`LatentAttentionSpec`: DeepSeek's
    multi-head latent attention); the cross-attention has the self-attention's heads, biases,
    dropout and softmax scale. ``mlp`` is an `MLP` (`MLPSpec`) or an `MoE` (`MoESpec`).
    """

    def __init__(self, spec: LayerSpec, *, sequence_parallel: bool = True, device=None, dtype=None):
        super().__init__()
        self.spec = spec
        self.sequence_parallel = sequence_parallel
        fused_comm = not spec.parallel_block
        factory = dict(sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        hidden, attention = spec.hidden_size, spec.attention

        def make_norm(when: bool = True):
            return NORMS[spec.norm](hidden, spec.norm_eps, **factory) if when else None

        inputs_normed = spec.norm_position != "output"
        outputs_normed = spec.norm_position in ("sandwich", "output")
        self.attn_norm = make_norm(inputs_normed)
        if isinstance(attention, LatentAttentionSpec):
            self.attn = LatentAttention(hidden, **arguments(attention), **factory)
        else:
            self.attn = Attention(hidden, **arguments(attention), sync_input=fused_comm, reduce_output=fused_comm,
                                  **factory)
        self.attn_out_norm = make_norm(outputs_normed)
        if spec.cross_attention:
            self.cross_attn_norm = make_norm()
            self.cross_attn = Attention(hidden, attention.num_heads, num_kv_heads=attention.num_kv_heads,
                                        head_dim=attention.head_dim, bias=attention.bias, out_bias=attention.out_bias,
                                        dropout=attention.dropout, softmax_scale=attention.softmax_scale,
                                        cross_attention=True, kv_input_size=spec.encoder_hidden_size, **factory)
        else:
            self.cross_attn = None
        self.mlp_norm = make_norm(inputs_normed and (not spec.parallel_block or spec.parallel_norms == 2))
        if spec.is_moe:
            self.mlp = MoE(hidden, **arguments(spec.mlp), **factory)
        else:
            self.mlp = MLP(hidden, **arguments(spec.mlp), sync_input=fused_comm, reduce_output=fused_comm, **factory)
        self.mlp_out_norm = make_norm(outputs_normed)
        self.dropout = nn.Dropout(spec.hidden_dropout)

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
        if self.spec.residual_multiplier != 1.0:
            branch = branch * self.spec.residual_multiplier
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
        if self.spec.parallel_block:
            return self._residual(x, self._parallel_branches(x, attention_mask, position_ids, kv_cache), None), None
        # a 2-D mask of the tokens' padding (not while generating: it then covers the cached positions too)
        if isinstance(attention_mask, ContextMask):  # under cp: this rank's tokens'
            token_mask = attention_mask.padding
        else:
            token_mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 \
                and kv_cache is None else None
        cross = dict(encoder_hidden_states=encoder_hidden_states, attention_mask=encoder_attention_mask,
                     kv_cache=cross_kv_cache)
        if self.spec.norm_position == "post":
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
