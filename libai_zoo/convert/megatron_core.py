"""Megatron-Core GPT models <-> libai_zoo, for the GPT family (learned positions: GPT-2; RoPE:
GPT-NeoX, sequential) and the Llama family (Llama, Qwen2; Qwen3 with --qk-layernorm; Mistral,
and Qwen2/3 `layer_types`, with --window-size), and Mixtures of Experts (--num-experts: Mixtral;
Qwen3-MoE with --qk-layernorm).

    model, source = read_megatron_core("megatron_ckpt")      # torch_dist, or per-rank torch files
    write_megatron_core(model, "megatron_out")               # torch_dist + common.pt, `--load`-able

Megatron-Core's `GPTModel` names its tensors (with the layer norms as the Transformer Engine
layers hold them; Megatron-Core's local layers map theirs to these names when saving):

    embedding.word_embeddings.weight                     [padded vocab, h]   rows split over tp
    embedding.position_embeddings.weight                 [positions, h]      learned positions only
    decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight (, _bias)  the pre-attention norm
    decoder.layers.{i}.self_attention.linear_qkv.weight (, .bias)  per query group [its q heads, k, v]
    decoder.layers.{i}.self_attention.q_layernorm.weight, k_layernorm.weight  per-head q/k norms (--qk-layernorm)
    decoder.layers.{i}.self_attention.linear_proj.weight (, .bias) columns split over tp
    decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight (, _bias)  the pre-MLP norm
    decoder.layers.{i}.mlp.linear_fc1.weight (, .bias)   [gate; up] with SwiGLU (per rank in torch files)
    decoder.layers.{i}.mlp.linear_fc2.weight (, .bias)   columns split over tp
    decoder.final_layernorm.weight (, .bias)
    output_layer.weight                                  untied head only

An MoE layer (--num-experts E; dense and MoE layers mixed by --moe-layer-freq are kept per layer
in torch_dist, all-MoE layers stacked like the others) has instead of the MLP's:

    decoder.layers.{i}.pre_mlp_layernorm.weight          the pre-MLP norm (the local layer spec files it
                                                         as mlp.linear_fc1.layer_norm_weight: both read)
    decoder.layers.{i}.mlp.router.weight                 [E, h]
    decoder.layers.{i}.mlp.experts.experts.linear_fc1.weight  [E, gate; up, h]  the same for SequentialMLP
    decoder.layers.{i}.mlp.experts.experts.linear_fc2.weight  [E, h, F]         and grouped GEMM experts
    decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight, linear_fc2.weight, gate_weight  (shared expert)

The grouped `linear_qkv` is libai_zoo's fused `qkv` row for row, so the map
(`megatron_weight_map`) pairs the zoo's parameters with these names using the rules of the
Hugging Face maps (`libai_zoo.hf.rules`); Hugging Face names and layouts are the models' own
maps' business (`save_pretrained`, `from_pretrained`), never restated here. The map and the
args a model is written with are read off the built decoder (`DecoderSpec`: each layer's
`LayerSpec`), never its family's name: any family Megatron-Core can express is
written, and an option it cannot express is refused by name (`architecture_args`).

The architecture comes from the run's `args` (`common.pt`, or the torch files' "args"), which
Megatron-LM saves with every checkpoint; `megatron_config` turns them into the zoo config and
checks them against the tensors, naming every problem in one error.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import torch
import transformers
from torch import nn

from libai_zoo import models
from libai_zoo.hf import read_config
from libai_zoo.hf.rules import PaddedRows, Part, Same, WeightMap, linear
from libai_zoo.layers import AttentionSpec, LatentAttentionSpec, LayerSpec, MLPSpec, MoE, MoESpec, merge_lora
from libai_zoo.layers.spec import arguments
from libai_zoo.models.decoder import DecoderForCausalLM, DecoderSpec

from . import torch_dist
from .hf_zoo import check_output_dir, load_checkpoint_model, resolve_checkpoint, write_zoo_checkpoint, zoo_class_for
from .megatron_files import LAYER_NAME, TRACKER, find_checkpoint, flatten, iteration_directory
from .megatron_legacy_gpt import legacy_to_hf

logger = logging.getLogger("libai_zoo")

RELEASE = "release"
# Megatron-Core's local layers name their norms apart; their checkpoints use the fused names.
LOCAL_NORMS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
               "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass
class MegatronSource:
    """Where a Megatron-Core checkpoint was read from, and how."""

    directory: Path
    format: str                 # "torch_dist" or "torch"
    args: argparse.Namespace
    tp: int = 1
    pp: int = 1


def _arg(args: argparse.Namespace, name: str, default=None):
    value = getattr(args, name, default)
    return default if value is None else value


def megatron_weight_map(model: nn.Module, padded_vocab: int) -> WeightMap:
    """The rules of a zoo decoder's parameters <- Megatron-Core names (per layer, global numbering),
    read off the built model: its parts' names, biases, norms, q/k norms, gated MLP, and an MoE
    layer's norm, router, experts and shared expert."""
    body, rules = model.body, []
    names, p = body.names, model.base_model_prefix + "."

    def pair(zoo: str, mcore: str, part: nn.Module) -> None:
        rules.extend(linear(zoo, mcore, bias=getattr(part, "bias", None) is not None))

    def norm(zoo: str, mcore: str, part: nn.Module) -> None:  # the fused norms: "layer_norm_weight"
        rules.append(Same(f"{zoo}.weight", f"{mcore}weight"))
        if getattr(part, "bias", None) is not None:
            rules.append(Same(f"{zoo}.bias", f"{mcore}bias"))

    def mlp_pair(zoo: str, mcore: str, mlp: nn.Module) -> None:  # linear_fc1 = [gate; up] when gated
        if mlp.gate is None:
            pair(f"{zoo}.up", f"{mcore}linear_fc1", mlp.up)
        else:
            for index, part in enumerate((mlp.gate, mlp.up)):
                for suffix in ("weight", "bias") if part.bias is not None else ("weight",):
                    rules.append(Part(f"{zoo}.{('gate', 'up')[index]}.{suffix}", f"{mcore}linear_fc1.{suffix}",
                                      index, 2))
        pair(f"{zoo}.down", f"{mcore}linear_fc2", mlp.down)

    def moe(zoo: str, mcore: str, mlp: MoE) -> None:
        """The router, the experts stacked as Megatron-Core's torch_dist holds them (the same for
        SequentialMLP and grouped GEMM experts: fc1 [E, gate; up, h], fc2 [E, h, F]) and the
        shared expert, with its sigmoid gate (Qwen2-MoE's)."""
        rules.append(Same(f"{zoo}.router.weight", f"{mcore}router.weight"))
        fc1, fc2 = f"{mcore}experts.experts.linear_fc1.weight", f"{mcore}experts.experts.linear_fc2.weight"
        rules.extend([Part(f"{zoo}.experts.gate_proj", fc1, 0, 2, dim=1), Part(f"{zoo}.experts.up_proj", fc1, 1, 2, dim=1),
                      Same(f"{zoo}.experts.down_proj", fc2)])
        if mlp.shared_expert is not None:
            mlp_pair(f"{zoo}.shared_expert", f"{mcore}shared_experts.", mlp.shared_expert)
        if mlp.shared_expert_gate is not None:
            rules.append(Same(f"{zoo}.shared_expert_gate.weight", f"{mcore}shared_experts.gate_weight"))

    rules.append(PaddedRows(f"{p}{names.embed}.weight", "embedding.word_embeddings.weight", padded_vocab))
    if names.positions:
        rules.append(Same(f"{p}{names.positions}.weight", "embedding.position_embeddings.weight"))
    for i, layer in enumerate(getattr(body, names.layers)):
        z, m = f"{p}{names.layers}.{i}.", f"decoder.layers.{i}."
        attn, mlp = layer.attn, layer.mlp
        norm(z + "attn_norm", m + "self_attention.linear_qkv.layer_norm_", layer.attn_norm)
        pair(z + "attn.qkv", m + "self_attention.linear_qkv", attn.qkv)
        if attn.qk_norm:  # --qk-layernorm: one norm over each head's channels, shared by the heads
            for part in ("q", "k"):
                rules.append(Same(f"{z}attn.{part}_norm.weight", f"{m}self_attention.{part}_layernorm.weight"))
        pair(z + "attn.out", m + "self_attention.linear_proj", attn.out)
        if isinstance(mlp, MoE):  # Transformer Engine's name: the experts are no fused norm-linear
            norm(z + "mlp_norm", m + "pre_mlp_layernorm.", layer.mlp_norm)
            moe(z + "mlp", m + "mlp.", mlp)
        else:
            norm(z + "mlp_norm", m + "mlp.linear_fc1.layer_norm_", layer.mlp_norm)
            mlp_pair(z + "mlp", m + "mlp.", mlp)
    pair(f"{p}{names.final_norm}", "decoder.final_layernorm", getattr(body, names.final_norm))
    if not model.config.tie_word_embeddings:
        rules.append(PaddedRows("lm_head.weight", "output_layer.weight", padded_vocab))
    return WeightMap(rules)


