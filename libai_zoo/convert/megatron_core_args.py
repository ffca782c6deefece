"""A zoo decoder -> Megatron-LM's run args (what `megatron_core_config.megatron_config` reads back).

The args a model is written with are read off the built decoder (`DecoderSpec`: each layer's
`LayerSpec`), never its family's name: any family Megatron-Core can express is written, and an
option it cannot express is refused by name (`architecture_args`).
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

import torch
from torch import nn

from libai_zoo.layers import AttentionSpec, LatentAttentionSpec, LayerSpec, MLPSpec, MoESpec
from libai_zoo.layers.spec import arguments
from libai_zoo.models.decoder import DecoderForCausalLM, DecoderSpec

from .megatron_core_config import LLAMA3_SCALING


def megatron_args(model: nn.Module, padded_vocab: int, make_vocab_size_divisible_by: int) -> argparse.Namespace:
    """The Megatron-LM arguments of a zoo model (what `megatron_config` reads back), for common.pt."""
    config = model.config
    dtype = next(model.parameters()).dtype
    common = dict(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, use_mcore_models=True, ckpt_format="torch_dist",
        transformer_impl="transformer_engine", padded_vocab_size=padded_vocab, vocab_size=config.vocab_size,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, apply_layernorm_1p=False, squared_relu=False,
        bias_swiglu_fusion=False, openai_gelu=False, rotary_interleaved=False, iteration=0,
        consumed_train_samples=0, consumed_valid_samples=0, no_save_optim=True, no_save_rng=True,
        init_method_std=config.initializer_range, tokenizer_type="HuggingFaceTokenizer",
        untie_embeddings_and_output_weights=not config.tie_word_embeddings)
    positions = config.max_position_embeddings
    return argparse.Namespace(**common, **architecture_args(model), max_position_embeddings=positions,
                              seq_length=positions)


# Megatron-Core's GPTModel (local or Transformer Engine layers) as the zoo's layer specs
# (`layers.LayerSpec` and the specs of its attention and MLP): what it cannot express, by field,
# with a word on who has it. A field not named here nor read by `architecture_args` is refused
# when it differs from its default, so a new field of the layer specs is refused until this file
# learns it.
def _defaults(spec_class) -> dict:
    """A spec class's fields that have defaults, with them."""
    return {field.name: field.default for field in fields(spec_class) if field.default is not MISSING}


LAYER_DEFAULTS, ATTENTION_DEFAULTS = _defaults(LayerSpec), _defaults(AttentionSpec)
MLP_DEFAULTS, MOE_DEFAULTS = _defaults(MLPSpec), _defaults(MoESpec)
NOT_ARCHITECTURE = {"dropout", "hidden_dropout", "parallel_norms", "encoder_hidden_size"}
SPEC_UNCONVERTED = {
    "embedding_multiplier": "the embeddings scaled (Gemma's sqrt(hidden), Granite's embedding_multiplier): "
                            "Megatron-Core's GPTModel embeds unscaled",
    "logit_scale": "the logits scaled (Granite's logits_scaling): Megatron-Core's output layer does not scale",
    "logit_softcap": "final-logit soft-capping (Gemma 2): Megatron-Core's output layer has none",
}
# the DecoderSpec fields a Megatron checkpoint keeps elsewhere, or that are no architecture
SPEC_READ = {"vocab_size", "hidden_size", "layers", "final_norm", "final_norm_eps", "max_positions", "padding_idx",
             "token_types", "embedding_dropout", "multiplier_in_dtype", "num_experts", "router_aux_loss_coef",
             "output_router_logits", "router_z_loss_coef"}
# the LayerSpec, AttentionSpec and MLPSpec fields architecture_args reads (and refuses the values of that have no form)
LAYER_READ = {"hidden_size", "attention", "mlp", "norm", "norm_eps", "norm_position", "parallel_block",
              "residual_multiplier", "cross_attention"}
