"""Megatron-LM's run args -> the zoo class and config of a Megatron-Core GPTModel.

The architecture comes from the run's `args` (`common.pt`, or the torch files' "args"), which
Megatron-LM saves with every checkpoint; `megatron_config` turns them into the zoo config and
checks them against the tensors, naming every problem in one error.

The family is the one the args describe (GPT-2 or GPT-NeoX without --swiglu; Llama, Qwen2,
Qwen3, Mistral with it; Mixtral, Qwen2-MoE or Qwen3-MoE with --num-experts); an option no
converted family has is refused by name.
"""

from __future__ import annotations

import argparse

import torch
import transformers
from torch import nn

from libai_zoo import models

from .megatron_core_names import megatron_weight_map

LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def run_arg(args: argparse.Namespace, name: str, default=None):
    """args.name, or `default` when the run has none (or None)."""
    value = getattr(args, name, default)
    return default if value is None else value


def megatron_config(args: argparse.Namespace, tensors: dict[str, torch.Tensor], *, vocab_size: int | None = None,
                    where: str = "the checkpoint"):
    """(zoo class, its config) for a Megatron-Core GPTModel's run args, checked against the
    tensors (names and shapes); every problem is named in one error."""
    problems: list[str] = []
    gated = bool(run_arg(args, "swiglu", False))
    family = "llama" if gated else "gpt"
    positions = run_arg(args, "position_embedding_type", "learned_absolute")
    expected = {"position_embedding_type": ("rope",) if gated else ("learned_absolute", "rope"),
                "normalization": ("RMSNorm",) if gated else ("LayerNorm",)}
    for name, values in expected.items():
        given = run_arg(args, name, "learned_absolute" if name == "position_embedding_type" else "LayerNorm")
        if given not in values:
            problems.append(f"args.{name} = {given!r}: the {family} family (swiglu = {gated}) has "
                            f"{' or '.join(map(repr, values))}")
    refused = {"squared_relu": bool,
               "multi_latent_attention": bool, "apply_residual_connection_post_layernorm": bool,
               "rotary_interleaved": bool, "mtp_num_layers": bool, "heterogeneous_layers_config_path": bool,
               "qk_l2_norm": bool, "no_rope_freq": bool,
               "softmax_type": lambda v: v not in (None, "vanilla"), "glu_linear_offset": bool,
               "activation_func_clamp_value": lambda v: v is not None}
    problems += [f"args.{name} = {getattr(args, name)!r} is not converted" for name, bad in refused.items()
                 if hasattr(args, name) and bad(getattr(args, name))]
    required = ("num_layers", "hidden_size", "num_attention_heads")
    problems += [f"args.{name} is missing" for name in required if run_arg(args, name) is None]
    if problems and any(name.endswith("missing") for name in problems):
        raise ValueError(f"{where} cannot be converted:\n  " + "\n  ".join(problems))

    heads, hidden = args.num_attention_heads, args.hidden_size
    groups = run_arg(args, "num_query_groups", heads) if run_arg(args, "group_query_attention", False) else heads
    head_dim = run_arg(args, "kv_channels", hidden // heads)
    ffn = run_arg(args, "ffn_hidden_size", 4 * hidden)
    words = tensors.get("embedding.word_embeddings.weight")
    padded = run_arg(args, "padded_vocab_size", words.shape[0] if words is not None else None)
    if padded is None:
        raise ValueError(f"{where} has no embedding.word_embeddings.weight and no args.padded_vocab_size")
    saved = run_arg(args, "vocab_size")
    if saved is not None and run_arg(args, "tokenizer_type") == "NullTokenizer":
        saved += 1  # its vocabulary is --vocab-size ids plus the end-of-document id
    vocab = vocab_size or saved or padded
    if not 0 < vocab <= padded:
        problems.append(f"vocabulary {vocab} (--vocab-size or args.vocab_size) is not between 1 and the padded "
                        f"vocabulary {padded}")
        vocab = padded
    untied = bool(run_arg(args, "untie_embeddings_and_output_weights", False))
    bias = bool(run_arg(args, "add_bias_linear", True))
    eps = float(run_arg(args, "norm_epsilon", run_arg(args, "layernorm_epsilon", 1e-5)))
    rope = dict(rope_theta=float(run_arg(args, "rotary_base", 10000)), rope_scaling=_rope_scaling(args, problems))
    if family == "gpt":
        name = "GPT-2" if positions == "learned_absolute" else "GPT-NeoX"
        if groups != heads:
            problems.append(f"args.num_query_groups = {groups} < {heads} heads: {name} has no grouped-query "
                            f"attention")
        if head_dim * heads != hidden:
            problems.append(f"{heads} heads × kv_channels {head_dim} != hidden_size {hidden}: {name} needs it equal")
        if not bias:
            problems.append(f"args.add_bias_linear = False: {name}'s linear layers have biases")
        for name in ("qk_layernorm", "window_size"):
            if run_arg(args, name):
                problems.append(f"args.{name} = {getattr(args, name)!r}: {name} has no Hugging Face form in the GPT "
                                f"family (GPT-2, GPT-NeoX)")
        if run_arg(args, "num_experts"):
            problems.append(f"args.num_experts = {args.num_experts} without --swiglu: the converted MoE families "
                            f"(Mixtral, Qwen3-MoE) have SwiGLU experts")
        act = core_activation(args)
        common = dict(vocab_size=vocab, tie_word_embeddings=not untied, bos_token_id=None, eos_token_id=None,
                      initializer_range=run_arg(args, "init_method_std", 0.02))
        if positions == "learned_absolute":
            cls = models.GPT2LMHeadModel
            config = models.GPT2Config(
                n_positions=run_arg(args, "max_position_embeddings", 1024), n_embd=hidden, n_layer=args.num_layers,
                n_head=heads, n_inner=ffn, activation_function=act, layer_norm_epsilon=eps,
                resid_pdrop=run_arg(args, "hidden_dropout", 0.1), embd_pdrop=run_arg(args, "hidden_dropout", 0.1),
                attn_pdrop=run_arg(args, "attention_dropout", 0.1), **common)
        else:
            cls = models.GPTNeoXForCausalLM
            parameters = {"rope_type": "default", **(rope["rope_scaling"] or {}), "rope_theta": rope["rope_theta"],
                          "partial_rotary_factor": float(run_arg(args, "rotary_percent", 1.0))}
            config = models.GPTNeoXConfig(
                hidden_size=hidden, num_hidden_layers=args.num_layers, num_attention_heads=heads,
                intermediate_size=ffn, hidden_act=act, layer_norm_eps=eps, use_parallel_residual=False,
                max_position_embeddings=run_arg(args, "max_position_embeddings", 2048), rope_parameters=parameters,
                attention_bias=True, hidden_dropout=run_arg(args, "hidden_dropout", 0.0),
                attention_dropout=run_arg(args, "attention_dropout", 0.0), **common)
    else:
        if run_arg(args, "rotary_percent", 1.0) != 1.0:
            problems.append(f"args.rotary_percent = {args.rotary_percent}: Llama rotates every channel (1.0)")
        qkv_only = bool(run_arg(args, "add_qkv_bias", False)) and not bias
        kwargs = dict(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=args.num_layers,
            num_attention_heads=heads, num_key_value_heads=groups, rms_norm_eps=eps,
            max_position_embeddings=run_arg(args, "max_position_embeddings", 4096), tie_word_embeddings=not untied,
            attention_dropout=run_arg(args, "attention_dropout", 0.0),
            initializer_range=run_arg(args, "init_method_std", 0.02), bos_token_id=None, eos_token_id=None, **rope)
        if head_dim * heads != hidden:
            kwargs["head_dim"] = head_dim
        window, layer_types = _window(args, problems)
        windows = dict(use_sliding_window=True, sliding_window=window,
                       layer_types=layer_types or ["sliding_attention"] * args.num_layers) if window else {}
        cls = models.LlamaForCausalLM
        if run_arg(args, "num_experts"):
            cls, config = _moe_config(args, kwargs, window, layer_types, bias, qkv_only, problems)
        elif run_arg(args, "qk_layernorm", False):  # per-head q/k RMSNorms: Qwen3
            if bias or qkv_only:
                problems.append("args.qk_layernorm with biases (add_bias_linear or add_qkv_bias): Qwen3, the family "
                                "with per-head q/k norms, has none here")
            cls, config = models.Qwen3ForCausalLM, models.Qwen3Config(**{**kwargs, "head_dim": head_dim}, **windows)
        elif qkv_only:
            config = transformers.Qwen2Config(**kwargs, **windows)
        elif window:  # Mistral: one window on every layer, no biases
            if bias:
                problems.append("args.window_size with args.add_bias_linear: Mistral, the windowed family without "
                                "q/k/v-only biases or q/k norms, has no biases")
            if layer_types:
                problems.append("args.window_attn_skip_freq (full attention on some layers) without q/k/v-only biases "
                                "(Qwen2) or q/k norms (Qwen3): Mistral has the window on every layer")
            cls, config = models.MistralForCausalLM, models.MistralConfig(**kwargs, sliding_window=window)
        else:
            config = models.LlamaConfig(attention_bias=bias, mlp_bias=bias, **kwargs)
    if run_arg(args, "apply_layernorm_1p", False) and family == "llama":
        problems.append("args.apply_layernorm_1p = True with RMSNorm is not converted")
    problems += _tensor_problems(cls, config, tensors, padded)
    if problems:
        raise ValueError(f"{where} ({family} family, from its args) cannot be converted; {len(problems)} "
                         f"problem(s):\n  " + "\n  ".join(problems))
    return cls, config, padded


# Megatron-LM's MoE args that Mixtral, Qwen2-MoE and Qwen3-MoE have no form for, with what is set when they are
MOE_REFUSED = {
    "moe_router_score_function": (lambda v: v not in (None, "softmax"), "sigmoid scores (DeepSeek-V3's router)"),
    "moe_router_enable_expert_bias": (bool, "a selection bias (DeepSeek-V3's e_score_correction_bias)"),
    "moe_router_num_groups": (bool, "group-limited routing (DeepSeek-V3's n_group)"),
    "moe_router_group_topk": (bool, "group-limited routing (DeepSeek-V3's topk_group)"),
    "moe_router_topk_limited_devices": (bool, "device-limited routing (DeepSeek-V2)"),
    "moe_router_topk_scaling_factor": (lambda v: v not in (None, 1.0), "routed weights scaled (DeepSeek's "
                                                                      "routed_scaling_factor)"),
    "moe_router_load_balancing_type": (lambda v: v == "sinkhorn", "Sinkhorn routing (a sigmoid router at inference)"),
    "moe_expert_capacity_factor": (lambda v: v is not None, "token dropping at an expert capacity"),
    "moe_input_jitter_eps": (bool, "jitter on the router's input"),
    "moe_apply_probs_on_input": (bool, "router weights applied to the experts' input"),
    "moe_latent_size": (bool, "experts on a latent projection"),
}


def _moe_config(args: argparse.Namespace, kwargs: dict, window: int | None, layer_types: list[str] | None,
                bias: bool, qkv_only: bool, problems: list[str]):
    """(class, config) of a Megatron-Core MoE GPT: Qwen2-MoE with a gated shared expert
    (--moe-shared-expert-gate; q/k/v biases as --add-qkv-bias), Qwen3-MoE with --qk-layernorm
    (both: dense layers from --moe-layer-freq as mlp_only_layers, top-k weights renormalised
    unless --moe-router-pre-softmax), Mixtral otherwise (every layer MoE, renormalised top-k).
    Megatron-Core's top-k of the logits then softmax over those k is the renormalised softmax;
    softmax first (--moe-router-pre-softmax) keeps the top-k probabilities as they are
    (norm_topk_prob false). A run that trained with a balancing loss (--moe-aux-loss-coeff > 0)
    gets output_router_logits and that coefficient (the losses' definitions differ: `_moe_args`)."""
    problems += [f"args.{name} = {getattr(args, name)!r}: {what}, which Mixtral, Qwen2-MoE and Qwen3-MoE do not "
                 f"have" for name, (bad, what) in MOE_REFUSED.items() if bad(run_arg(args, name))]
    layers, pattern = args.num_layers, run_arg(args, "moe_layer_freq", 1)
    moe_layers = [i % pattern == 0 for i in range(layers)] if isinstance(pattern, int) else [bool(p) for p in pattern]
    if len(moe_layers) != layers:
        problems.append(f"args.moe_layer_freq has {len(moe_layers)} entries for {layers} layers")
    renormalised = not run_arg(args, "moe_router_pre_softmax", False)
    coefficient = float(run_arg(args, "moe_aux_loss_coeff", 0.0))
    moe = dict(num_experts_per_tok=run_arg(args, "moe_router_topk", 2), router_aux_loss_coef=coefficient,
               output_router_logits=coefficient > 0)
    expert_size = run_arg(args, "moe_ffn_hidden_size", kwargs["intermediate_size"])
    shared, gate = run_arg(args, "moe_shared_expert_intermediate_size"), run_arg(args, "moe_shared_expert_gate", False)
    qwen = dict(num_experts=args.num_experts, moe_intermediate_size=expert_size, norm_topk_prob=renormalised,
                decoder_sparse_step=1, mlp_only_layers=[i for i, is_moe in enumerate(moe_layers) if not is_moe])
    if bias:
        problems.append("args.add_bias_linear with experts: the MoE families have no biases on the experts and "
                        "the attention's output (Qwen2-MoE's q/k/v biases: --add-qkv-bias)")
    if window:
        if run_arg(args, "qk_layernorm", False) or shared:
            problems.append("args.window_size with experts and --qk-layernorm or a shared expert: Qwen2-MoE's and "
                            "Qwen3-MoE's windows are not converted")
    if shared:
        if not gate or run_arg(args, "qk_layernorm", False):
            problems.append(f"args.moe_shared_expert_intermediate_size = {shared} "
                            f"{'without --moe-shared-expert-gate' if not gate else 'with --qk-layernorm'}: Qwen2-MoE, "
                            f"the family with a shared expert, gates it and has no q/k norms")
        return models.Qwen2MoeForCausalLM, models.Qwen2MoeConfig(
            **kwargs, qkv_bias=qkv_only, shared_expert_intermediate_size=shared, **qwen, **moe)
    if gate:
        problems.append("args.moe_shared_expert_gate without args.moe_shared_expert_intermediate_size: no shared "
                        "expert to gate")
    if qkv_only:
        problems.append("args.add_qkv_bias with experts but no shared expert: Qwen2-MoE, the family with q/k/v "
                        "biases, has a gated shared expert")
    if run_arg(args, "qk_layernorm", False):
        return models.Qwen3MoeForCausalLM, models.Qwen3MoeConfig(
            **{**kwargs, "head_dim": kwargs.get("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])},
            **qwen, **moe)
    if not all(moe_layers):
        problems.append(f"args.moe_layer_freq = {pattern!r} (dense layers) without --qk-layernorm or a shared "
                        f"expert: Mixtral has experts in every layer (Qwen3-MoE and Qwen2-MoE have dense ones)")
    if not renormalised:
        problems.append("args.moe_router_pre_softmax (top-k probabilities not renormalised) without "
                        "--qk-layernorm or a shared expert: Mixtral renormalises them (Qwen3-MoE and Qwen2-MoE may not)")
    if layer_types:
        problems.append("args.window_attn_skip_freq (full attention on some layers) with experts: Mixtral has the "
                        "window on every layer")
    return models.MixtralForCausalLM, models.MixtralConfig(
        **{**kwargs, "intermediate_size": expert_size}, num_local_experts=args.num_experts, sliding_window=window,
        router_jitter_noise=0.0, **moe)


def _window(args: argparse.Namespace, problems: list[str]) -> tuple[int | None, list[str] | None]:
    """Megatron-Core's sliding window as Hugging Face's: (sliding_window, layer_types when some
    layers skip it). Megatron-Core's (left, 0) sees the query and `left` earlier positions."""
    size = run_arg(args, "window_size")
    if size is None or size[0] < 0:  # -1: no limit
        return None, None
    if size[1] != 0:
        problems.append(f"args.window_size = {tuple(size)}: a window that sees later positions is not causal")
        return None, None
    skip, layers = run_arg(args, "window_attn_skip_freq"), args.num_layers
    if skip is None:
        return size[0] + 1, None
    windowed = [(i + 1) % skip != 0 for i in range(layers)] if isinstance(skip, int) else [bool(w) for w in skip]
    if len(windowed) != layers:
        problems.append(f"args.window_attn_skip_freq has {len(windowed)} entries for {layers} layers")
    if all(windowed):
        return size[0] + 1, None
    if not any(windowed):
        return None, None
    return size[0] + 1, ["sliding_attention" if w else "full_attention" for w in windowed]


def _rope_scaling(args: argparse.Namespace, problems: list[str]) -> dict | None:
    """Megatron-Core's RoPE scaling as Hugging Face's rope parameters: llama3 (--use-rope-scaling)
    or linear (--rotary-seq-len-interpolation-factor)."""
    llama3, linear = run_arg(args, "use_rope_scaling", False), run_arg(args, "rotary_seq_len_interpolation_factor")
    if llama3 and linear is not None:
        problems.append("args.use_rope_scaling with args.rotary_seq_len_interpolation_factor: two RoPE scalings "
                        "at once are not converted")
    if llama3:
        return {"rope_type": "llama3", "factor": float(run_arg(args, "rope_scaling_factor", 8.0)), **LLAMA3_SCALING}
    if linear is not None:
        return {"rope_type": "linear", "factor": float(linear)}
    return None


def core_activation(args: argparse.Namespace) -> str:
    """A Megatron-Core GPT's GELU as Hugging Face names it. Megatron-LM builds Megatron-Core models
    with erf GELU (it ignores --openai-gelu); the fused bias-GELU kernel, on by default
    (--bias-gelu-fusion) with biases, computes the tanh approximation instead."""
    return "gelu_new" if run_arg(args, "bias_gelu_fusion", False) and run_arg(args, "add_bias_linear", True) else "gelu"


def skeleton(cls: type[nn.Module], config) -> nn.Module:
    with torch.device("meta"):
        return cls(config)


def _tensor_problems(cls, config, tensors: dict[str, torch.Tensor], padded: int) -> list[str]:
    """The checkpoint's tensors against what the config's model needs: missing, unexpected and misshaped."""
    model = skeleton(cls, config)
    shapes = dict(model.named_parameters())
    expected: dict[str, torch.Size] = {}
    for rule in megatron_weight_map(model, padded).rules:
        for name, shape in rule.hf_shapes(shapes[rule.zoo].shape).items():
            expected[name] = shape
    problems = [f"missing {name} {tuple(shape)}" for name, shape in expected.items() if name not in tensors]
    problems += [f"{name} is {tuple(tensors[name].shape)}, the args make it {tuple(shape)}"
                 for name, shape in expected.items() if name in tensors and tensors[name].shape != shape]
    problems += [f"unexpected {name} {tuple(t.shape)}" for name, t in tensors.items() if name not in expected]
    return problems