# ----------------------------------------------------------------------------- args <-> config


def megatron_config(args: argparse.Namespace, tensors: dict[str, torch.Tensor], *, vocab_size: int | None = None,
                    where: str = "the checkpoint"):
    """(zoo class, its config) for a Megatron-Core GPTModel's run args, checked against the
    tensors (names and shapes); every problem is named in one error."""
    problems: list[str] = []
    gated = bool(_arg(args, "swiglu", False))
    family = "llama" if gated else "gpt"
    positions = _arg(args, "position_embedding_type", "learned_absolute")
    expected = {"position_embedding_type": ("rope",) if gated else ("learned_absolute", "rope"),
                "normalization": ("RMSNorm",) if gated else ("LayerNorm",)}
    for name, values in expected.items():
        given = _arg(args, name, "learned_absolute" if name == "position_embedding_type" else "LayerNorm")
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
    problems += [f"args.{name} is missing" for name in required if _arg(args, name) is None]
    if problems and any(name.endswith("missing") for name in problems):
        raise ValueError(f"{where} cannot be converted:\n  " + "\n  ".join(problems))

    heads, hidden = args.num_attention_heads, args.hidden_size
    groups = _arg(args, "num_query_groups", heads) if _arg(args, "group_query_attention", False) else heads
    head_dim = _arg(args, "kv_channels", hidden // heads)
    ffn = _arg(args, "ffn_hidden_size", 4 * hidden)
    words = tensors.get("embedding.word_embeddings.weight")
    padded = _arg(args, "padded_vocab_size", words.shape[0] if words is not None else None)
    if padded is None:
        raise ValueError(f"{where} has no embedding.word_embeddings.weight and no args.padded_vocab_size")
    saved = _arg(args, "vocab_size")
    if saved is not None and _arg(args, "tokenizer_type") == "NullTokenizer":
        saved += 1  # its vocabulary is --vocab-size ids plus the end-of-document id
    vocab = vocab_size or saved or padded
    if not 0 < vocab <= padded:
        problems.append(f"vocabulary {vocab} (--vocab-size or args.vocab_size) is not between 1 and the padded "
                        f"vocabulary {padded}")
        vocab = padded
    untied = bool(_arg(args, "untie_embeddings_and_output_weights", False))
    bias = bool(_arg(args, "add_bias_linear", True))
    eps = float(_arg(args, "norm_epsilon", _arg(args, "layernorm_epsilon", 1e-5)))
    rope = dict(rope_theta=float(_arg(args, "rotary_base", 10000)), rope_scaling=_rope_scaling(args, problems))
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
            if _arg(args, name):
                problems.append(f"args.{name} = {getattr(args, name)!r}: {name} has no Hugging Face form in the GPT "
                                f"family (GPT-2, GPT-NeoX)")
        if _arg(args, "num_experts"):
            problems.append(f"args.num_experts = {args.num_experts} without --swiglu: the converted MoE families "
                            f"(Mixtral, Qwen3-MoE) have SwiGLU experts")
        act = core_activation(args)
        common = dict(vocab_size=vocab, tie_word_embeddings=not untied, bos_token_id=None, eos_token_id=None,
                      initializer_range=_arg(args, "init_method_std", 0.02))
        if positions == "learned_absolute":
            cls = models.GPT2LMHeadModel
            config = models.GPT2Config(
                n_positions=_arg(args, "max_position_embeddings", 1024), n_embd=hidden, n_layer=args.num_layers,
                n_head=heads, n_inner=ffn, activation_function=act, layer_norm_epsilon=eps,
                resid_pdrop=_arg(args, "hidden_dropout", 0.1), embd_pdrop=_arg(args, "hidden_dropout", 0.1),
                attn_pdrop=_arg(args, "attention_dropout", 0.1), **common)
        else:
            cls = models.GPTNeoXForCausalLM
            parameters = {"rope_type": "default", **(rope["rope_scaling"] or {}), "rope_theta": rope["rope_theta"],
                          "partial_rotary_factor": float(_arg(args, "rotary_percent", 1.0))}
            config = models.GPTNeoXConfig(
                hidden_size=hidden, num_hidden_layers=args.num_layers, num_attention_heads=heads,
                intermediate_size=ffn, hidden_act=act, layer_norm_eps=eps, use_parallel_residual=False,
                max_position_embeddings=_arg(args, "max_position_embeddings", 2048), rope_parameters=parameters,
                attention_bias=True, hidden_dropout=_arg(args, "hidden_dropout", 0.0),
                attention_dropout=_arg(args, "attention_dropout", 0.0), **common)
    else:
        if _arg(args, "rotary_percent", 1.0) != 1.0:
            problems.append(f"args.rotary_percent = {args.rotary_percent}: Llama rotates every channel (1.0)")
        qkv_only = bool(_arg(args, "add_qkv_bias", False)) and not bias
        kwargs = dict(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=args.num_layers,
            num_attention_heads=heads, num_key_value_heads=groups, rms_norm_eps=eps,
            max_position_embeddings=_arg(args, "max_position_embeddings", 4096), tie_word_embeddings=not untied,
            attention_dropout=_arg(args, "attention_dropout", 0.0),
            initializer_range=_arg(args, "init_method_std", 0.02), bos_token_id=None, eos_token_id=None, **rope)
        if head_dim * heads != hidden:
            kwargs["head_dim"] = head_dim
        window, layer_types = _window(args, problems)
        windows = dict(use_sliding_window=True, sliding_window=window,
                       layer_types=layer_types or ["sliding_attention"] * args.num_layers) if window else {}
        cls = models.LlamaForCausalLM
        if _arg(args, "num_experts"):
            cls, config = _moe_config(args, kwargs, window, layer_types, bias, qkv_only, problems)
        elif _arg(args, "qk_layernorm", False):  # per-head q/k RMSNorms: Qwen3
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
    if _arg(args, "apply_layernorm_1p", False) and family == "llama":
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
                 f"have" for name, (bad, what) in MOE_REFUSED.items() if bad(_arg(args, name))]
    layers, pattern = args.num_layers, _arg(args, "moe_layer_freq", 1)
    moe_layers = [i % pattern == 0 for i in range(layers)] if isinstance(pattern, int) else [bool(p) for p in pattern]
    if len(moe_layers) != layers:
        problems.append(f"args.moe_layer_freq has {len(moe_layers)} entries for {layers} layers")
    renormalised = not _arg(args, "moe_router_pre_softmax", False)
    coefficient = float(_arg(args, "moe_aux_loss_coeff", 0.0))
    moe = dict(num_experts_per_tok=_arg(args, "moe_router_topk", 2), router_aux_loss_coef=coefficient,
               output_router_logits=coefficient > 0)
    expert_size = _arg(args, "moe_ffn_hidden_size", kwargs["intermediate_size"])
    shared, gate = _arg(args, "moe_shared_expert_intermediate_size"), _arg(args, "moe_shared_expert_gate", False)
    qwen = dict(num_experts=args.num_experts, moe_intermediate_size=expert_size, norm_topk_prob=renormalised,
                decoder_sparse_step=1, mlp_only_layers=[i for i, is_moe in enumerate(moe_layers) if not is_moe])
    if bias:
        problems.append("args.add_bias_linear with experts: the MoE families have no biases on the experts and "
                        "the attention's output (Qwen2-MoE's q/k/v biases: --add-qkv-bias)")
    if window:
        if _arg(args, "qk_layernorm", False) or shared:
            problems.append("args.window_size with experts and --qk-layernorm or a shared expert: Qwen2-MoE's and "
                            "Qwen3-MoE's windows are not converted")
    if shared:
        if not gate or _arg(args, "qk_layernorm", False):
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
    if _arg(args, "qk_layernorm", False):
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
    size = _arg(args, "window_size")
    if size is None or size[0] < 0:  # -1: no limit
        return None, None
    if size[1] != 0:
        problems.append(f"args.window_size = {tuple(size)}: a window that sees later positions is not causal")
        return None, None
    skip, layers = _arg(args, "window_attn_skip_freq"), args.num_layers
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
    llama3, linear = _arg(args, "use_rope_scaling", False), _arg(args, "rotary_seq_len_interpolation_factor")
    if llama3 and linear is not None:
        problems.append("args.use_rope_scaling with args.rotary_seq_len_interpolation_factor: two RoPE scalings "
                        "at once are not converted")
    if llama3:
        return {"rope_type": "llama3", "factor": float(_arg(args, "rope_scaling_factor", 8.0)), **LLAMA3_SCALING}
    if linear is not None:
        return {"rope_type": "linear", "factor": float(linear)}
    return None


