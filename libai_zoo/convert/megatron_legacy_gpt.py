"""Legacy Megatron-LM GPT checkpoints (`language_model` names, per-rank `torch` files) -> Hugging Face GPT-2.

The files are found and read by `megatron_files.py`. The shards are joined into whole tensors
under Megatron-LM's names, renamed to libai_zoo's GPT-2 parameters (`LAYER_TENSORS`,
`OTHER_TENSORS`), loaded into a `GPT2LMHeadModel` and written with its `save_pretrained`, so the
Hugging Face names and layouts come from the one GPT-2 weight map.

The model state of each file:

    "model": {"language_model": {
                  "embedding": {"word_embeddings": {"weight"},              first stage only
                                "position_embeddings": {"weight"}},
                  "encoder" (older: "transformer"): {"layers.{i}.<tensor>", ...,
                                                     "final_layernorm.weight/bias" (last stage)},
                  "output_layer": {"weight"}},                              untied head, last stage
              "word_embeddings_for_head": {"weight"}}                       tied head, last stage, pp > 1

Layer indices are local to a pipeline stage (stage p's layer 0 is the first it holds); stage p's
global offset is the number of layers in stages 0..p-1. Tensor-parallel splits:

    word_embeddings, output_layer              rows (the padded vocabulary)       -> concatenated
    self_attention.query_key_value             rows (column parallel, whole heads)-> see below
    mlp.dense_h_to_4h (weight and bias)        rows (column parallel)             -> concatenated
    self_attention.dense, mlp.dense_4h_to_h    columns (row parallel); bias whole -> concatenated
    norms, position embeddings, row biases     replicated                         -> rank 0's

Fused QKV: each rank holds the rows of its heads. From checkpoint_version 2 on, the rows are
grouped per head, [head][q, k, v][head_dim]; version 1.0 stored [head][head_dim][q, k, v] and
version 0 [q, k, v][head][head_dim] (both per rank), and are reordered the way Megatron-LM's
loader does. Per head [q, k, v] is the layout of libai_zoo's fused `qkv` (grouped per KV head,
and GPT-2 has one head per group), so the joined rows are the parameter as they are.

GELU: the tanh approximation ("gelu_new") when args.openai_gelu or the fused bias-GELU kernel
(Megatron-LM's default) computed it, exact erf GELU ("gelu") otherwise. args.apply_layernorm_1p
(LayerNorm1P stores gamma - 1) adds the 1 back.
"""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

import torch

from libai_zoo import models

from .megatron_files import LAYER_NAME, MegatronCheckpoint, find_checkpoint, flatten

logger = logging.getLogger("libai_zoo")

# Megatron-LM's name of a tensor in a layer -> (how its tensor-parallel shards combine, the name of the
# libai_zoo GPT-2 parameter in layer i it becomes).
LAYER_TENSORS = {
    "input_layernorm.weight": ("replicated", "attn_norm.weight"),
    "input_layernorm.bias": ("replicated", "attn_norm.bias"),
    "self_attention.query_key_value.weight": ("qkv", "attn.qkv.weight"),
    "self_attention.query_key_value.bias": ("qkv", "attn.qkv.bias"),
    "self_attention.dense.weight": ("columns", "attn.out.weight"),
    "self_attention.dense.bias": ("replicated", "attn.out.bias"),
    "post_attention_layernorm.weight": ("replicated", "mlp_norm.weight"),
    "post_attention_layernorm.bias": ("replicated", "mlp_norm.bias"),
    "mlp.dense_h_to_4h.weight": ("rows", "mlp.up.weight"),
    "mlp.dense_h_to_4h.bias": ("rows", "mlp.up.bias"),
    "mlp.dense_4h_to_h.weight": ("columns", "mlp.down.weight"),
    "mlp.dense_4h_to_h.bias": ("replicated", "mlp.down.bias"),
}
# The other tensors: (how the shards combine, the libai_zoo name; None: a copy of another tensor).
OTHER_TENSORS = {
    "embedding.word_embeddings.weight": ("rows", "transformer.wte.weight"),
    "embedding.position_embeddings.weight": ("replicated", "transformer.wpe.weight"),
    "final_layernorm.weight": ("replicated", "transformer.ln_f.weight"),
    "final_layernorm.bias": ("replicated", "transformer.ln_f.bias"),
    "output_layer.weight": ("rows", "lm_head.weight"),
    "word_embeddings_for_head.weight": ("rows", None),
}
NORMS = ("attn_norm.weight", "mlp_norm.weight", "transformer.ln_f.weight")


