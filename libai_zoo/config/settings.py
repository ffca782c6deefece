"""What a run's config means, parsed once: `run_settings(cfg)` is what the trainer, the layout
planner and its dry run read, so they cannot read one config two ways. It holds the ``train`` and
``dist`` sections as the schema types them (every key, its default filled in: read-only), and what
their values mean where a value needs parsing (the sequence length, the autocast dtype, the
pipeline, the recomputation, float8). A key is stated once, in `schema.py`; nothing here copies one.

    settings = run_settings(cfg)
    settings.seq_len, settings.amp_dtype, settings.pipeline.schedule, settings.train.micro_batch_size
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from .instantiate import OBJECT_FLAGS, ConfigError
from .schema import typed

#: ``train.amp.dtype`` -> the autocast dtype.
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: The arguments of a dataset recipe (``dataloader.train``) that give its samples' length in tokens:
#: the zoo's builders take ``seq_len`` (packed sequences) or ``max_length`` (padded or truncated samples),
#: an encoder-decoder's the encoder's: ``input_length`` (span corruption) or ``source_length``.
SEQUENCE_LENGTH_ARGUMENTS = ("seq_len", "max_length", "input_length", "source_length")
#: What selective recomputation (``train.activation_checkpoint.modules``) can recompute, Megatron's
#: names. Checkpointed: only the module's inputs are kept. Output discarded: also its output, kept by
#: the module that reads it, is freed when the layer's forward ends and recomputed when its backward
#: begins.
RECOMPUTE_MODULES = {
    "core_attn": "the attention core (SDPA, or the explicit scores and softmax), checkpointed: it keeps q, k, v; "
                 "with a fused kernel (flash, CPU's flash) that saves only O(s) it buys little (Megatron-LM 464)",
    "mlp": "a dense MLP block, checkpointed: it keeps its input",
    "moe": "a Mixture-of-Experts block (router, token exchange, experts), checkpointed: it keeps its input",
    "mlp_act": "the MLP activation (act(gate) * up, or act(up); the experts' too: Megatron's moe_act), "
               "output discarded",
    "layernorm": "the layer's input norms (before attention and MLP), output discarded",
}

#: ``train.elementwise_recompute``: when the cheap ops of a layer (its norms, act(gate)·up) recompute in
#: backward rather than keep what autograd saves (`layers.recomputed` says what each frees).
ELEMENTWISE_RECOMPUTE = {
    "auto": "where it frees memory: RMSNorm, act(gate)·up, a LayerNorm whose input autocast upcasts",
    "always": "every norm and act(gate)·up keeps only its inputs (a float32 LayerNorm too: 8 bytes a token)",
    "never": "autograd's own saved tensors everywhere (no recompute; RMSNorm and gated MLPs keep more)",
}


@dataclass(frozen=True)
class PipelineSettings:
    """``train.pipeline``: the schedule, the stages per rank and the first layer of each stage after
    the first (None: the layers split evenly)."""

    schedule: str
    virtual_stages: int
    boundaries: tuple[int, ...] | None = None


#: ``train.fp8.recipe`` -> what torchao's recipe of that name casts to float8 (`Float8LinearConfig`).
FLOAT8_RECIPES = {
    "tensorwise": "every operand of the three GEMMs scaled per tensor (torchao's default; the fastest, and "
                  "the one FSDP2 can all-gather in float8)",
    "rowwise": "every operand scaled per row, scales rounded down to powers of 2",
    "rowwise_with_gw_hp": "rowwise, the weight gradient's GEMM in high precision (the most accurate)",
}


@dataclass(frozen=True)
class Float8:
    """``train.fp8`` when enabled: torchao's ``recipe`` (`FLOAT8_RECIPES`) and the module name
    patterns ``skip`` keeps in high precision besides the defaults."""

    recipe: str
    skip: tuple[str, ...] = ()


@dataclass(frozen=True)
class Recompute:
    """``train.activation_checkpoint`` when enabled: what the checkpointed layers recompute
    (``granularity`` "full", or "selective" of ``modules``, names of `RECOMPUTE_MODULES`) and how
    many layers of each pipeline stage are checkpointed (``num_layers``: the first N; None: all)."""

    granularity: str
    modules: tuple[str, ...]
    num_layers: int | None

    def short(self) -> str:
        """A compact name: ac (full, every layer), ac[core_attn,mlp_act], ac×2 (the first 2 layers per stage)."""
        text = "ac" if self.granularity == "full" else f"ac[{','.join(self.modules)}]"
        return text + (f"×{self.num_layers}" if self.num_layers is not None else "")

    def overrides(self) -> list[str]:
        """The `key=value` overrides that run it."""
        modules = "[" + ",".join(self.modules) + "]"
        return [f"train.activation_checkpoint.granularity={self.granularity}",
                f"train.activation_checkpoint.modules={modules}",
                f"train.activation_checkpoint.num_layers={'null' if self.num_layers is None else self.num_layers}"]


#: Megatron's full recomputation of every layer: what ``train.activation_checkpoint.enabled=true`` alone runs.
FULL = Recompute("full", (), None)


@dataclass(frozen=True)
class RunSettings:
    """The parsed values of a run's config (see `run_settings`)."""

    #: ``train`` and ``dist`` as the schema types them, every key present (read-only)
    train: DictConfig
    dist: DictConfig
    #: Tokens per sample of the training data; None when the dataset recipe states none (images).
    seq_len: int | None
    #: The autocast dtype of ``train.amp``; None without autocast.
    amp_dtype: torch.dtype | None
    pipeline: PipelineSettings
    #: What activation checkpointing recomputes; None: nothing.
    activation_checkpoint: Recompute | None
    #: ``train.elementwise_recompute``: when norms and act(gate)·up recompute in backward
    #: (`ELEMENTWISE_RECOMPUTE`; `layers.recomputed.set_elementwise_recompute` applies it).
    elementwise_recompute: str
    #: ``train.fp8``: what computes in float8; None: nothing.
    fp8: Float8 | None = None

    @property
    def lora(self) -> dict[str, Any]:
        """``train.lora`` as a plain dict, every key present."""
        return OmegaConf.to_container(self.train.lora, resolve=True)


