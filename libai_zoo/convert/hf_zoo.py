"""Hugging Face directories <-> libai_zoo training checkpoints (the work behind `tools/convert`).

    hf_to_zoo("hf_dir", "out", dp=2, tp=2, pp=1)   # out/model_0000000 + last_checkpoint + config.yaml
    zoo_to_hf("output/run", "hf_out")             # the newest checkpoint of a run, any layout
    export_to_hf("output/run/model_0001000", "hf_out")   # one checkpoint; its model from its config.yaml

A libai_zoo checkpoint is a torch.distributed.checkpoint (DCP) directory: tensors are stored with
their global shapes and each rank of a later run reads only its own slices. The checkpoint is
therefore the same whatever layout will read it, and the conversion runs in one process; the
target layout (dp, tp, pp) is only checked against the model up front, so that a bad layout fails
here rather than after a large run has started, and recorded in config.yaml.

    out/
      model_0000000/       .metadata + __0_0.distcp: {"model": <the model's state dict>}, as the
                           trainer's Checkpointer writes it (train.load_weight=out/model_0000000),
                           and config.yaml: model (LazyCall of the libai_zoo class and its config),
                           dist (the target layout), conversion (source); `export_to_hf` rebuilds
                           the model from it, as from a run's checkpoint
      last_checkpoint      "model_0000000"
      config.yaml          the same, the conversion's record as a run's config.yaml is its run's
      hf_config.json       the source's config.json, unchanged (not named config.json, which would
                           make the directory look like a Hugging Face one)
"""

from __future__ import annotations

import logging
import shutil
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint import save
from torch.distributed.checkpoint.state_dict import get_state_dict

from libai_zoo import distributed, models
from libai_zoo.checkpoint import Checkpointer, commit
from libai_zoo.config import LazyCall, LazyConfig, instantiate
from libai_zoo.hf import apply_lora_config, read_config, save_peft_adapter
from libai_zoo.layers import merge_lora
from libai_zoo.models import all_layers, auto, check_trainable

logger = logging.getLogger("libai_zoo")

FIRST_CHECKPOINT = "model_0000000"
HF_CONFIG = "hf_config.json"

def zoo_class_for(config: dict, model_class: str | None = None, *, source: str = "config.json") -> type[nn.Module]:
    """The libai_zoo model class for a Hugging Face config: `model_class` if given (a name in
    libai_zoo.models that serves its model_type), else the one its architectures name
    (`models.auto.MODELS`)."""
    if model_class is None:
        return auto.class_for(config, source=source)
    choices = sorted(set(auto.tasks_of(config.get("model_type"), source=source).values()))
    if model_class not in choices:
        raise ValueError(f"--model-class {model_class!r} does not load a {config['model_type']!r} model: use one of "
                         f"{', '.join(choices)}")
    return getattr(models, model_class)


def check_layout(model: nn.Module, dp: int = 1, tp: int = 1, pp: int = 1) -> list[str]:
    """Why `model` cannot be trained at dp × tp × pp ([] when it can), asked of the model itself
    (it may live on the meta device): its parallel layers say what must divide by tp, and a
    pipeline needs at least one layer per stage."""
    problems = [f"--{name} {value} is not a positive integer" for name, value in (("dp", dp), ("tp", tp), ("pp", pp))
                if not isinstance(value, int) or value < 1]
    if problems:
        return problems
    if tp > 1:
        problems += distributed.tp_problems(model, tp)
    if pp > 1:
        try:
            check_trainable(model)
        except TypeError as error:
            problems.append(f"pp = {pp}: {error}")
        else:
            layers = len(all_layers(model))
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
    hf_dir, output_dir = Path(hf_dir), check_output_dir(output_dir, overwrite)
    cls = zoo_class_for(read_config(hf_dir), model_class, source=str(hf_dir / "config.json"))
    config = cls.load_config(hf_dir)
    with torch.device("meta"):
        skeleton = cls(config)
    _require_layout(skeleton, dp, tp, pp, f"{hf_dir} ({cls.__name__})")
    model = cls.from_pretrained(hf_dir, dtype=dtype)
    final = write_zoo_checkpoint(model, output_dir, dp=dp, tp=tp, pp=pp, source=hf_dir)
    shutil.copyfile(hf_dir / "config.json", output_dir / HF_CONFIG)
    return final


def _require_layout(model: nn.Module, dp: int, tp: int, pp: int, what: str) -> None:
    problems = check_layout(model, dp, tp, pp)
    if problems:
        raise ValueError(f"{what} cannot run at dp={dp} tp={tp} pp={pp}:\n  " + "\n  ".join(problems))