def stage_tensors(state: dict, file: Path) -> dict[str, torch.Tensor]:
    """One shard's model tensors under uniform names: "embedding.*", "layers.{local i}.*",
    "final_layernorm.*", "output_layer.weight", "word_embeddings_for_head.weight"."""
    model = state.get("model")
    if not isinstance(model, dict):
        raise ValueError(f"{file} has no 'model' state dict (keys: {', '.join(map(str, state)) or 'none'}): it is not "
                         f"a Megatron-LM model checkpoint file")
    language_model = model.get("language_model")
    if not isinstance(language_model, dict):
        raise ValueError(f"{file}: model holds {', '.join(list(map(str, model))[:5])}... but no 'language_model': "
                         f"only the legacy GPT layout (model.language_model.embedding/encoder) is read, not "
                         f"Megatron-Core's (decoder.layers...)")
    tensors = {}
    for key, value in language_model.items():
        sub = flatten(value) if isinstance(value, dict) else {}
        if key in ("encoder", "transformer"):
            tensors.update(sub)
        else:
            tensors.update({f"{key}.{name}": tensor for name, tensor in sub.items()})
    head = model.get("word_embeddings_for_head")
    if isinstance(head, dict) and isinstance(head.get("weight"), torch.Tensor):
        tensors["word_embeddings_for_head.weight"] = head["weight"]
    # Megatron-LM before mid-2021 named the attention block "attention".
    return {re.sub(r"^(layers\.\d+\.)attention\.", r"\1self_attention.", name): t for name, t in tensors.items()}


def _qkv_per_head(shard: torch.Tensor, heads: int, head_dim: int, version: float, file: Path) -> torch.Tensor:
    """One rank's fused QKV rows as [its heads, 3 (q, k, v), head_dim, ...]."""
    rest = shard.shape[1:]
    if shard.shape[0] != 3 * heads * head_dim:
        raise ValueError(f"{file}: query_key_value has {shard.shape[0]} rows, expected 3 × {heads} heads × "
                         f"{head_dim} = {3 * heads * head_dim}: num_attention_heads or tp is wrong")
    if version >= 2.0:
        return shard.reshape(heads, 3, head_dim, *rest)
    if version == 1.0:
        return shard.reshape(heads, head_dim, 3, *rest).transpose(1, 2)
    if version == 0:
        return shard.reshape(3, heads, head_dim, *rest).transpose(0, 1)
    raise ValueError(f"{file}: checkpoint_version {version} is unknown (0, 1.0, 2.0 and 3.0 are read)")