def core_activation(args: argparse.Namespace) -> str:
    """A Megatron-Core GPT's GELU as Hugging Face names it. Megatron-LM builds Megatron-Core models
    with erf GELU (it ignores --openai-gelu); the fused bias-GELU kernel, on by default
    (--bias-gelu-fusion) with biases, computes the tanh approximation instead."""
    return "gelu_new" if _arg(args, "bias_gelu_fusion", False) and _arg(args, "add_bias_linear", True) else "gelu"


def _skeleton(cls: type[nn.Module], config) -> nn.Module:
    with torch.device("meta"):
        return cls(config)


def _tensor_problems(cls, config, tensors: dict[str, torch.Tensor], padded: int) -> list[str]:
    """The checkpoint's tensors against what the config's model needs: missing, unexpected and misshaped."""
    model = _skeleton(cls, config)
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


def _stored_config(derived, stored: dict | None, padded: int):
    """The Hugging Face config that hf-to-megatron keeps in common.pt, when it describes the
    architecture the args describe (the same Megatron args), so that a round trip gives back the
    same config.json (token ids, model type, ...); the args' config otherwise."""
    if not isinstance(stored, dict) or stored.get("model_type") != derived.model_type:
        return derived
    candidate = type(derived).from_dict({k: v for k, v in stored.items() if k != "transformers_version"})
    cls = models.AutoModelForCausalLM.model_class(derived.model_type)
    ignored = {"params_dtype", "bf16", "fp16"}
    try:
        ours, theirs = ({key: value for key, value in vars(megatron_args(_skeleton(cls, c), padded, 1)).items()
                         if key not in ignored} for c in (derived, candidate))
    except ValueError:  # the kept config has no Megatron form: it is not this checkpoint's
        return derived
    if ours != theirs:
        logger.info("common.pt keeps a Hugging Face config that differs from the args (another vocabulary size, or "
                    "the model changed in Megatron-LM); the config is built from the args")
        return derived
    return candidate


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


