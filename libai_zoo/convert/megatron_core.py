"""Megatron-Core GPT models <-> libai_zoo, for the GPT family (learned positions: GPT-2; RoPE:
GPT-NeoX, sequential) and the Llama family (Llama, Qwen2).

    model, source = read_megatron_core("megatron_ckpt")      # torch_dist, or per-rank torch files
    write_megatron_core(model, "megatron_out")               # torch_dist + common.pt, `--load`-able

Megatron-Core's `GPTModel` names its tensors (with the layer norms as the Transformer Engine
layers hold them; Megatron-Core's local layers map theirs to these names when saving):

    embedding.word_embeddings.weight                     [padded vocab, h]   rows split over tp
    embedding.position_embeddings.weight                 [positions, h]      learned positions only
    decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight (, _bias)  the pre-attention norm
    decoder.layers.{i}.self_attention.linear_qkv.weight (, .bias)  per query group [its q heads, k, v]
    decoder.layers.{i}.self_attention.linear_proj.weight (, .bias) columns split over tp
    decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight (, _bias)  the pre-MLP norm
    decoder.layers.{i}.mlp.linear_fc1.weight (, .bias)   [gate; up] with SwiGLU (per rank in torch files)
    decoder.layers.{i}.mlp.linear_fc2.weight (, .bias)   columns split over tp
    decoder.final_layernorm.weight (, .bias)
    output_layer.weight                                  untied head only

The grouped `linear_qkv` is libai_zoo's fused `qkv` row for row, so each family's map
(`megatron_weight_map`) pairs the zoo's parameters with these names using the rules of the
Hugging Face maps (`libai_zoo.hf.rules`); Hugging Face names and layouts are the models' own
maps' business (`save_pretrained`, `from_pretrained`), never restated here.

The architecture comes from the run's `args` (`common.pt`, or the torch files' "args"), which
Megatron-LM saves with every checkpoint; `megatron_config` turns them into the zoo config and
checks them against the tensors, naming every problem in one error.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from torch import nn

from libai_zoo import models
from libai_zoo.hf import read_config
from libai_zoo.hf.rules import PaddedRows, Part, Same, WeightMap
from libai_zoo.layers import merge_lora
from libai_zoo.models.gpt_neox import rotary_fraction

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


def family_of(model: nn.Module) -> str:
    """"gpt" (learned positions: GPT-2), "gpt_rope" (GPT-NeoX) or "llama" (Llama, Qwen2)."""
    if isinstance(model, models.GPT2LMHeadModel):
        return "gpt"
    if isinstance(model, models.GPTNeoXForCausalLM):
        return "gpt_rope"
    if isinstance(model, models.LlamaForCausalLM):
        return "llama"
    raise ValueError(f"{type(model).__name__} has no Megatron-Core form here: GPT2LMHeadModel and GPTNeoXForCausalLM "
                     f"(GPT family) and LlamaForCausalLM (Llama family, Qwen2 included) are converted")


# family -> (the zoo's word embedding, layer stack, final norm; whether its norms and MLP have biases)
FAMILY_NAMES = {"gpt": ("transformer.wte", "transformer.h", "transformer.ln_f", True),
                "gpt_rope": ("gpt_neox.embed_in", "gpt_neox.layers", "gpt_neox.final_layer_norm", True),
                "llama": ("model.embed_tokens", "model.layers", "model.norm", False)}


def megatron_weight_map(model: nn.Module, padded_vocab: int) -> WeightMap:
    """The rules of a zoo model's parameters <- Megatron-Core names (per layer, global numbering)."""
    config, family = model.config, family_of(model)
    rules: list = []

    def pair(zoo: str, mcore: str, bias: bool) -> None:
        rules.append(Same(f"{zoo}.weight", f"{mcore}.weight"))
        if bias:
            rules.append(Same(f"{zoo}.bias", f"{mcore}.bias"))

    def norm(zoo: str, mcore: str, bias: bool) -> None:  # the fused norms: "layer_norm_weight"
        rules.append(Same(f"{zoo}.weight", f"{mcore}weight"))
        if bias:
            rules.append(Same(f"{zoo}.bias", f"{mcore}bias"))

    words, layers, final, gpt = FAMILY_NAMES[family]
    rules.append(PaddedRows(f"{words}.weight", "embedding.word_embeddings.weight", padded_vocab))
    if family == "gpt":
        rules.append(Same("transformer.wpe.weight", "embedding.position_embeddings.weight"))
    if gpt:
        qkv_b = out_b = getattr(config, "attention_bias", True)
        mlp_b = True
    else:
        qkv_b, out_b = models.llama.qkv_bias(config)
        mlp_b = getattr(config, "mlp_bias", False)
    for i in range(config.num_hidden_layers):
        z, m = f"{layers}.{i}.", f"decoder.layers.{i}."
        norm(z + "attn_norm", m + "self_attention.linear_qkv.layer_norm_", gpt)
        pair(z + "attn.qkv", m + "self_attention.linear_qkv", qkv_b)
        pair(z + "attn.out", m + "self_attention.linear_proj", out_b)
        norm(z + "mlp_norm", m + "mlp.linear_fc1.layer_norm_", gpt)
        if gpt:
            pair(z + "mlp.up", m + "mlp.linear_fc1", mlp_b)
        else:
            for index, part in enumerate(("gate", "up")):
                for suffix in ("weight", "bias") if mlp_b else ("weight",):
                    rules.append(Part(f"{z}mlp.{part}.{suffix}", f"{m}mlp.linear_fc1.{suffix}", index, 2))
        pair(z + "mlp.down", m + "mlp.linear_fc2", mlp_b)
    pair(final, "decoder.final_layernorm", gpt)
    if not config.tie_word_embeddings:
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
    refused = {"num_experts": lambda v: v not in (None, 0, 1), "qk_layernorm": bool, "squared_relu": bool,
               "multi_latent_attention": bool, "apply_residual_connection_post_layernorm": bool,
               "rotary_interleaved": bool, "mtp_num_layers": bool, "heterogeneous_layers_config_path": bool,
               "window_size": bool, "window_attn_skip_freq": bool, "qk_l2_norm": bool, "no_rope_freq": bool,
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
        if qkv_only:
            config = transformers.Qwen2Config(**kwargs)
        else:
            config = models.LlamaConfig(attention_bias=bias, mlp_bias=bias, **kwargs)
        cls = models.LlamaForCausalLM
    if _arg(args, "apply_layernorm_1p", False) and family == "llama":
        problems.append("args.apply_layernorm_1p = True with RMSNorm is not converted")
    problems += _tensor_problems(cls, config, tensors, padded)
    if problems:
        raise ValueError(f"{where} ({family} family, from its args) cannot be converted; {len(problems)} "
                         f"problem(s):\n  " + "\n  ".join(problems))
    return cls, config, padded


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
    config, family = model.config, family_of(model)
    dtype = next(model.parameters()).dtype
    common = dict(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, use_mcore_models=True, ckpt_format="torch_dist",
        transformer_impl="transformer_engine", padded_vocab_size=padded_vocab, vocab_size=config.vocab_size,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, apply_layernorm_1p=False, qk_layernorm=False, squared_relu=False, num_experts=None,
        bias_gelu_fusion=False, bias_swiglu_fusion=False, openai_gelu=False, rotary_interleaved=False, iteration=0,
        consumed_train_samples=0, consumed_valid_samples=0, no_save_optim=True, no_save_rng=True,
        init_method_std=config.initializer_range, tokenizer_type="HuggingFaceTokenizer", rotary_base=10000,
        rotary_percent=1.0, use_rope_scaling=False, rope_scaling_factor=8.0, rotary_seq_len_interpolation_factor=None)
    if family in ("gpt", "gpt_rope"):
        act = getattr(config, "activation_function", getattr(config, "hidden_act", None))
        if act not in ("gelu_new", "gelu", "gelu_pytorch_tanh"):
            raise ValueError(f"activation {act!r} has no Megatron-Core form (GELU: erf, or tanh through "
                             f"--bias-gelu-fusion)")
        if not getattr(config, "attention_bias", True):
            raise ValueError("attention_bias=False with MLP biases: Megatron-LM's --add-bias-linear sets both")
        hidden, heads = config.hidden_size, config.num_attention_heads
        specific = dict(
            num_layers=config.num_hidden_layers, hidden_size=hidden, num_attention_heads=heads,
            kv_channels=hidden // heads, group_query_attention=False, num_query_groups=heads,
            normalization="LayerNorm", swiglu=False, bias_gelu_fusion=act != "gelu", add_bias_linear=True,
            add_qkv_bias=True, untie_embeddings_and_output_weights=not config.tie_word_embeddings)
        if family == "gpt":
            specific.update(
                ffn_hidden_size=config.n_inner or 4 * hidden, max_position_embeddings=config.n_positions,
                seq_length=config.n_positions, position_embedding_type="learned_absolute",
                add_position_embedding=True, norm_epsilon=config.layer_norm_epsilon,
                hidden_dropout=config.resid_pdrop, attention_dropout=config.attn_pdrop)
        else:
            specific.update(
                ffn_hidden_size=config.intermediate_size, max_position_embeddings=config.max_position_embeddings,
                seq_length=config.max_position_embeddings, position_embedding_type="rope",
                add_position_embedding=False, norm_epsilon=config.layer_norm_eps,
                rotary_percent=rotary_fraction(config), hidden_dropout=config.hidden_dropout,
                attention_dropout=config.attention_dropout, **_rope_args(config))
    else:
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r}: Megatron-LM's --swiglu is SiLU-gated")
        qkv_b, out_b = models.llama.qkv_bias(config)
        mlp_b = getattr(config, "mlp_bias", False)
        if not (qkv_b == out_b == mlp_b or (qkv_b and not out_b and not mlp_b)):
            raise ValueError(f"biases on q/k/v {qkv_b}, o {out_b}, MLP {mlp_b}: Megatron-LM has all of them "
                             f"(--add-bias-linear), none, or q/k/v only (--add-qkv-bias)")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        specific = dict(
            num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
            ffn_hidden_size=config.intermediate_size, num_attention_heads=config.num_attention_heads,
            kv_channels=head_dim, group_query_attention=config.num_key_value_heads != config.num_attention_heads,
            num_query_groups=config.num_key_value_heads, max_position_embeddings=config.max_position_embeddings,
            seq_length=config.max_position_embeddings, position_embedding_type="rope", normalization="RMSNorm",
            norm_epsilon=config.rms_norm_eps, swiglu=True, add_bias_linear=out_b, add_position_embedding=False,
            add_qkv_bias=qkv_b, untie_embeddings_and_output_weights=not config.tie_word_embeddings,
            hidden_dropout=0.0, attention_dropout=config.attention_dropout, **_rope_args(config))
    return argparse.Namespace(**{**common, **specific})