def merge_tensor_parallel(checkpoint: MegatronCheckpoint, pp_rank: int, *, heads: int,
                          head_dim: int) -> dict[str, torch.Tensor]:
    """The tensors of pipeline stage `pp_rank` with their tensor-parallel shards joined (QKV as
    [heads, 3, head_dim, ...]); names as `stage_tensors` gives them."""
    files = [checkpoint.files[t, pp_rank] for t in range(checkpoint.tp)]
    shards = [stage_tensors(checkpoint.load(t, pp_rank), files[t]) for t in range(checkpoint.tp)]
    names = set(shards[0])
    for file, shard in zip(files[1:], shards[1:]):
        if set(shard) != names:
            raise ValueError(f"{file} and {files[0]} hold different tensors ({sorted(set(shard) ^ names)[:6]}): "
                             f"the shards come from different checkpoints")
    unknown = sorted(n for n in names if (LAYER_NAME.match(n) and LAYER_NAME.match(n)[2] not in LAYER_TENSORS)
                     or (not LAYER_NAME.match(n) and n not in OTHER_TENSORS))
    if unknown:
        raise ValueError(f"{files[0]} holds tensors a GPT-2 model does not have: {', '.join(unknown[:8])}; this "
                         f"converter reads Megatron-LM GPT checkpoints with learned positions, LayerNorm, biases and "
                         f"a GELU MLP")
    if heads % checkpoint.tp:
        raise ValueError(f"num_attention_heads = {heads} is not divisible by tp = {checkpoint.tp}")
    merged = {}
    differing = []
    for name in sorted(names):
        parts = [shard[name] for shard in shards]
        shapes = {tuple(p.shape) for p in parts}
        if len(shapes) != 1:
            raise ValueError(f"{name} has different shapes in the tensor-parallel shards of stage {pp_rank} "
                             f"({', '.join(f'{f.parent.name}: {tuple(p.shape)}' for f, p in zip(files, parts))})")
        layer = LAYER_NAME.match(name)
        kind = (LAYER_TENSORS[layer[2]] if layer else OTHER_TENSORS[name])[0]
        if kind == "replicated":
            merged[name] = parts[0]
            if any(not torch.equal(parts[0], p) for p in parts[1:]):
                differing.append(name)
        elif kind == "rows":
            merged[name] = torch.cat(parts, dim=0)
        elif kind == "columns":
            merged[name] = torch.cat(parts, dim=1)
        else:
            local_heads = heads // checkpoint.tp
            merged[name] = torch.cat([_qkv_per_head(p, local_heads, head_dim, checkpoint.checkpoint_version, f)
                                      for p, f in zip(parts, files)])
    if differing:
        logger.warning("stage %d: %d replicated tensor(s) differ between tensor-parallel ranks (rank 0's kept): %s",
                       pp_rank, len(differing), ", ".join(differing[:5]))
    return merged


def activation(args: argparse.Namespace | None) -> str:
    """Megatron-LM's GELU as Hugging Face names it: the tanh approximation when --openai-gelu or
    the fused bias-GELU kernel (on by default) computed it, exact erf GELU otherwise."""
    if args is None:
        return "gelu_new"
    for flag in ("swiglu", "squared_relu"):
        if getattr(args, flag, False):
            raise ValueError(f"args.{flag} = True; GPT-2 has a GELU MLP")
    if getattr(args, "openai_gelu", False):
        return "gelu_new"
    if getattr(args, "bias_gelu_fusion", False) and getattr(args, "add_bias_linear", True):
        return "gelu_new"
    return "gelu"


def _check_args(checkpoint: MegatronCheckpoint) -> None:
    """Refuse architectures that GPT-2 cannot express, naming the argument."""
    bad = {"position_embedding_type": lambda v: v not in (None, "learned_absolute"),
           "normalization": lambda v: v not in (None, "LayerNorm"),
           "apply_residual_connection_post_layernorm": bool,
           "group_query_attention": bool, "num_experts": lambda v: v not in (None, 0, 1),
           "add_bias_linear": lambda v: v is False}
    problems = [f"args.{name} = {checkpoint.arg(name)!r}" for name, is_bad in bad.items()
                if checkpoint.args is not None and hasattr(checkpoint.args, name) and is_bad(checkpoint.arg(name))]
    if problems:
        raise ValueError(f"{checkpoint.directory} is not a GPT-2-style model ({'; '.join(problems)}): this converter "
                         f"writes Hugging Face GPT-2 (learned positions, pre-LayerNorm, biases, GELU, no GQA/MoE)")


