"""Hugging Face directories <-> libai_zoo training checkpoints (the work behind `tools/convert`).

    hf_to_zoo("hf_dir", "out", dp=2, tp=2, pp=1)   # out/model_0000000 + last_checkpoint + config.yaml
    zoo_to_hf("output/run", "hf_out")             # the newest checkpoint of a run, any layout

A libai_zoo checkpoint is a torch.distributed.checkpoint (DCP) directory: tensors are stored with
their global shapes and each rank of a later run reads only its own slices. The checkpoint is
therefore the same whatever layout will read it, and the conversion runs in one process; the
target layout (dp, tp, pp) is only checked against the model up front, so that a bad layout fails
here rather than after a large run has started, and recorded in config.yaml.

    out/
      model_0000000/       .metadata + __0_0.distcp: {"model": <the model's state dict>}, as the
                           trainer's Checkpointer writes it (train.load_weight=out/model_0000000)
      last_checkpoint      "model_0000000"
      config.yaml          model (LazyCall of the libai_zoo class and its config), dist (the target
                           layout), conversion (source); `export_to_hf` rebuilds the model from it
      hf_config.json       the source's config.json, unchanged (not named config.json, which would
                           make the directory look like a Hugging Face one)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from pathlib import Path

import torch
from torch import nn

from .checkpointer import POINTER

logger = logging.getLogger("libai_zoo")

FIRST_CHECKPOINT = "model_0000000"
HF_CONFIG = "hf_config.json"

# model_type -> {architecture in config.json -> libai_zoo class}, and the class used when
# config.json names no architecture. A task model loads a bare body's checkpoint only when its
# head is tied or absent, so the default is the class that loads any checkpoint of that type.
ARCHITECTURES = {
    "gpt2": ({"GPT2LMHeadModel": "GPT2LMHeadModel", "GPT2Model": "GPT2Model"}, "GPT2LMHeadModel"),
    "llama": ({"LlamaForCausalLM": "LlamaForCausalLM", "LlamaModel": "LlamaModel"}, "LlamaForCausalLM"),
    "qwen2": ({"Qwen2ForCausalLM": "LlamaForCausalLM", "Qwen2Model": "LlamaModel"}, "LlamaForCausalLM"),
    "bert": ({"BertForMaskedLM": "BertForMaskedLM", "BertForPreTraining": "BertForMaskedLM",
              "BertForSequenceClassification": "BertForSequenceClassification", "BertModel": "BertModel"},
             "BertModel"),
    "vit": ({"ViTForImageClassification": "ViTForImageClassification", "ViTModel": "ViTModel"}, "ViTModel"),
}


def read_hf_config(hf_dir: str | Path) -> dict:
    """config.json of a Hugging Face model directory, with errors that say what the directory lacks."""
    hf_dir = Path(hf_dir)
    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        what = "does not exist" if not hf_dir.exists() else "has no config.json"
        raise FileNotFoundError(f"{hf_dir} {what}: hf-to-zoo reads a Hugging Face model directory (config.json and "
                                f"model.safetensors, or shards with model.safetensors.index.json)")
    return json.loads(config_file.read_text())


def zoo_class_for(config: dict, model_class: str | None = None, *, source: str = "config.json") -> type[nn.Module]:
    """The libai_zoo model class for a Hugging Face config: `model_class` if given (a name in
    libai_zoo.models), else from model_type and architectures."""
    from libai_zoo import models

    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{source}: model_type {model_type!r} has no libai_zoo model; supported: "
                         f"{', '.join(sorted(ARCHITECTURES))}")
    by_architecture, default = ARCHITECTURES[model_type]
    if model_class is None:
        names = config.get("architectures") or []
        known = [by_architecture[name] for name in names if name in by_architecture]
        if names and not known:
            raise ValueError(f"{source}: architectures {names} have no libai_zoo model for model_type {model_type!r} "
                             f"(known: {', '.join(by_architecture)}); pass --model-class with one of "
                             f"{', '.join(sorted(set(by_architecture.values())))}")
        model_class = known[0] if known else default
    choices = sorted(set(by_architecture.values()))
    if model_class not in choices:
        raise ValueError(f"--model-class {model_class!r} does not load a {model_type!r} model: use one of "
                         f"{', '.join(choices)}")
    return getattr(models, model_class)


def check_layout(model: nn.Module, dp: int = 1, tp: int = 1, pp: int = 1) -> list[str]:
    """Why `model` cannot be trained at dp × tp × pp ([] when it can), checked on the model itself
    (it may live on the meta device): what each parallel layer's `shard_` needs divisible by tp,
    and what a pipeline needs."""
    from libai_zoo.layers import MLP, Attention, Linear, LMHead, VocabEmbedding

    problems = []
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp)):
        if not isinstance(value, int) or value < 1:
            problems.append(f"--{name} {value} is not a positive integer")
    if problems:
        return problems

    def need(value: int, what: str, fix: str) -> None:
        if value % tp:
            problem = f"{what} = {value} is not divisible by tp = {tp}: {fix}"
            if problem not in problems:
                problems.append(problem)

    if tp > 1:
        inside_blocks = {id(m) for block in model.modules() if isinstance(block, Attention | MLP)
                         for m in block.modules() if m is not block}
        for module in model.modules():
            if isinstance(module, Attention):
                need(module.num_heads, "attention heads", "choose a tp that divides the number of heads")
                if module.num_kv_heads != module.num_heads:
                    need(module.num_kv_heads, "key/value heads", "choose a tp that divides the number of KV heads")
            elif isinstance(module, MLP):
                need(module.ffn_hidden_size, "MLP hidden size", "choose a tp that divides the intermediate size")
            elif isinstance(module, VocabEmbedding) or isinstance(module, LMHead):
                vocab = module.num_embeddings if isinstance(module, VocabEmbedding) else module.out_features
                need(vocab, "vocabulary size", f"pad the vocabulary to a multiple of tp (e.g. {-(-vocab // tp) * tp}) "
                                               f"before converting, or lower tp")
            elif isinstance(module, Linear) and id(module) not in inside_blocks and module.parallel != "data":
                features = module.out_features if module.parallel == "col" else module.in_features
                need(features, f"{'output' if module.parallel == 'col' else 'input'} features of the "
                               f"{module.parallel}-parallel {type(module).__name__}", "lower tp")
    if pp > 1:
        prefix = getattr(model, "base_model_prefix", None)
        body = getattr(model, prefix, None) if prefix else None
        layers_name = getattr(body, "layers_name", None)
        if layers_name is None or getattr(model, "lm_head", None) is None:
            problems.append(f"pp = {pp}: pipeline stages run causal LMs (GPT2LMHeadModel, LlamaForCausalLM), "
                            f"not {type(model).__name__}; use pp = 1")
        else:
            layers = len(getattr(body, layers_name))
            if pp > layers:
                problems.append(f"pp = {pp} is larger than the number of layers {layers}: every pipeline stage "
                                f"needs at least one layer; lower pp")
    return problems


def _config_kwargs(config) -> dict:
    """The config's non-default values, as keyword arguments that rebuild it."""
    kwargs = config.to_diff_dict()
    for key in ("transformers_version", "model_type", "_name_or_path"):
        kwargs.pop(key, None)
    return kwargs


