"""The run's keys, typed: `train`, `dist`, `dataloader` and `optim` as dataclasses, each default stated here once.

A recipe edits them as Python objects (``get_config("common/train.py").train`` is a `TrainConfig`)::

    train.max_iter = 400
    train.update(checkpoint=dict(period=200))   # merges: checkpoint.max_to_keep and async_save stay
    train.checkpoint = dict(period=200)         # replaces the section: the others are their defaults

A name that is not a key is refused with the closest one. `LazyConfig.load` turns the sections into
typed DictConfigs (omegaconf structured configs), so a command-line override of any key works and a
value of the wrong type is refused; a saved config.yaml's `SECTIONS` are typed the same way (`typed`),
its missing keys taking the defaults below. ``optim`` is typed only as a recipe's `AdamWConfig`: the
optimizer is a LazyCall whose arguments are the callee's (an override swaps ``optim._target_`` or adds
``+optim.fused=true``), so a saved config.yaml's ``optim`` is free-form, its arguments checked when it
is built, like ``model`` and the dataset recipes ``dataloader.train``/``dataloader.test``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .instantiate import OBJECT_FLAGS, TARGET, ConfigError, LazyCall


class Section:
    """A dataclass of config keys: assigning a name that is not a field is an error naming the
    closest field, and `update` merges mappings into the sections and mappings it holds."""

    def __setattr__(self, name: str, value: Any) -> None:
        names = _field_names(self)
        if name not in names:
            raise ConfigError(f"{name} is not a key of {type(self).__name__}; {_closest(name, names)}")
        default = _section_type(type(self), name)
        if default is not None and value is None:
            raise ConfigError(f"{name} is a section of {type(self).__name__}, not a value: None cannot replace it; "
                              f"set its keys (e.g. update({name}=dict(...))), or assign {default.__name__}() for "
                              f"its defaults")
        if default is not None and isinstance(value, Mapping):  # a dict for a section: the section, filled
            section = default()
            section.update(**value)
            value = section
        object.__setattr__(self, name, value)

    def update(self, **changes: Any) -> None:
        """Set the given keys. A mapping given for a section is merged into it key by key (the keys it
        leaves out keep their values); one given for a LazyCall's arguments is merged into that LazyCall;
        a mapping with ``_target_`` (a new callable) and any other value (a plain dict field such as
        ``lora.layers`` included) replace the value whole."""
        for name, value in changes.items():
            current = getattr(self, name, None) if name in _field_names(self) else None
            if isinstance(value, Mapping) and TARGET not in value.keys():
                if isinstance(current, Section):
                    current.update(**value)
                    continue
                if isinstance(current, Mapping) and TARGET in current.keys():  # new arguments of a LazyCall
                    value = OmegaConf.merge(OmegaConf.create(dict(current), flags=OBJECT_FLAGS), value)
            setattr(self, name, value)


# ------------------------------------------------------------------------------------------ train
@dataclass
class AmpConfig(Section):
    enabled: bool = False               # autocast forward
    dtype: str = "bf16"                 # "bf16" or "fp16"
    # The residual stream in float32 under autocast (Megatron's --fp32-residual-connection): more
    # precise sums, 4 bytes per token and hidden unit more per layer; default: in `dtype`, as Megatron.
    fp32_residual: bool = False


@dataclass
class Float8Config(Section):
    """Linear layers' GEMMs in float8 (torchao's float8 training; ``pip install -e ".[fp8]"``).
    Kept in high precision: the LM head, MoE routers (float32 by design) and experts (grouped
    GEMMs), every layer whose per-rank dimensions are not multiples of 16, and the layers ``skip``
    names; the log lists them. Checkpoints stay in high precision."""

    enabled: bool = False
    recipe: str = "tensorwise"          # torchao's: "tensorwise", "rowwise" or "rowwise_with_gw_hp"
    # module names (fnmatch patterns, e.g. "*.mlp.down_proj") also kept in high precision
    skip: list[str] = field(default_factory=list)


@dataclass
class ActivationCheckpointConfig(Section):
    """Recompute activations in backward instead of keeping them (Megatron-LM's recomputation).

    ``full``: a checkpointed layer keeps only its input and runs again in backward. ``selective``:
    only ``modules`` of it are recomputed (`settings.RECOMPUTE_MODULES`: "core_attn", "mlp",
    "mlp_act", "layernorm", "moe"), the rest keeps what it saves. ``num_layers``: only the first
    that many layers of each pipeline stage (model chunk) are checkpointed, the others keep
    everything (Megatron's ``block`` method), so spare memory buys speed."""

    enabled: bool = False               # recompute in backward to save memory
    granularity: str = "full"           # "full" or "selective"
    # selective: the modules recomputed (Megatron's --recompute-modules and its default)
    modules: list[str] = field(default_factory=lambda: ["core_attn"])
    num_layers: Optional[int] = None    # the first N layers of each pipeline stage; None: every layer


@dataclass
class CheckpointConfig(Section):
    # save every `period` iterations and after the last (0: after the last only; None: neither, as
    # Megatron-LM without --save: a benchmark, a smoke run, a test; a preemption's save and model_best
    # still are, and a divergence rollback finds nothing to roll back to)
    period: Optional[int] = 500
    max_to_keep: Optional[int] = None   # None keeps all
    # Write in the background (the loop waits only while the state is copied; the checkpoint counts
    # once every rank has written it).
    async_save: bool = False


@dataclass
class EvalConfig(Section):
    period: int = 0                     # eval every `period` iterations (0: no periodic eval)
    max_batches: Optional[int] = None   # None: the whole eval set


@dataclass
class LoraConfig(Section):
    """LoRA (rank 0: full fine-tuning): a low-rank adapter on each target Linear, split as its layer
    is split over tp; every other parameter is frozen (no gradient, no optimizer state)."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    # None: the attention and MLP projections (qkv, out, gate, up, down)
    target_modules: Optional[list[str]] = None
    # A PEFT adapter directory to start the adapters from (its layers, ranks and alphas replace
    # rank/alpha/target_modules; the run records them in `layers`: layer name -> [rank, alpha]).
    adapter: Optional[str] = None
    layers: Optional[dict[str, Any]] = None


@dataclass
class PipelineConfig(Section):
    """Pipeline parallelism (dist.pp > 1). The micro-batches a step pipelines are
    global_batch_size / (micro_batch_size × dp)."""

    schedule: str = "1f1b"              # "gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"
    virtual_stages: int = 1             # stages per rank (>= 2 for the interleaved ones)
    boundaries: Optional[list[int]] = None  # the first layer of each stage after the first; None: even


def _default_scheduler() -> DictConfig:
    # Also in libai_zoo.optim: WarmupLinearLR, ConstantLR.
    return LazyCall("libai_zoo.optim.WarmupCosineLR")(warmup_iters=0, min_lr_ratio=0.0)


@dataclass
class TrainConfig(Section):
    """The run: loop, precision, memory, checkpoints, evaluation."""

    output_dir: str = "output"          # checkpoints, logs and the run's config.yaml go here
    max_iter: int = 1000                # optimizer steps in the run
    seed: int = 42
    micro_batch_size: int = 8           # samples in one forward/backward on one dp rank
    # samples per optimizer step over all dp ranks: micro_batch_size × dp × gradient-accumulation steps
    global_batch_size: int = 8
    amp: AmpConfig = field(default_factory=AmpConfig)
    fp8: Float8Config = field(default_factory=Float8Config)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    # Whether a layer's cheap ops (norms, act(gate)·up) keep only their inputs and recompute in backward:
    # "auto" where that frees memory (RMSNorm, gated MLPs, a 16-bit LayerNorm input under autocast; one in
    # its input's dtype frees only mean and rstd, and recomputing it cost GPT-2's CPU step 1-2%), "always",
    # or "never" (autograd's saved tensors: more memory, no recompute). settings.ELEMENTWISE_RECOMPUTE
    elementwise_recompute: str = "auto"
    zero_stage: int = 0                 # ZeRO: 0 off; 1 shards optimizer state, 2 + gradients, 3 + parameters
    zero_offload: bool = False          # keep the sharded state in CPU memory
    compile: Union[bool, str] = False   # torch.compile each transformer layer (True: inductor; or a backend name)
    log_period: int = 10                # iterations between metric logs
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    clip_grad_norm: Optional[float] = 1.0  # clip the global gradient norm to this; None: no clipping
    # A step whose loss or gradient norm is not finite is skipped on every rank; after max_bad_steps
    # such steps in a row the run stops with an error ("stop"), or ("rollback") reloads the newest
    # checkpoint from before them and skips the data batches read since it.
    max_bad_steps: int = 5
    on_divergence: str = "stop"
    load_weight: Optional[str] = None   # a checkpoint or Hugging Face directory to start from; None: fresh init
    lora: LoraConfig = field(default_factory=LoraConfig)
    # The LR schedule (a LazyCall); the trainer fills in the optimizer and the run length when it builds it.
    scheduler: Any = field(default_factory=_default_scheduler)
    tensorboard: bool = False           # also write TensorBoard event files under output_dir
    best_metric: Optional[str] = None   # an eval metric (e.g. "accuracy") whose best checkpoint is kept; None: none
    best_mode: str = "max"              # "max" or "min": which way best_metric improves
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    # DeepSeek-V3's auxiliary-loss-free balancing: after each step every router with an
    # e_score_correction_bias moves it by this × sign(mean load - expert's load); 0: off (DeepSeek-V3: 0.001)
    expert_bias_update_rate: float = 0.0


# ------------------------------------------------------------------------------------------- dist
@dataclass
class DistConfig(Section):
    """The parallel layout, read by distributed.init: data × context × tensor × pipeline = number of
    processes (expert parallelism splits dp further, it adds no processes)."""

    dp: int = 1                         # -1: inferred from the world size
    tp: int = 1
    pp: int = 1
    # Expert parallelism: an MoE model's experts are split over ep × tp ranks (ep carved from dp, which
    # must be a multiple of it); tokens travel to their experts' ranks by all-to-all. 1: no split over dp.
    ep: int = 1
    # Context parallelism: each sample's sequence split over cp ranks (2·cp chunks, rank r holding chunks r
    # and 2·cp−1−r), attention exchanging keys and values over them; the sequence length must be a multiple
    # of 2·cp. The cp ranks of a dp rank read the same samples; ZeRO shards over dp × cp. 1: no split.
    cp: int = 1
    sequence_parallel: bool = False     # split norms and dropout over the sequence inside the tp group
    # Timeouts in seconds: init_timeout bounds forming the process group and every collective until
    # the first step is done; timeout every collective after it (a rank that waits longer names the
    # ranks that did not arrive and exits non-zero, so torchrun restarts).
    init_timeout: int = 600
    timeout: int = 300
    # True (tools/train.py --auto-layout): the layout planner (libai_zoo.plan, tools/plan.py) picks dp,
    # cp, tp, pp, ep, sequence_parallel, train.zero_stage, train.activation_checkpoint, train.micro_batch_size
    # and train.pipeline for the launched world size at start-up, and logs what it chose and why.
    auto: bool = False


# ------------------------------------------------------------------------------------------ optim
def _default_param_groups() -> DictConfig:
    # libai_zoo.optim.param_groups(model, weight_decay): groups with and without weight decay (biases
    # and norms are exempt); `model` is filled in at build time.
    return LazyCall("libai_zoo.optim.param_groups")(weight_decay=0.01)


@dataclass
class AdamWConfig(Section):
    """torch.optim.AdamW as a recipe: `instantiate` builds it. A recipe swaps the optimizer by
    assigning another LazyCall: ``optim = LazyCall(torch.optim.SGD)(params=..., lr=0.1)``."""

    _target_: Any = "torch.optim.AdamW"
    params: Any = field(default_factory=_default_param_groups)
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01          # for any group that sets none itself


# ------------------------------------------------------------------------------------- dataloader
@dataclass
class DataLoaderConfig(Section):
    """The data. ``train`` and ``test`` are dataset recipes (LazyCalls, their arguments the builder's);
    the other keys say how the trainer reads them."""

    # The training set: map-style, or a torch IterableDataset with state_dict() read as a stream (in
    # order, each dp rank keeping its micro-batches of the global stream, its state saved with every
    # checkpoint).
    train: Any = MISSING
    test: Any = None                    # the evaluation set (map-style); None: no evaluation
    num_workers: int = 0                # DataLoader worker processes (a stream needs 0)
    shuffle: bool = True                # shuffle a map-style training set (seeded by train.seed)
    prefetch: int = 2                   # batches a background thread reads ahead of the step; 0: off


#: The top-level keys typed by a schema, and their sections.
SECTIONS: dict[str, type[Section]] = {"train": TrainConfig, "dist": DistConfig, "dataloader": DataLoaderConfig}


# ----------------------------------------------------------------------------------- typing a config
def typed(cfg: DictConfig, source: str = "the config") -> DictConfig:
    """``cfg`` with its `SECTIONS` (``train``, ``dist``, ``dataloader``) as typed DictConfigs: every
    key present (the missing ones at their defaults), values checked against the key's type, any other
    key refused with the closest name. Sections already typed are kept. Returns ``cfg`` (edited in place)."""
    for key, section in SECTIONS.items():
        node = cfg.get(key) if key in cfg.keys() else None
        if isinstance(node, Mapping) and not issubclass(OmegaConf.get_type(node) or dict, section):
            values = section()
            _fill(values, node, key, source)
            cfg[key] = structured(values, f"{source}: {key}")
    return cfg


def added_key_error(key: str) -> str | None:
    """Why ``+key`` (an override that adds a key) cannot add ``key``: under `SECTIONS` only the schema's
    keys exist (a config.yaml holding another would not load back); None where the key is free-form
    (``model``, ``optim``, a LazyCall's arguments, a key of the user's own) or the schema's."""
    parts = key.split(".")
    section = SECTIONS.get(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        if section is None:
            return None
        names = _field_names(section)
        if part not in names:
            where = ".".join(parts[:i])
            return (f"+{key}: {where} is typed by the schema ({section.__name__}) and has no setting {part} "
                    f"({_closest(part, names)}): a typed section holds only the schema's keys (a config.yaml "
                    f"with another would not load back); set one of them, or add a top-level key of your own")
        section = _section_type(section, part)
    return None


def structured(values: Section, where: str) -> DictConfig:
    """The section as a typed DictConfig; a value of the wrong type is a `ConfigError` naming its key."""
    try:
        return OmegaConf.structured(values, flags=OBJECT_FLAGS)
    except OmegaConfBaseException as error:
        raise ConfigError(f"{where}: {error_text(error)}") from error


def error_text(error: OmegaConfBaseException) -> str:
    """omegaconf's message with its key, on one line (it spreads them over three)."""
    lines = str(error).splitlines()
    key = next((line.split(":", 1)[1].strip() for line in lines if line.strip().startswith("full_key:")), "")
    return f"{key + ': ' if key else ''}{lines[0]}"


def _fill(section: Section, values: Mapping, path: str, source: str) -> None:
    names = _field_names(section)
    for key in values.keys():
        if key not in names:
            raise ConfigError(f"{source}: {path}.{key} is not a key of {path} (this libai_zoo has no such "
                              f"setting; {_closest(key, names)}): remove it, or rename it")
        value = values[key]
        current = getattr(section, key)
        if isinstance(current, Section) and isinstance(value, Mapping):
            _fill(current, value, f"{path}.{key}", source)
        elif isinstance(current, Section) and value is None:  # a section left out: its defaults
            continue
        else:
            setattr(section, key, value)


def _field_names(section: Section | type[Section]) -> list[str]:
    return [f.name for f in dataclasses.fields(section)]


@functools.cache
def _section_type(cls: type, name: str) -> type[Section] | None:
    """The Section class of field `name`, or None for a plain field."""
    hint = typing.get_type_hints(cls).get(name)
    return hint if isinstance(hint, type) and issubclass(hint, Section) else None


def _closest(name: str, names: list[str]) -> str:
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return f"did you mean {close[0]}?" if close else f"its keys are {', '.join(names)}"