def _geometry(checkpoint: MegatronCheckpoint, num_attention_heads: int | None) -> tuple[int, int, int]:
    """(heads, hidden size, head dim) from the run's args (or the first norm when it saved none)."""
    heads = num_attention_heads or checkpoint.arg("num_attention_heads")
    if heads is None:
        raise ValueError(f"{checkpoint.directory}: the files hold no args, so the number of attention heads is "
                         f"unknown: pass --num-attention-heads")
    hidden = checkpoint.arg("hidden_size")
    if hidden is None:  # no args: read it off the first norm
        probe = stage_tensors(checkpoint.load(0, 0), checkpoint.files[0, 0])
        hidden = next(t.shape[-1] for n, t in probe.items() if n.endswith("layernorm.weight"))
    head_dim = checkpoint.arg("kv_channels") or hidden // heads
    if head_dim * heads != hidden:
        raise ValueError(f"{checkpoint.directory}: {heads} heads × kv_channels {head_dim} != hidden_size {hidden}: "
                         f"GPT-2 needs head_dim = hidden_size / heads")
    return heads, hidden, head_dim


def _zoo_names(checkpoint: MegatronCheckpoint, stages: list[dict[str, torch.Tensor]]):
    """(the stages' tensors under libai_zoo GPT-2 names with global layer numbers, the last stage's
    copy of the word embeddings or None, the number of layers), after checking that each tensor is
    on the stage Megatron-LM keeps it on and that none is missing."""
    state: dict[str, torch.Tensor] = {}
    last = checkpoint.pp - 1
    home = {"embedding": 0, "final_layernorm": last, "output_layer": last, "word_embeddings_for_head": last}
    head_copy, offset = None, 0
    for p, stage in enumerate(stages):
        local = sorted({int(LAYER_NAME.match(n)[1]) for n in stage if LAYER_NAME.match(n)})
        if local != list(range(len(local))):
            raise ValueError(f"{checkpoint.files[0, p].parent}: layer indices {local} are not 0..{len(local) - 1}: "
                             f"pipeline stages hold consecutive layers numbered from 0")
        for name, tensor in stage.items():
            match = LAYER_NAME.match(name)
            if match:
                state[f"transformer.h.{offset + int(match[1])}.{LAYER_TENSORS[match[2]][1]}"] = tensor
            elif home[name.split(".")[0]] != p:
                raise ValueError(f"{checkpoint.files[0, p]} holds {name}, which Megatron-LM keeps on pipeline stage "
                                 f"{home[name.split('.')[0]]}: the shard directories are mislabelled")
            elif OTHER_TENSORS[name][1] is None:
                head_copy = tensor
            else:
                state[OTHER_TENSORS[name][1]] = tensor
        offset += len(local)
    num_layers = checkpoint.arg("num_layers", offset)
    if offset != num_layers:
        raise ValueError(f"{checkpoint.directory}: the stages hold {offset} layers, args.num_layers = {num_layers}")
    required = {f"transformer.h.{i}.{zoo}" for i in range(num_layers) for _, zoo in LAYER_TENSORS.values()}
    required |= {zoo for _, zoo in OTHER_TENSORS.values() if zoo not in (None, "lm_head.weight")}
    missing = sorted(required - set(state))
    if missing:
        raise ValueError(f"{checkpoint.directory} lacks {len(missing)} tensor(s) of a GPT-2 model (libai_zoo names): "
                         f"{', '.join(missing[:8])}")
    return state, head_copy, num_layers


def _vocabulary(checkpoint: MegatronCheckpoint, words: torch.Tensor, head_copy: torch.Tensor | None, hidden: int,
                vocab_size: int | None) -> int:
    """The vocabulary to keep of the padded word embeddings, after checking them."""
    padded = words.shape[0]
    if checkpoint.arg("padded_vocab_size") not in (None, padded):
        raise ValueError(f"{checkpoint.directory}: the word embeddings have {padded} rows, args.padded_vocab_size = "
                         f"{checkpoint.arg('padded_vocab_size')}")
    vocab = vocab_size or padded
    if not 0 < vocab <= padded:
        raise ValueError(f"--vocab-size {vocab} must be between 1 and the padded vocabulary {padded}")
    if head_copy is not None and not torch.equal(head_copy, words):
        logger.warning("the last stage's copy of the word embeddings differs from the first stage's; the first "
                       "stage's is kept (the head is tied to it)")
    if words.shape[1] != hidden:
        raise ValueError(f"{checkpoint.directory}: the word embeddings are {words.shape[1]} wide, "
                         f"hidden_size = {hidden}")
    return vocab