def check_output_dir(path: str | Path, overwrite: bool = False) -> Path:
    """`path` as an output directory: new or empty, or any directory with `overwrite`."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"output {path} is a file: pass a directory")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise FileExistsError(f"output directory {path} is not empty: choose a new directory, or pass --overwrite "
                              f"to write into it")
    return path


def hf_to_zoo(hf_dir: str | Path, output_dir: str | Path, *, dp: int = 1, tp: int = 1, pp: int = 1,
              model_class: str | None = None, dtype: torch.dtype | str | None = None,
              overwrite: bool = False) -> Path:
    """Write the Hugging Face model in `hf_dir` as a libai_zoo checkpoint that runs at dp × tp × pp
    (see the module docstring for what is written); return the checkpoint directory.

    ``dtype``: None keeps the weights' dtype; a run at another dtype converts while loading."""
    from libai_zoo.config import LazyCall, LazyConfig

    hf_dir, output_dir = Path(hf_dir), check_output_dir(output_dir, overwrite)
    config_dict = read_hf_config(hf_dir)
    cls = zoo_class_for(config_dict, model_class, source=str(hf_dir / "config.json"))
    config = cls._load_config(hf_dir)
    with torch.device("meta"):
        skeleton = cls(config)
    problems = check_layout(skeleton, dp, tp, pp)
    if problems:
        raise ValueError(f"{hf_dir} ({cls.__name__}) cannot run at dp={dp} tp={tp} pp={pp}:\n  "
                         + "\n  ".join(problems))
    model = cls.from_pretrained(hf_dir, dtype=dtype)

    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    output_dir.mkdir(parents=True, exist_ok=True)
    final, tmp = output_dir / FIRST_CHECKPOINT, output_dir / f"{FIRST_CHECKPOINT}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with warnings.catch_warnings():  # DCP warns that it runs without a process group: here that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        save({"model": get_state_dict(model, [])[0]}, checkpoint_id=str(tmp))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)

    record = {
        "model": LazyCall(cls)(config=LazyCall(type(model.config))(**_config_kwargs(model.config))),
        "dist": {"dp": dp, "tp": tp, "pp": pp, "sequence_parallel": False},
        "conversion": {"source": str(hf_dir.resolve()), "model_class": cls.__name__, "world_size": dp * tp * pp,
                       "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")},
    }
    LazyConfig.save(record, output_dir / "config.yaml")
    shutil.copyfile(hf_dir / "config.json", output_dir / HF_CONFIG)
    (output_dir / f"{POINTER}.tmp").write_text(FIRST_CHECKPOINT)
    os.replace(output_dir / f"{POINTER}.tmp", output_dir / POINTER)
    logger.info("wrote %s from %s", final, hf_dir)
    return final