def run_settings(cfg: DictConfig) -> RunSettings:
    """Parse ``cfg``'s ``train``, ``dist`` and ``dataloader.train``; a config without some keys of
    ``train`` or ``dist`` (one built by hand) reads their defaults. A value no run can use is a
    `ConfigError` that names the key."""
    run = typed(OmegaConf.create({"train": cfg.get("train") or {}, "dist": cfg.get("dist") or {}},
                                 flags=dict(OBJECT_FLAGS)))  # its own flags: read-only is set on them
    OmegaConf.set_readonly(run, True)
    train = run.train
    pipe = train.pipeline
    return RunSettings(
        train=train,
        dist=run.dist,
        seq_len=_sequence_length(cfg.get("dataloader")),
        amp_dtype=_amp_dtype(train),
        pipeline=PipelineSettings(pipe.schedule, pipe.virtual_stages,
                                  None if pipe.boundaries is None else tuple(pipe.boundaries)),
        activation_checkpoint=_recompute(train.activation_checkpoint),
        fp8=_float8(train),
        elementwise_recompute=_elementwise_recompute(train.elementwise_recompute),
    )


def _elementwise_recompute(mode: str) -> str:
    """``train.elementwise_recompute`` checked against the layers' choices."""
    if mode not in ELEMENTWISE_RECOMPUTE:
        raise ConfigError(f"train.elementwise_recompute = {mode!r} is not one of: "
                          + "; ".join(f"{name!r} ({what})" for name, what in ELEMENTWISE_RECOMPUTE.items()))
    return mode


def _recompute(section: DictConfig) -> Recompute | None:
    """``train.activation_checkpoint`` parsed; a granularity, module name or layer count no run can
    use is a `ConfigError` naming the choices."""
    if not section.enabled:
        return None
    key = "train.activation_checkpoint"
    if section.granularity not in ("full", "selective"):
        raise ConfigError(f"{key}.granularity = {section.granularity!r} must be 'full' or 'selective'")
    modules = ()
    if section.granularity == "selective":
        modules = tuple(dict.fromkeys(section.modules or ()))
        unknown = [name for name in modules if name not in RECOMPUTE_MODULES]
        if unknown or not modules:
            raise ConfigError(f"{key}.modules = {list(section.modules or ())} must name at least one of "
                              f"{sorted(RECOMPUTE_MODULES)}" + (f" ({unknown} are not)" if unknown else ""))
    if section.num_layers is not None and section.num_layers < 1:
        raise ConfigError(f"{key}.num_layers = {section.num_layers} must be a positive number of layers per "
                          f"pipeline stage, or null for every layer")
    return Recompute(section.granularity, modules, section.num_layers)


def _float8(train: DictConfig) -> Float8 | None:
    """``train.fp8`` parsed: a recipe torchao does not have, fp16 autocast (its loss scaling and
    float8's scales fight over the same range) or a missing torchao is a `ConfigError`."""
    section = train.fp8
    if not section.enabled:
        return None
    if section.recipe not in FLOAT8_RECIPES:
        raise ConfigError(f"train.fp8.recipe = {section.recipe!r} is not one of torchao's float8 recipes: "
                          + "; ".join(f"{name!r} ({what})" for name, what in FLOAT8_RECIPES.items()))
    if train.amp.enabled and train.amp.dtype == "fp16":
        raise ConfigError("train.fp8 with train.amp.dtype = 'fp16': float8 training runs beside bf16 autocast (or "
                          "none); set train.amp.dtype=bf16, or train.fp8.enabled=false")
    try:
        import torchao.float8  # noqa: F401
    except ImportError as error:
        raise ConfigError(f"train.fp8.enabled needs torchao, the PyTorch float8 library ({error}): "
                          f"pip install -e \".[fp8]\" (or pip install torchao), or set train.fp8.enabled=false") \
            from None
    return Float8(section.recipe, tuple(section.skip or ()))


def _sequence_length(dataloader: Mapping | None) -> int | None:
    """The training data's tokens per sample: the ``seq_len`` or ``max_length`` argument of
    ``dataloader.train``'s recipe (`SEQUENCE_LENGTH_ARGUMENTS`); None when it has neither."""
    data = (dataloader or {}).get("train") or {}
    for name in SEQUENCE_LENGTH_ARGUMENTS:
        value = data.get(name) if isinstance(data, Mapping) else None
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"dataloader.train.{name} = {value!r} must be a positive number of tokens")
            return value
    return None


def _amp_dtype(train: DictConfig) -> torch.dtype | None:
    if not train.amp.enabled:
        return None
    if train.amp.dtype not in AMP_DTYPES:
        raise ConfigError(f"train.amp.dtype = {train.amp.dtype!r} must be one of {sorted(AMP_DTYPES)}")
    return AMP_DTYPES[train.amp.dtype]