def _rope_args(config) -> dict:
    """A Hugging Face config's RoPE base and scaling as Megatron-LM's args."""
    base, scaling = models.llama.rope_settings(config)
    rope = {"rotary_base": int(base) if float(base).is_integer() else base}
    if scaling is not None and scaling["rope_type"] == "llama3":
        others = {key: scaling.get(key) for key in LLAMA3_SCALING if scaling.get(key) != LLAMA3_SCALING[key]}
        if others:
            raise ValueError(f"llama3 RoPE scaling with {others}: Megatron-Core fixes low_freq_factor 1, "
                             f"high_freq_factor 4 and original_max_position_embeddings 8192")
        rope.update(use_rope_scaling=True, rope_scaling_factor=scaling["factor"])
    elif scaling is not None:
        rope.update(rotary_seq_len_interpolation_factor=scaling["factor"])
    return rope


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
    tensors = {name: t for name, t in tensors.items() if not name.endswith("_extra_state")}
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
        for rule in megatron_weight_map(model, padded).rules:
            parameters[rule.zoo].copy_(rule.load(read, None, parameters[rule.zoo].shape))
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval(), source


# ----------------------------------------------------------------------------- writing


def padded_vocabulary(vocab: int, multiple: int) -> int:
    """Megatron-LM's padded vocabulary: `vocab` rounded up to a multiple of
    make_vocab_size_divisible_by × tp (pass their product)."""
    return math.ceil(vocab / multiple) * multiple