def write_zoo_checkpoint(model: nn.Module, output_dir: Path, *, source: str | Path, dp: int = 1, tp: int = 1,
                         pp: int = 1) -> Path:
    """Write a whole model as a libai_zoo checkpoint for a dp × tp × pp run (checked first):
    model_0000000, last_checkpoint and config.yaml; return the checkpoint directory."""
    cls = type(model)
    _require_layout(model, dp, tp, pp, f"{source} ({cls.__name__})")
    final = output_dir / FIRST_CHECKPOINT
    staged = commit.start(final)
    with warnings.catch_warnings():  # DCP warns that it runs without a process group: here that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        save({"model": get_state_dict(model, [])[0]}, checkpoint_id=str(staged))

    record = {
        "model": LazyCall(cls)(config=LazyCall(type(model.config))(**_config_kwargs(model.config))),
        "dist": {"dp": dp, "tp": tp, "pp": pp, "sequence_parallel": False},
        "conversion": {"source": str(Path(source).resolve()), "model_class": cls.__name__, "world_size": dp * tp * pp,
                       "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")},
    }
    LazyConfig.save(record, output_dir / commit.CONFIG)  # the conversion's record, as a run's
    LazyConfig.save(record, staged / commit.CONFIG)  # and the checkpoint's own, as the trainer writes it
    commit.write_manifest(staged, commit.record_files(staged, 0), iteration=0, world_size=1)
    commit.finish(final)
    logger.info("wrote %s from %s", final, source)
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
    checkpoint = commit.pointed_to(path)
    if checkpoint is not None:
        if not (checkpoint / ".metadata").is_file():
            raise FileNotFoundError(f"{path / commit.POINTER} names {checkpoint.name}, which is not a complete "
                                    f"checkpoint (no {checkpoint / '.metadata'}): pass one of the run's "
                                    f"model_XXXXXXX directories instead")
        return checkpoint
    candidates = sorted(p.name for p in path.glob("model_*") if (p / ".metadata").is_file())
    hint = (f"; it holds {', '.join(candidates)}: pass one of them" if candidates
            else ": pass a model_XXXXXXX directory written by the trainer or by hf-to-zoo")
    raise FileNotFoundError(f"{path} is not a libai_zoo checkpoint (no .metadata) nor a run's output_dir "
                            f"(no {commit.POINTER}){hint}")


def zoo_to_hf(checkpoint: str | Path, output_dir: str | Path, *, max_shard_size: int | str = "5GB",
              overwrite: bool = False, adapter: bool = False) -> tuple[Path, nn.Module]:
    """Write a libai_zoo checkpoint (any layout; a run's output_dir means its newest checkpoint) as
    a Hugging Face directory, LoRA adapters merged into the weights, or with `adapter` only its
    adapters as a PEFT directory (`save_peft_adapter`); return (the checkpoint read, the model)."""
    checkpoint = resolve_checkpoint(checkpoint)
    checkpoint_config(checkpoint)
    output_dir = check_output_dir(output_dir, overwrite)
    if adapter:
        return checkpoint, export_adapter(checkpoint, output_dir)
    return checkpoint, export_to_hf(checkpoint, output_dir, max_shard_size=max_shard_size)


def checkpoint_config(checkpoint: Path) -> Path:
    """The config.yaml of the run (or the hf-to-zoo conversion) that wrote `checkpoint`, kept inside it;
    for a checkpoint written before they kept one, its run's config.yaml beside it."""
    config = checkpoint / commit.CONFIG
    if config.is_file():
        return config
    run_config = checkpoint.parent / commit.CONFIG
    if not run_config.is_file():
        raise FileNotFoundError(f"no {config} nor {run_config}: the model is rebuilt from the config the trainer "
                                f"(and hf-to-zoo) writes into each checkpoint; copy the run's config.yaml there")
    logger.warning("%s keeps no config.yaml (an older checkpoint): the model is rebuilt from its run's %s, the "
                   "config of the run's latest start", checkpoint, run_config)
    return run_config


def load_checkpoint_model(checkpoint: str | Path, model: nn.Module | None = None) -> nn.Module:
    """The model of a trainer checkpoint, whole, in this process. Without `model` it is built from
    the config.yaml inside the checkpoint; the checkpoint's sharded tensors are read into it
    whatever layout wrote them (torch.distributed.checkpoint reshards on load)."""
    checkpoint = Path(checkpoint)
    if model is None:
        cfg = LazyConfig.load(str(checkpoint_config(checkpoint)))
        model = instantiate(cfg.model)
        if "train" in cfg:  # a run's (typed) config; hf-to-zoo's has no train and no adapters
            apply_lora_config(model, cfg.train.lora)
    Checkpointer(checkpoint.parent, [model]).load(checkpoint)  # refuses one of another model (adapters too)
    return model.eval()


def export_to_hf(checkpoint: str | Path, output_dir: str | Path, *, model: nn.Module | None = None,
                 max_shard_size: int | str = "5GB") -> nn.Module:
    """Write the checkpoint's model as a Hugging Face directory (config.json + safetensors) that
    `transformers` loads, LoRA adapters merged into their weights; returns the model."""
    model = load_checkpoint_model(checkpoint, model)
    merged = merge_lora(model)
    if merged:
        logger.info("merged %d LoRA adapters into their weights", merged)
    model.save_pretrained(output_dir, max_shard_size=max_shard_size)
    return model


def export_adapter(checkpoint: str | Path, output_dir: str | Path) -> nn.Module:
    """Write the LoRA adapters of a checkpoint's model as a PEFT adapter directory, which
    ``peft.PeftModel.from_pretrained(base, output_dir)`` loads over the run's base model (its
    ``from_pretrained`` path is recorded as ``base_model_name_or_path``); returns the model."""
    model = load_checkpoint_model(checkpoint)
    base = LazyConfig.load(str(checkpoint_config(Path(checkpoint)))).model.get("path")  # a from_pretrained run's
    save_peft_adapter(model, output_dir, base_model_name_or_path=base)
    return model