ATTENTION_READ = {"num_heads", "num_kv_heads", "head_dim", "causal", "bias", "out_bias", "rope_theta", "rope_scaling",
                  "rotary_dim", "sliding_window", "qk_norm", "qk_norm_eps", "qk_norm_kind"}
MLP_READ = {"ffn_hidden_size", "activation", "gated", "bias"}
GELUS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}  # -> --bias-gelu-fusion (tanh)


def _built_alike(layer: LayerSpec) -> dict:
    """What Megatron-Core builds alike in every layer, by name: the layer's fields and its
    attention's, but the sliding window (--window-attn-skip-freq skips it on some) and the MLP
    (dense and MoE layers: --moe-layer-freq; compared by `_mlp_args`)."""
    own = {name: value for name, value in arguments(layer).items() if name not in ("attention", "mlp")}
    attention = {f"attention {name}": value for name, value in arguments(layer.attention).items()
                 if name != "sliding_window"}
    return {**own, "attention": type(layer.attention).__name__, **attention}


def architecture_args(model: nn.Module) -> dict:
    """Megatron-LM's architecture args of a zoo decoder, read off its `DecoderSpec` (every layer's
    `LayerSpec`), so any family built on the declarative decoder converts when Megatron-Core can
    express it; what it cannot is named, all of it, in one ValueError."""
    if not isinstance(model, DecoderForCausalLM):
        raise ValueError(f"{type(model).__name__} has no Megatron-Core form: Megatron-Core's GPTModel is a "
                         f"decoder-only causal LM (libai_zoo's DecoderForCausalLM families)")
    spec, problems = model.body.spec, []
    layer = spec.layers[0]
    first = _built_alike(layer)
    for i, each in enumerate(spec.layers[1:], start=1):
        options = _built_alike(each)
        problems += [f"layer {i} has {key} = {options.get(key)!r}, layer 0 {first.get(key)!r}: Megatron-Core builds "
                     f"every layer alike (only the sliding window may be skipped on some: --window-attn-skip-freq; "
                     f"dense and MoE layers: --moe-layer-freq)"
                     for key in sorted(options.keys() | first.keys()) if options.get(key) != first.get(key)]
    refuse = {name: value for name, value in spec.__dict__.items()
              if name not in SPEC_READ and value != DecoderSpec.__dataclass_fields__[name].default}
    problems += [f"{name} = {value!r}: " + SPEC_UNCONVERTED.get(name, "no Megatron-Core form here")
                 for name, value in refuse.items()]
    attention = layer.attention
    if isinstance(attention, LatentAttentionSpec):
        problems.append("latent attention (DeepSeek-V3's LatentAttentionSpec): Megatron-Core's multi-latent "
                        "attention is not converted")
        _refuse(model, problems)

    def check(when: bool, problem: str) -> None:
        if when:
            problems.append(problem)

    heads, hidden = attention.num_heads, layer.hidden_size
    norm = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}.get(layer.norm)
    check(norm is None, f"norm {layer.norm!r}: Megatron-Core's layers have LayerNorm or RMSNorm (Gemma's (1 + w) "
                        f"RMSNorm in float32 has no Megatron-Core form here)")
    check((spec.final_norm, spec.final_norm_eps) != (layer.norm, layer.norm_eps),
          f"final norm {spec.final_norm} (eps {spec.final_norm_eps}) unlike the layers' {layer.norm} (eps "
          f"{layer.norm_eps}): Megatron-Core has one normalization and one layernorm_epsilon")
    check(layer.norm_position != "pre", f"norm_position {layer.norm_position!r}: Megatron-Core's GPT layer "
                                        f"normalizes each branch's input (pre-norm) only")
    check(layer.parallel_block, "parallel_block (attention and MLP side by side: GPT-J, Pythia): Megatron-Core's "
                                "GPT layer is sequential")
    check(layer.residual_multiplier != 1.0, f"residual_multiplier {layer.residual_multiplier} (Granite): "
                                            f"Megatron-Core adds the branches unscaled")
    check(not attention.causal or layer.cross_attention, "Megatron-Core's GPTModel is causal self-attention only")
    mlp, mlp_args = _mlp_args(spec, problems)
    gated, act = mlp.gated, mlp.activation
    if gated:
        check(act != "silu", f"a gated MLP with {act!r}: Megatron-LM's --swiglu gates with SiLU")
    else:
        check(act not in GELUS, f"activation {act!r}: Megatron-Core's GPT MLP has GELU (erf, or tanh through "
                                f"--bias-gelu-fusion)")
    check(norm is not None and gated != (norm == "RMSNorm"),
          f"a {'gated' if gated else 'plain'} MLP with {norm}: converted Megatron-Core models have SwiGLU with RMSNorm "
          f"(Llama) or GELU with LayerNorm (GPT)")
    qkv_b, mlp_b = attention.bias, mlp.bias
    out_b = attention.bias if attention.out_bias is None else attention.out_bias
    check(not (qkv_b == out_b == mlp_b or (qkv_b and not out_b and not mlp_b)),
          f"biases on q/k/v {qkv_b}, o {out_b}, MLP {mlp_b}: Megatron-LM has all of them (--add-bias-linear), none, "
          f"or q/k/v only (--add-qkv-bias)")
    check(not gated and not out_b, "a GELU MLP without biases: converted GPT models have biases (--add-bias-linear)")
    head_dim = attention.head_dim or hidden // heads
    args = dict(num_layers=len(spec.layers), hidden_size=hidden, num_attention_heads=heads, kv_channels=head_dim,
                group_query_attention=(attention.num_kv_heads or heads) != heads,
                num_query_groups=attention.num_kv_heads or heads, normalization=norm, norm_epsilon=layer.norm_eps,
                swiglu=gated, bias_gelu_fusion=not gated and GELUS.get(act, False), add_bias_linear=out_b,
                add_qkv_bias=qkv_b, hidden_dropout=layer.hidden_dropout, attention_dropout=attention.dropout,
                **_position_args(spec, attention, head_dim, problems), **_attention_args(spec, attention, problems),
                **mlp_args)
    problems += [f"layer option {name} = {value!r}: no Megatron-Core form here" for name, value in arguments(layer).items()
                 if name not in LAYER_READ | NOT_ARCHITECTURE and value != LAYER_DEFAULTS.get(name)]
    _refuse(model, problems)
    return args