def megatron_to_zoo_state_dict(checkpoint: MegatronCheckpoint, *, vocab_size: int | None = None,
                               num_attention_heads: int | None = None):
    """(state dict of libai_zoo's GPT2LMHeadModel, its GPT2Config) for a Megatron-LM GPT checkpoint.

    ``vocab_size`` keeps the first rows of the padded vocabulary (default: all of them, as
    args.padded_vocab_size); ``num_attention_heads`` is needed when the files hold no args."""
    _check_args(checkpoint)
    heads, hidden, head_dim = _geometry(checkpoint, num_attention_heads)
    stages = [merge_tensor_parallel(checkpoint, p, heads=heads, head_dim=head_dim) for p in range(checkpoint.pp)]
    state, head_copy, num_layers = _zoo_names(checkpoint, stages)
    vocab = _vocabulary(checkpoint, state["transformer.wte.weight"], head_copy, hidden, vocab_size)
    untied = "lm_head.weight" in state
    state["transformer.wte.weight"] = state["transformer.wte.weight"][:vocab]
    state["lm_head.weight"] = state["lm_head.weight"][:vocab] if untied else state["transformer.wte.weight"]
    for i in range(num_layers):  # attention rows: [heads, (q, k, v), head_dim] is the fused qkv
        for suffix in ("weight", "bias"):
            name = f"transformer.h.{i}.attn.qkv.{suffix}"
            state[name] = state[name].reshape(3 * hidden, *state[name].shape[3:])
    if checkpoint.arg("apply_layernorm_1p", False):  # LayerNorm1P stores gamma - 1
        state.update({name: tensor + 1.0 for name, tensor in state.items() if name.endswith(NORMS)})
    eos = 50256 if vocab > 50256 else None  # GPT-2's <|endoftext|>, when the vocabulary has it
    config = models.GPT2Config(
        vocab_size=vocab, n_positions=state["transformer.wpe.weight"].shape[0], n_embd=hidden, n_layer=num_layers,
        n_head=heads, n_inner=state["transformer.h.0.mlp.up.weight"].shape[0],
        activation_function=activation(checkpoint.args), layer_norm_epsilon=checkpoint.arg("layernorm_epsilon", 1e-5),
        resid_pdrop=checkpoint.arg("hidden_dropout", 0.1), embd_pdrop=checkpoint.arg("hidden_dropout", 0.1),
        attn_pdrop=checkpoint.arg("attention_dropout", 0.1), tie_word_embeddings=not untied,
        bos_token_id=eos, eos_token_id=eos)
    return state, config


def legacy_to_hf(path: str | Path, output_dir: str | Path, *, vocab_size: int | None = None,
                   num_attention_heads: int | None = None, dtype: torch.dtype | str | None = None,
                   max_shard_size: int | str = "5GB", allow_numpy: bool = False):
    """Convert the legacy Megatron-LM GPT checkpoint at `path` (its root, or an iteration directory)
    into a Hugging Face GPT-2 directory; return (the checkpoint found, the GPT2Config written)."""
    checkpoint = find_checkpoint(path, allow_numpy=allow_numpy)
    state, config = megatron_to_zoo_state_dict(checkpoint, vocab_size=vocab_size,
                                               num_attention_heads=num_attention_heads)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype or state["transformer.wte.weight"].dtype
    config.dtype = str(dtype).removeprefix("torch.")
    with torch.device("meta"):
        model = models.GPT2LMHeadModel(config).to(dtype)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.load_state_dict(state)  # strict: every parameter, and nothing else
    model.save_pretrained(output_dir, max_shard_size=max_shard_size)
    logger.info("wrote %s from %s (tp = %d, pp = %d)", output_dir, checkpoint.directory, checkpoint.tp, checkpoint.pp)
    return checkpoint, config