# ----------------------------------------------------------------------------- reading


def _canonical(name: str) -> str:
    """A Megatron-Core tensor name with the local layers' norm names as the checkpoint's."""
    layer = LAYER_NAME.match(name.removeprefix("decoder."))
    if name.startswith("decoder.layers.") and layer:
        rest = layer[2]
        for local, fused in LOCAL_NORMS.items():
            if rest.startswith(local):
                return f"decoder.layers.{layer[1]}.{fused}{rest[len(local):]}"
    return name


def _moe_norm_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An MoE layer's pre-MLP norm under Transformer Engine's name (`pre_mlp_layernorm.`): the
    local layer spec files it under `mlp.linear_fc1.layer_norm_` as a dense layer's."""
    moe_layers = {name.removesuffix("mlp.router.weight") for name in tensors if name.endswith(".mlp.router.weight")}
    renamed = {}
    for name, tensor in tensors.items():
        layer, _, rest = name.rpartition("mlp.linear_fc1.layer_norm_")
        renamed[f"{layer}pre_mlp_layernorm.{rest}" if layer in moe_layers else name] = tensor
    return renamed


def _check_covered(model: nn.Module, rules: list) -> None:
    """Every parameter has a rule, so none is left as initialised (Megatron-LM issue 5845: a
    Mixtral conversion that left every expert random)."""
    covered = {rule.zoo for rule in rules}
    missed = [name for name, _ in model.named_parameters() if name not in covered]
    if missed:
        raise ValueError(f"{len(missed)} parameter(s) of {type(model).__name__} have no Megatron-Core name and would "
                         f"not be converted: {', '.join(missed[:6])}")


