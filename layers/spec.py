"""What one transformer layer is, as typed, frozen descriptions: Megatron-Core's ModuleSpec and
torchtitan's nested config dataclasses in this zoo's form.

    LayerSpec(hidden_size, attention=AttentionSpec | LatentAttentionSpec, mlp=MLPSpec | MoESpec,
              norm, norm_eps, norm_position, parallel_block, ...)

`TransformerLayer(spec)` builds one; a decoder family describes each of its layers as one
(`models.decoder.DecoderSpec.layers`). A field's name is the keyword of the layer that takes it
(`Attention`, `LatentAttention`, `MLP`, `MoE`), so a misspelled one is a TypeError where the spec
is written, and a value that no layer can build (an unknown norm, a parallel block with an MoE) a
ValueError there too, not when the model is built. A family derives its layers from another's
with `dataclasses.replace`, and its attention or MLP through `LayerSpec.with_attention` /
`with_mlp`:

    llama_layer(config, i).with_attention(qk_norm="head", qk_norm_eps=config.rms_norm_eps)   # Qwen3
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from .norm import NORMS

NORM_POSITIONS = ("pre", "post", "sandwich", "output")


def arguments(spec) -> dict:
    """A spec's fields as the keyword arguments of the layer it describes (no copies)."""
    return {field.name: getattr(spec, field.name) for field in fields(spec)}


@dataclass(frozen=True)
class AttentionSpec:
    """Multi-head attention (`Attention`): grouped-query heads, rotary positions on the first
    ``rotary_dim`` channels of each head (none when ``rope_theta`` is None), a sliding window, q/k
    norms, a softmax scale of its own, soft-capping, attention sinks. ``bias``: on q, k and v;
    ``out_bias`` on the output projection (None: as ``bias``). A layer's cross-attention (T5) takes
    its heads, biases, dropout and softmax scale."""

    num_heads: int
    num_kv_heads: int | None = None  # None: num_heads
    head_dim: int | None = None  # None: hidden_size // num_heads
    causal: bool = False
    bias: bool = True
    out_bias: bool | None = None
    dropout: float = 0.0
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rotary_dim: int | None = None
    sliding_window: int | None = None
    softmax_scale: float | None = None
    softcap: float | None = None
    sinks: bool = False
    qk_norm: str | None = None  # None, "head" or "projection"
    qk_norm_eps: float = 1e-6
    qk_norm_kind: str = "rmsnorm"


@dataclass(frozen=True)
class LatentAttentionSpec:
    """DeepSeek's multi-head latent attention (`LatentAttention`): low-rank q (``q_lora_rank``;
    None: a direct q projection) and kv (``kv_lora_rank``) latents, a decoupled rotary key of
    ``qk_rope_head_dim`` channels, values of their own width. A sequential self-attention."""

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    causal: bool = True
    bias: bool = False
    out_bias: bool | None = None
    dropout: float = 0.0
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_interleave: bool = True
    softmax_scale: float | None = None
    latent_norm_eps: float = 1e-6


@dataclass(frozen=True)
class MLPSpec:
    """A dense MLP (`MLP`): ``gated`` is act(gate(x)) · up(x) (SwiGLU, GeGLU); ``dropout`` drops
    the activated neurons (T5)."""

    ffn_hidden_size: int
    activation: str = "gelu"
    gated: bool = False
    bias: bool = True
    dropout: float = 0.0


@dataclass(frozen=True)
class MoESpec:
    """A Mixture-of-Experts MLP (`MoE`): its router, ``num_experts`` experts of ``ffn_hidden_size``
    neurons (``top_k`` per token), an optional shared expert and token dropping at a capacity."""

    num_experts: int
    top_k: int
    ffn_hidden_size: int
    router: str = "softmax_topk"
    norm_topk_prob: bool = True
    router_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    score_correction_bias: bool = False
    activation: str = "silu"
    gated: bool = True
    bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    shared_expert_size: int | None = None
    shared_expert_gate: bool = False
    capacity_factor: float | None = None
    grouped_mm: bool = True


@dataclass(frozen=True)
class LayerSpec:
    """One `TransformerLayer`: its attention and MLP, and how the residual stream passes them (see
    `transformer_layer`): the norm's kind (`norm.NORMS`) and placement, a parallel block (GPT-J,
    Pythia: ``parallel_norms`` 1 or 2), dropout on each branch's output, a multiplier on it
    (Granite), and a cross-attention to an encoder's states of ``encoder_hidden_size`` (T5)."""

    hidden_size: int
    attention: AttentionSpec | LatentAttentionSpec
    mlp: MLPSpec | MoESpec
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    norm_position: str = "pre"  # one of NORM_POSITIONS
    parallel_block: bool = False
    parallel_norms: int = 1
    hidden_dropout: float = 0.0
    residual_multiplier: float = 1.0
    cross_attention: bool = False
    encoder_hidden_size: int | None = None  # None: hidden_size

    def __post_init__(self):
        if self.norm not in NORMS:
            raise ValueError(f"norm {self.norm!r} is not one of {sorted(NORMS)}")
        if self.norm_position not in NORM_POSITIONS:
            raise ValueError(f"norm_position {self.norm_position!r} is not one of {NORM_POSITIONS}")
        if self.parallel_block and (self.cross_attention or self.norm_position != "pre"):
            raise ValueError("parallel_block=True is a pre-norm self-attention layer: "
                             "it does not combine with cross_attention or another norm_position")
        if self.parallel_block and self.is_moe:
            raise ValueError("parallel_block=True shares one sync between attention and a dense MLP: "
                             "an MoE layer is sequential (parallel_block=False)")
        if self.parallel_norms not in (1, 2):
            raise ValueError(f"parallel_norms = {self.parallel_norms}: a parallel block has one norm or two")
        if isinstance(self.attention, LatentAttentionSpec) and (self.parallel_block or self.cross_attention):
            raise ValueError("latent attention is a sequential self-attention: build it without cross_attention "
                             "and parallel_block")

    @property
    def is_moe(self) -> bool:
        return isinstance(self.mlp, MoESpec)

    def with_attention(self, **changes) -> LayerSpec:
        """This layer with `changes` to its attention's fields."""
        return replace(self, attention=replace(self.attention, **changes))

    def with_mlp(self, **changes) -> LayerSpec:
        """This layer with `changes` to its MLP's (or MoE's) fields."""
        return replace(self, mlp=replace(self.mlp, **changes))