def resolve_checkpoint(path: str | Path) -> Path:
    """A libai_zoo checkpoint directory from a model_XXXXXXX directory or a run's output_dir
    (followed through its last_checkpoint)."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist: pass a libai_zoo checkpoint (a model_XXXXXXX directory) or "
                                f"the output_dir of a run")
    pointer = path / POINTER
    if pointer.is_file():
        checkpoint = path / pointer.read_text().strip()
        if not (checkpoint / ".metadata").is_file():
            raise FileNotFoundError(f"{pointer} names {checkpoint.name}, which is not a complete checkpoint "
                                    f"(no {checkpoint / '.metadata'}): pass one of the run's model_XXXXXXX "
                                    f"directories instead")
        return checkpoint
    candidates = sorted(p.name for p in path.glob("model_*") if (p / ".metadata").is_file())
    hint = (f"; it holds {', '.join(candidates)}: pass one of them" if candidates
            else ": pass a model_XXXXXXX directory written by the trainer or by hf-to-zoo")
    raise FileNotFoundError(f"{path} is not a libai_zoo checkpoint (no .metadata) nor a run's output_dir "
                            f"(no {POINTER}){hint}")


def zoo_to_hf(checkpoint: str | Path, output_dir: str | Path, *, max_shard_size: int | str = "5GB",
              overwrite: bool = False) -> tuple[Path, nn.Module]:
    """Write a libai_zoo checkpoint (any layout; a run's output_dir means its newest checkpoint) as
    a Hugging Face directory; return (the checkpoint read, the model)."""
    from .export import export_to_hf

    checkpoint = resolve_checkpoint(checkpoint)
    if not (checkpoint.parent / "config.yaml").is_file():
        raise FileNotFoundError(f"no {checkpoint.parent / 'config.yaml'}: the model is rebuilt from the config.yaml "
                                f"that the trainer (or hf-to-zoo) writes next to its checkpoints; copy the run's "
                                f"config.yaml there")
    output_dir = check_output_dir(output_dir, overwrite)
    return checkpoint, export_to_hf(checkpoint, output_dir, max_shard_size=max_shard_size)