def _split_kind(name: str, gated: bool) -> str:
    """How the tensor-parallel shards of a Megatron-Core tensor join."""
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return "gated" if gated else "rows"
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")):
        return "rows"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "columns"
    return "replicated"


def _join(name: str, parts: list[torch.Tensor], gated: bool) -> torch.Tensor:
    kind = _split_kind(name, gated)
    if kind == "rows":
        return torch.cat(parts)
    if kind == "columns":
        return torch.cat(parts, dim=1)
    if kind == "gated":  # each rank holds [its gate rows; its up rows]
        halves = [part.chunk(2) for part in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return parts[0]


def _read_torch_files(path: Path, allow_numpy: bool) -> tuple[MegatronSource, dict[str, torch.Tensor]]:
    """A per-rank `torch` checkpoint with Megatron-Core names: shards joined, layers numbered globally."""
    checkpoint = find_checkpoint(path, allow_numpy=allow_numpy)
    if checkpoint.args is None:
        raise ValueError(f"{checkpoint.directory}: the files hold no args; the architecture of a Megatron-Core "
                         f"checkpoint is read from them")
    if _arg(checkpoint.args, "num_experts"):
        raise ValueError(f"{checkpoint.directory}: per-rank torch files of a Mixture of Experts (args.num_experts = "
                         f"{checkpoint.args.num_experts}) are not read; save it as torch_dist (Megatron-LM's "
                         f"--ckpt-convert-format torch_dist) and convert that")
    gated = bool(_arg(checkpoint.args, "swiglu", False))
    untied = bool(_arg(checkpoint.args, "untie_embeddings_and_output_weights", False))
    tensors: dict[str, torch.Tensor] = {}
    offset, differing = 0, []
    for p in range(checkpoint.pp):
        shards = []
        for t in range(checkpoint.tp):
            model = checkpoint.load(t, p).get("model")
            if not isinstance(model, dict):
                raise ValueError(f"{checkpoint.files[t, p]} has no 'model' state dict: it is not a Megatron-LM "
                                 f"model checkpoint file")
            shards.append({_canonical(name): tensor for name, tensor in flatten(model).items()})
        for t, shard in enumerate(shards[1:], start=1):
            if set(shard) != set(shards[0]):
                raise ValueError(f"{checkpoint.files[t, p]} and {checkpoint.files[0, p]} hold different tensors "
                                 f"({sorted(set(shard) ^ set(shards[0]))[:6]}): the shards come from different "
                                 f"checkpoints")
        local = set()
        for name in shards[0]:
            parts = [shard[name] for shard in shards]
            layer = LAYER_NAME.match(name.removeprefix("decoder."))
            if name.startswith("decoder.layers.") and layer:
                local.add(int(layer[1]))
                name = f"decoder.layers.{offset + int(layer[1])}.{layer[2]}"
            elif name == "output_layer.weight" and not untied:
                continue  # the last stage's copy of the tied embedding
            tensors[name] = _join(name, parts, gated)
            whole = _split_kind(name, gated) == "replicated"
            if whole and any(not torch.equal(parts[0], other) for other in parts[1:]):
                differing.append(name)
        offset += len(local)
    if differing:
        logger.warning("%d tensor(s) that every tensor-parallel rank holds whole differ between ranks (rank 0's "
                       "kept): %s", len(differing), ", ".join(differing[:5]))
    source = MegatronSource(checkpoint.directory, "torch", checkpoint.args, checkpoint.tp, checkpoint.pp)
    return source, tensors


def is_megatron_core(path: str | Path, *, allow_numpy: bool = False) -> bool:
    """Whether the Megatron-LM checkpoint at `path` holds a Megatron-Core model (torch_dist, or
    torch files with `decoder.`/`embedding.` names) rather than a legacy `language_model` one."""
    directory, _, _ = iteration_directory(Path(path))
    if torch_dist.is_torch_dist(directory):
        return True
    checkpoint = find_checkpoint(directory, allow_numpy=allow_numpy)
    model = checkpoint.load(0, 0).get("model")
    return isinstance(model, dict) and "language_model" not in model


def read_megatron_core(path: str | Path, *, vocab_size: int | None = None, dtype: torch.dtype | None = None,
                       allow_numpy: bool = False) -> tuple[nn.Module, MegatronSource]:
    """The zoo model (whole, in this process) of a Megatron-Core GPT or Llama checkpoint at `path`
    (its root or an iteration directory; torch_dist or per-rank torch files, any tp/pp)."""
    directory, _, _ = iteration_directory(Path(path))
    if torch_dist.is_torch_dist(directory):
        common = torch_dist.read_common(directory)
        args = common.get("args")
        if not isinstance(args, argparse.Namespace):
            raise ValueError(f"{directory / torch_dist.COMMON} holds no args (keys: {', '.join(map(str, common))}): "
                             f"the architecture is read from them")
        source = MegatronSource(directory, "torch_dist", args, _arg(args, "tensor_model_parallel_size", 1),
                                _arg(args, "pipeline_model_parallel_size", 1))
        tensors = torch_dist.read_tensors(directory)
    else:
        source, tensors = _read_torch_files(directory, allow_numpy)
    tensors = _moe_norm_names({name: t for name, t in tensors.items() if not name.endswith("_extra_state")})
    if _arg(source.args, "apply_layernorm_1p", False):  # LayerNorm1P stores gamma - 1
        tensors = {name: t + 1.0 if name.endswith(("layer_norm_weight", "final_layernorm.weight")) else t
                   for name, t in tensors.items()}
    cls, config, padded = megatron_config(source.args, tensors, vocab_size=vocab_size, where=str(directory))
    if source.format == "torch_dist":
        config = _stored_config(config, common.get("hf_config"), padded)
    dtype = dtype or tensors["embedding.word_embeddings.weight"].dtype
    config.dtype = str(dtype).removeprefix("torch.")
    model = _skeleton(cls, config).to(dtype)
    model.to_empty(device="cpu")

    def read(name: str, block: dict[int, tuple[int, int]] | None = None) -> torch.Tensor:
        tensor = tensors[name]
        for dim, (start, end) in (block or {}).items():
            tensor = tensor.narrow(dim, start, end - start)
        return tensor

    with torch.no_grad():
        parameters = dict(model.named_parameters())
        rules = megatron_weight_map(model, padded).rules
        for rule in rules:
            parameters[rule.zoo].copy_(rule.load(read, None, parameters[rule.zoo].shape))
    if config.tie_word_embeddings:
        model.tie_weights()
    _check_covered(model, rules)
    return model.eval(), source


# ----------------------------------------------------------------------------- writing


def padded_vocabulary(vocab: int, multiple: int) -> int:
    """Megatron-LM's padded vocabulary: `vocab` rounded up to a multiple of
    make_vocab_size_divisible_by × tp (pass their product)."""
    return math.ceil(vocab / multiple) * multiple


def write_megatron_core(model: nn.Module, output_dir: str | Path, *, make_vocab_size_divisible_by: int = 128,
                        extra: dict | None = None) -> Path:
    """Write a zoo decoder (any family `architecture_args` accepts) as a Megatron-Core torch_dist
    checkpoint that Megatron-LM loads with `--load OUT_DIR` (the `release` iteration: weights only,
    no optimizer or RNG state); return the iteration directory. `extra` adds keys to common.pt."""
    output_dir = Path(output_dir)
    padded = padded_vocabulary(model.config.vocab_size, make_vocab_size_divisible_by)
    args = megatron_args(model, padded, make_vocab_size_divisible_by)
    parameters = dict(model.named_parameters(remove_duplicate=False))
    rules = megatron_weight_map(model, padded).rules
    _check_covered(model, rules)
    tensors: dict[str, list[torch.Tensor]] = {}
    dims: dict[str, int] = {}  # the dim the parts of one tensor (`Part`) join along
    with torch.no_grad():
        for rule in rules:
            for name, tensor in rule.save(parameters[rule.zoo].detach()).items():
                tensors.setdefault(name, []).append(tensor)
                dims[name] = getattr(rule, "dim", 0)
    joined = {name: torch.cat(parts, dims[name]) if len(parts) > 1 else parts[0].contiguous()
              for name, parts in tensors.items()}
    directory = output_dir / RELEASE
    common = {"args": args, "checkpoint_version": 3.0, "iteration": 0, **(extra or {})}
    # dense and MoE layers together are heterogeneous: Megatron-Core keeps them per layer
    torch_dist.write_checkpoint(directory, joined, common, stacked=not isinstance(args.moe_layer_freq, list))
    (output_dir / TRACKER).write_text(RELEASE)
    logger.info("wrote Megatron-Core torch_dist checkpoint %s", directory)
    return directory


# ----------------------------------------------------------------------------- the commands


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def megatron_to_hf(path: str | Path, output_dir: str | Path, *, vocab_size: int | None = None,
                   num_attention_heads: int | None = None, dtype: torch.dtype | str | None = None,
                   max_shard_size: int | str = "5GB", allow_numpy: bool = False):
    """Write the Megatron-LM checkpoint at `path` as a Hugging Face directory: a Megatron-Core GPT
    or Llama model (torch_dist or torch files), or a legacy `language_model` GPT (torch files);
    return (where it was read from: .directory, .tp, .pp; the config written)."""
    if not is_megatron_core(path, allow_numpy=allow_numpy):
        return legacy_to_hf(path, output_dir, vocab_size=vocab_size, num_attention_heads=num_attention_heads,
                            dtype=dtype, max_shard_size=max_shard_size, allow_numpy=allow_numpy)
    model, source = read_megatron_core(path, vocab_size=vocab_size, dtype=_dtype(dtype), allow_numpy=allow_numpy)
    model.save_pretrained(output_dir, max_shard_size=max_shard_size)
    return source, model.config


def megatron_to_zoo(path: str | Path, output_dir: str | Path, *, dp: int = 1, tp: int = 1, pp: int = 1,
                    vocab_size: int | None = None, dtype: torch.dtype | str | None = None,
                    allow_numpy: bool = False, overwrite: bool = False):
    """Write a Megatron-Core checkpoint as a libai_zoo checkpoint a dp × tp × pp run starts from
    (train.load_weight); return (where it was read from, the checkpoint directory)."""
    output_dir = check_output_dir(output_dir, overwrite)
    if not is_megatron_core(path, allow_numpy=allow_numpy):
        raise ValueError(f"{path} is a legacy Megatron-LM GPT checkpoint (language_model names): convert it with "
                         f"megatron-to-hf, then hf-to-zoo")
    model, source = read_megatron_core(path, vocab_size=vocab_size, dtype=_dtype(dtype), allow_numpy=allow_numpy)
    return source, write_zoo_checkpoint(model, output_dir, dp=dp, tp=tp, pp=pp, source=source.directory)


def hf_to_megatron(hf_dir: str | Path, output_dir: str | Path, *, make_vocab_size_divisible_by: int = 128,
                   dtype: torch.dtype | str | None = None, overwrite: bool = False) -> tuple[Path, nn.Module]:
    """Write a Hugging Face decoder directory (GPT-2, GPT-NeoX, Llama, Qwen2, Qwen3, Mistral, or any
    family Megatron-Core can express: `architecture_args`) as a Megatron-Core torch_dist
    checkpoint; its config.json rides along in common.pt, so megatron-to-hf gives it back."""
    hf_dir, output_dir = Path(hf_dir), check_output_dir(output_dir, overwrite)
    cls = zoo_class_for(read_config(hf_dir), source=str(hf_dir / "config.json"))
    architecture_args(_skeleton(cls, cls.load_config(hf_dir)))  # what Megatron-Core cannot express, before the weights
    model = cls.from_pretrained(hf_dir, dtype=dtype)
    extra = {"hf_config": json.loads((hf_dir / "config.json").read_text())}
    return write_megatron_core(model, output_dir, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                               extra=extra), model


def zoo_to_megatron(checkpoint: str | Path, output_dir: str | Path, *, make_vocab_size_divisible_by: int = 128,
                    dtype: torch.dtype | str | None = None, overwrite: bool = False) -> tuple[Path, nn.Module]:
    """Write a libai_zoo checkpoint (any layout; a run's output_dir means its newest) as a
    Megatron-Core torch_dist checkpoint, LoRA adapters merged into their weights."""
    checkpoint = resolve_checkpoint(checkpoint)
    output_dir = check_output_dir(output_dir, overwrite)
    model = load_checkpoint_model(checkpoint)
    merge_lora(model)
    if dtype is not None:
        model.to(_dtype(dtype))
    extra = {"hf_config": model.config.to_dict()}
    return write_megatron_core(model, output_dir, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                               extra=extra), model