def write_megatron_core(model: nn.Module, output_dir: str | Path, *, make_vocab_size_divisible_by: int = 128,
                        extra: dict | None = None) -> Path:
    """Write a zoo GPT-2 or Llama model as a Megatron-Core torch_dist checkpoint that Megatron-LM
    loads with `--load OUT_DIR` (the `release` iteration: weights only, no optimizer or RNG
    state); return the iteration directory. `extra` adds keys to common.pt."""
    output_dir = Path(output_dir)
    padded = padded_vocabulary(model.config.vocab_size, make_vocab_size_divisible_by)
    args = megatron_args(model, padded, make_vocab_size_divisible_by)
    parameters = dict(model.named_parameters(remove_duplicate=False))
    tensors: dict[str, list[torch.Tensor]] = {}
    with torch.no_grad():
        for rule in megatron_weight_map(model, padded).rules:
            for name, tensor in rule.save(parameters[rule.zoo].detach()).items():
                tensors.setdefault(name, []).append(tensor)
    joined = {name: torch.cat(parts) if len(parts) > 1 else parts[0].contiguous() for name, parts in tensors.items()}
    directory = output_dir / RELEASE
    common = {"args": args, "checkpoint_version": 3.0, "iteration": 0, **(extra or {})}
    torch_dist.write_checkpoint(directory, joined, common)
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
    """Write a Hugging Face GPT-2 or Llama (Qwen2) directory as a Megatron-Core torch_dist
    checkpoint; its config.json rides along in common.pt, so megatron-to-hf gives it back."""
    hf_dir, output_dir = Path(hf_dir), check_output_dir(output_dir, overwrite)
    cls = zoo_class_for(read_config(hf_dir), source=str(hf_dir / "config.json"))
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