def _refuse(model: nn.Module, problems: list[str]) -> None:
    """Every problem `architecture_args` found, in one ValueError (none: nothing to refuse)."""
    if problems:
        raise ValueError(f"{type(model).__name__} ({model.config.model_type}) has no Megatron-Core form; "
                         f"{len(problems)} problem(s):\n  " + "\n  ".join(problems))


# the MoE options Megatron-Core's MoE layer has no form for here, with who has them
MOE_UNCONVERTED = {
    "router": "a router other than softmax then top-k (DeepSeek-V3's sigmoid_group, gpt-oss's topk_softmax) is not "
              "converted",
    "router_bias": "a router bias (gpt-oss): Megatron-Core's router has one only with --add-bias-linear, with every "
                   "linear layer's",
    "bias": "expert biases (gpt-oss): Megatron-Core's experts have them only with --add-bias-linear",
    "swiglu_limit": "gpt-oss's clamped SwiGLU: Megatron-Core's experts have plain SwiGLU",
    "capacity_factor": "token dropping at a capacity: Megatron-Core's --moe-expert-capacity-factor drops by "
                       "probability per rank, not the first tokens of a forward",
    "score_correction_bias": "a selection bias (DeepSeek-V3's e_score_correction_bias) is not converted",
    "n_group": "group-limited routing (DeepSeek-V3) is not converted",
    "topk_group": "group-limited routing (DeepSeek-V3) is not converted",
    "routed_scaling_factor": "routed weights scaled (DeepSeek-V3) is not converted",
}
MOE_READ = {"num_experts", "top_k", "ffn_hidden_size", "norm_topk_prob", "activation", "gated", "shared_expert_size",
            "shared_expert_gate", "grouped_mm"}


