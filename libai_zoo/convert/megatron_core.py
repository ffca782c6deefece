"""Megatron-Core GPT models <-> libai_zoo, for the GPT family (learned positions: GPT-2; RoPE:
GPT-NeoX, sequential) and the Llama family (Llama, Qwen2; Qwen3 with --qk-layernorm; Mistral,
and Qwen2/3 `layer_types`, with --window-size), and Mixtures of Experts (--num-experts: Mixtral;
Qwen3-MoE with --qk-layernorm).

    model, source = read_megatron_core("megatron_ckpt")      # torch_dist, or per-rank torch files
    write_megatron_core(model, "megatron_out")               # torch_dist + common.pt, `--load`-able

The work is split by job: `megatron_core_names.py` pairs the zoo's parameters with Megatron-Core's
tensor names (`megatron_weight_map`), `megatron_core_config.py` turns a run's args into the zoo
config (`megatron_config`), `megatron_core_args.py` a zoo decoder into the args
(`architecture_args`, `megatron_args`); the files are read and written through
`megatron_files.py` (per-rank torch files) and `torch_dist.py`. This module composes them: it
reads and writes checkpoints and holds the commands.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from libai_zoo import models
from libai_zoo.hf import read_config
from libai_zoo.layers import merge_lora

from . import torch_dist
from .hf_zoo import check_output_dir, load_checkpoint_model, resolve_checkpoint, write_zoo_checkpoint, zoo_class_for
from .megatron_core_args import architecture_args, megatron_args
from .megatron_core_config import megatron_config, run_arg, skeleton
from .megatron_core_names import canonical_name, check_covered, megatron_weight_map, moe_norm_names
from .megatron_files import LAYER_NAME, TRACKER, find_checkpoint, flatten, iteration_directory
from .megatron_legacy_gpt import legacy_to_hf

logger = logging.getLogger("libai_zoo")

RELEASE = "release"


@dataclass
class MegatronSource:
    """Where a Megatron-Core checkpoint was read from, and how."""

    directory: Path
    format: str                 # "torch_dist" or "torch"
    args: argparse.Namespace
    tp: int = 1
    pp: int = 1


# ----------------------------------------------------------------------------- reading


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
    if run_arg(checkpoint.args, "num_experts"):
        raise ValueError(f"{checkpoint.directory}: per-rank torch files of a Mixture of Experts (args.num_experts = "
                         f"{checkpoint.args.num_experts}) are not read; save it as torch_dist (Megatron-LM's "
                         f"--ckpt-convert-format torch_dist) and convert that")
    gated = bool(run_arg(checkpoint.args, "swiglu", False))
    untied = bool(run_arg(checkpoint.args, "untie_embeddings_and_output_weights", False))
    tensors: dict[str, torch.Tensor] = {}
    offset, differing = 0, []
    for p in range(checkpoint.pp):
        shards = []
        for t in range(checkpoint.tp):
            model = checkpoint.load(t, p).get("model")
            if not isinstance(model, dict):
                raise ValueError(f"{checkpoint.files[t, p]} has no 'model' state dict: it is not a Megatron-LM "
                                 f"model checkpoint file")
            shards.append({canonical_name(name): tensor for name, tensor in flatten(model).items()})
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
        ours, theirs = ({key: value for key, value in vars(megatron_args(skeleton(cls, c), padded, 1)).items()
                         if key not in ignored} for c in (derived, candidate))
    except ValueError:  # the kept config has no Megatron form: it is not this checkpoint's
        return derived
    if ours != theirs:
        logger.info("common.pt keeps a Hugging Face config that differs from the args (another vocabulary size, or "
                    "the model changed in Megatron-LM); the config is built from the args")
        return derived
    return candidate

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
        source = MegatronSource(directory, "torch_dist", args, run_arg(args, "tensor_model_parallel_size", 1),
                                run_arg(args, "pipeline_model_parallel_size", 1))
        tensors = torch_dist.read_tensors(directory)
    else:
        source, tensors = _read_torch_files(directory, allow_numpy)
    tensors = moe_norm_names({name: t for name, t in tensors.items() if not name.endswith("_extra_state")})
    if run_arg(source.args, "apply_layernorm_1p", False):  # LayerNorm1P stores gamma - 1
        tensors = {name: t + 1.0 if name.endswith(("layer_norm_weight", "final_layernorm.weight")) else t
                   for name, t in tensors.items()}
    cls, config, padded = megatron_config(source.args, tensors, vocab_size=vocab_size, where=str(directory))
    if source.format == "torch_dist":
        config = _stored_config(config, common.get("hf_config"), padded)
    dtype = dtype or tensors["embedding.word_embeddings.weight"].dtype
    config.dtype = str(dtype).removeprefix("torch.")
    model = skeleton(cls, config).to(dtype)
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
    check_covered(model, rules)
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
    check_covered(model, rules)
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
    architecture_args(skeleton(cls, cls.load_config(hf_dir)))  # what Megatron-Core cannot express, before the weights
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