def _mlp_args(spec: DecoderSpec, problems: list[str]) -> tuple[MLPSpec | MoESpec, dict]:
    """The layers' MLP (the first dense layer's, else the first MoE's: its activation, gating and
    bias are the model's), and Megatron-LM's MLP args: the dense layers' --ffn-hidden-size and the
    MoE args (--num-experts, --moe-router-topk, --moe-ffn-hidden-size, top-k renormalised unless
    --moe-router-pre-softmax, --moe-layer-freq as a list when some layers are dense, a shared
    expert and its gate). The auxiliary- and z-loss coefficients are carried as they are (the run
    trains with them when output_router_logits): Megatron-Core's losses are per layer, its
    auxiliary loss 1/k of transformers', so a run's loss is not comparable number for number."""
    dense = [(i, each.mlp) for i, each in enumerate(spec.layers) if not each.is_moe]
    moes = [(i, each.mlp) for i, each in enumerate(spec.layers) if each.is_moe]
    for kind, alike in (("MLP", dense), ("MoE", moes)):
        if alike:
            (first, mlp), ignored = alike[0], {"ffn_hidden_size"} if kind == "MLP" else set()
            problems += [f"layer {i}'s {kind} has {key} = {getattr(each, key)!r}, layer {first}'s "
                         f"{getattr(mlp, key)!r}: Megatron-Core's {'dense' if kind == 'MLP' else 'MoE'} layers are alike"
                         for i, each in alike[1:] for key in arguments(mlp)
                         if key not in ignored and getattr(each, key) != getattr(mlp, key)]
    widths = sorted({mlp.ffn_hidden_size for _, mlp in dense})
    if len(widths) > 1:
        problems.append(f"dense layers of {widths} neurons: Megatron-Core's have one --ffn-hidden-size")
    if dense:
        problems += [f"MLP {name} = {value!r}: no Megatron-Core form here" for name, value in arguments(dense[0][1]).items()
                     if name not in MLP_READ and value != MLP_DEFAULTS.get(name)]
    if not moes:
        return dense[0][1], dict(ffn_hidden_size=widths[0], num_experts=None, moe_layer_freq=1)
    moe = moes[0][1]
    for name, why in MOE_UNCONVERTED.items():
        if getattr(moe, name) != MOE_DEFAULTS[name]:
            problems.append(f"MoE {name} = {getattr(moe, name)!r}: {why}")
    problems += [f"MoE {name} = {value!r}: no Megatron-Core form here" for name, value in arguments(moe).items()
                 if name not in MOE_READ | set(MOE_UNCONVERTED) and value != MOE_DEFAULTS.get(name)]
    mlp = dense[0][1] if dense else moe
    if (moe.activation, moe.gated) != (mlp.activation, mlp.gated):
        problems.append(f"experts with {moe.activation} (gated {moe.gated}) in layers whose MLP has "
                        f"{mlp.activation} (gated {mlp.gated}): Megatron-Core's experts have the MLP's")
    scale = spec.output_router_logits
    return mlp, dict(
        ffn_hidden_size=widths[0] if dense else moe.ffn_hidden_size, num_experts=moe.num_experts,
        moe_router_topk=moe.top_k, moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_layer_freq=1 if not dense else [int(each.is_moe) for each in spec.layers],
        moe_shared_expert_intermediate_size=moe.shared_expert_size, moe_shared_expert_gate=moe.shared_expert_gate,
        moe_router_score_function="softmax", moe_router_topk_scaling_factor=None, moe_router_enable_expert_bias=False,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=spec.router_aux_loss_coef if scale else 0.0,
        moe_z_loss_coeff=spec.router_z_loss_coef or None, moe_router_dtype="fp32", moe_grouped_gemm=False,
        moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=None)


def _position_args(spec: DecoderSpec, attention: AttentionSpec, head_dim: int, problems: list[str]) -> dict:
    """Learned positions, or RoPE's base, scaling (llama3 or linear) and rotated fraction."""
    theta, scaling = attention.rope_theta, attention.rope_scaling
    args = dict(rotary_base=10000, rotary_percent=1.0, use_rope_scaling=False, rope_scaling_factor=8.0,
                rotary_seq_len_interpolation_factor=None)
    if spec.max_positions is not None:
        if theta is not None:
            problems.append("learned positions and rotary ones together: Megatron-Core has one or the other")
        return dict(args, position_embedding_type="learned_absolute", add_position_embedding=True)
    if theta is None:
        problems.append("no positions (rope_theta=None: NoPE layers): Megatron-Core's GPTModel has rotary or learned "
                        "positions on every layer")
        return dict(args, position_embedding_type="none", add_position_embedding=False)
    args.update(position_embedding_type="rope", add_position_embedding=False,
                rotary_base=int(theta) if float(theta).is_integer() else theta,
                rotary_percent=(attention.rotary_dim or head_dim) / head_dim)
    rope_type = (scaling or {}).get("rope_type")
    if rope_type == "llama3":
        others = {key: scaling.get(key) for key in LLAMA3_SCALING if scaling.get(key) != LLAMA3_SCALING[key]}
        if others:
            problems.append(f"llama3 RoPE scaling with {others}: Megatron-Core fixes low_freq_factor 1, "
                            f"high_freq_factor 4 and original_max_position_embeddings 8192")
        args.update(use_rope_scaling=True, rope_scaling_factor=scaling["factor"])
    elif rope_type == "linear":
        args.update(rotary_seq_len_interpolation_factor=scaling["factor"])
    elif rope_type is not None:
        problems.append(f"RoPE scaling {rope_type!r}: Megatron-LM's args have llama3 (--use-rope-scaling) and linear "
                        f"(--rotary-seq-len-interpolation-factor)")
    return args


def _attention_args(spec: DecoderSpec, attention: AttentionSpec, problems: list[str]) -> dict:
    """Per-head q/k norms (--qk-layernorm) and the sliding window (--window-size, skipped on the
    full-attention layers by --window-attn-skip-freq)."""
    layer, qk = spec.layers[0], attention.qk_norm
    if qk == "head":
        if layer.norm != "rmsnorm" or attention.qk_norm_eps != layer.norm_eps:
            problems.append(f"RMSNorm q/k norms (eps {attention.qk_norm_eps}) with {layer.norm} layers (eps "
                            f"{layer.norm_eps}): Megatron-Core's --qk-layernorm is the layers' norm")
        if attention.qk_norm_kind != "rmsnorm":
            problems.append(f"{attention.qk_norm_kind} q/k norms (Gemma 3's (1 + w)): Megatron-Core's q/k norms "
                            f"are the layers' RMSNorm")
    elif qk is not None:
        problems.append(f"q/k norm {qk!r} (over the whole projection: OLMo 2): Megatron-Core's --qk-layernorm "
                        f"normalizes each head")
    unconverted = {"softmax_scale": "a softmax scale of its own (Gemma 2's query_pre_attn_scalar, Granite's "
                                    "attention_multiplier): not converted",
                   "softcap": "attention logit soft-capping (Gemma 2): Megatron-Core has none",
                   "sinks": "attention sinks (gpt-oss): not converted"}
    problems += [f"attention {name} = {value!r}: " + unconverted.get(name, "no Megatron-Core form here")
                 for name, value in arguments(attention).items()
                 if name not in ATTENTION_READ | NOT_ARCHITECTURE and value != ATTENTION_DEFAULTS.get(name)]
    windows = [each.attention.sliding_window for each in spec.layers]
    sizes = sorted({w for w in windows if w is not None})
    args = dict(qk_layernorm=qk == "head", window_size=None, window_attn_skip_freq=None)
    if len(sizes) > 1:
        problems.append(f"sliding windows of {sizes} positions: Megatron-Core has one window for all windowed layers")
    elif sizes:  # Megatron-Core's window (left, right) counts the positions besides the query's own
        args["window_size"] = (sizes[0] - 1, 0)
        if None in windows:
            args["window_attn_skip_freq"] = [int(w is not None) for w in windows]
    return args
