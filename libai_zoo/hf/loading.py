"""Load a Hugging Face directory into a libai_zoo model, whole or as this rank's shards.

    model = load_pretrained(GPT2LMHeadModel, "hf_dir", shard=True)   # PreTrainedModel.from_pretrained

The model is built on the meta device; with ``shard=True`` it is split over the current parallel
context's tensor parallelism (`distributed.shard`) while still on meta, materialised (each rank allocates
its own slices only), and each parameter is filled from the slice of the checkpoint tensors that
its DTensor placement says this rank keeps. The model's `hf_weight_map` says which checkpoint
tensors make which parameter.

Called under ``torch.device("meta")`` (the trainer builds every model so), nothing is read: the
model comes back on the meta device with a `PretrainedSource` as ``model.pretrained_source``, and
`libai_zoo.parallel.materialize` reads each rank's part once the model is split, cut and sharded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from libai_zoo import distributed
from libai_zoo.layers import is_adapter_parameter
from libai_zoo.utils.transformers_versions import DEFAULT_LOAD_DTYPE, checkpoint_dtype

from .reader import Container, HFWeightReader
from .rules import Either, WeightMap

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PretrainedSource:
    """Where a model built on the meta device by ``from_pretrained`` finds its weights."""

    path: Path
    strict: bool


def load_pretrained(cls: type[nn.Module], path: str | Path, *, dtype: torch.dtype | str | None = None,
                    shard: bool = False, strict: bool = True, output_loading_info: bool = False,
                    **config_overrides):
    """`cls` (a libai_zoo PreTrainedModel class) with the weights of the directory `path`; see
    `PreTrainedModel.from_pretrained` for the arguments."""
    path = Path(path)
    config = cls.load_config(path)
    for key, value in config_overrides.items():
        if not hasattr(config, key):
            raise ValueError(f"{key}={value!r}: {type(config).__name__} has no attribute {key!r}")
        setattr(config, key, value)
    dtype = resolve_dtype(dtype, config)
    deferred = torch.get_default_device().type == "meta"
    with torch.device("meta"):
        model = cls(config).to(dtype)
    if deferred:  # nothing read: `shard` is the trainer's to do, and loading info comes from materialize
        model.pretrained_source = PretrainedSource(path, strict)
        model.eval()
        return (model, {}) if output_loading_info else model
    device = torch.device("cpu")
    if shard:
        ctx = distributed.get_context()
        distributed.shard(model, ctx)
        device = ctx.device
    distributed.to_empty(model, device)
    if not strict:
        model.init_weights()
    model.tie_weights()
    with HFWeightReader(path) as reader:
        info = load_hf_weights(model, reader, strict=strict)
        info["bytes_read"] = reader.bytes_read
    model.eval()
    return (model, info) if output_loading_info else model


@torch.no_grad()
def load_hf_weights(model: nn.Module, reader: HFWeightReader, *, strict: bool = True,
                    aliases: dict[str, str] | None = None, weight_map: WeightMap | None = None) -> dict:
    """Fill the parameters `model` holds (whole, or this rank's shards; a pipeline stage holds only
    its own) from Hugging Face tensors. ``aliases``: this model's name of a parameter -> the name
    whose rule makes it (a pipeline's last stage holds a copy of the embedding tied to its head).
    ``weight_map``: the whole model's, for a pipeline stage (whose own map knows only its layers,
    so the other stages' tensors would be unexpected); default ``model.hf_weight_map()``.
    Each rank reads, one parameter at a time, only its part of each tensor it needs: the
    tensor-parallel slice, and of it only the rows its ZeRO shard keeps (a fused QKV's tp slice is
    read whole and cut). Returns {"missing_keys",
    "unexpected_keys", "not_loaded", "skipped_keys"}: checkpoint names the parameters need but the files lack,
    names in the files no parameter uses, the parameters (model names) left as they were, and the
    names of a container's other parts (a vision tower) that were not read."""
    params, held, available, missing, unexpected = check_hf_weights(model, reader, strict=strict, aliases=aliases,
                                                                   weight_map=weight_map)
    if missing or unexpected:
        logger.warning("%s: initialised %s; ignored %s", type(model).__name__, missing or "nothing",
                       unexpected or "nothing")
    container = _container(model, reader.keys())
    skipped = [key for key in reader.keys() if key.startswith(container.skipped)] if container else []
    if skipped:
        logger.warning("%s: loading the model under %r of %s; skipped its other parts (%s: %d tensors)",
                       type(model).__name__, container.prefix, reader.path, ", ".join(container.skipped),
                       len(skipped))

    def read(name, ranges=None):
        return reader.read(available[name], ranges)

    not_loaded = []
    for rule in held:
        if all(name in available for name in rule.hf):
            param = params[rule.zoo]
            # exactly this rank's part: its tp slice and, under ZeRO, the rows of it it keeps
            tensor = rule.load(read, distributed.tp_slice_of(param), param.shape, distributed.dp_rows_of(param))
            (param.to_local() if isinstance(param, DTensor) else param).copy_(tensor)
        else:
            not_loaded.append(rule.zoo)
    return {"missing_keys": missing, "unexpected_keys": unexpected, "not_loaded": not_loaded, "skipped_keys": skipped}


def load_hf_parts(model: nn.Module, parts: list[nn.Module], reader: HFWeightReader, *, strict: bool = True,
                  aliases: dict[str, str] | None = None) -> list[dict]:
    """Fill `parts` (this rank's parts of the whole `model`: itself, or its pipeline stages) from a
    Hugging Face directory: the whole model checked first, so that every rank fails alike, then each
    part's tensors read by the whole model's weight map. Returns each part's `load_hf_weights` report."""
    weight_map = model.hf_weight_map()
    check_hf_weights(model, reader, strict=strict, weight_map=weight_map)
    return [load_hf_weights(part, reader, strict=strict, aliases=aliases, weight_map=weight_map) for part in parts]


def check_hf_weights(model: nn.Module, reader: HFWeightReader, *, strict: bool = True,
                     aliases: dict[str, str] | None = None, weight_map: WeightMap | None = None) -> tuple:
    """Match `model`'s parameters with the checkpoint's names and shapes, reading no tensor; raise
    one error naming every misshaped tensor (and, if `strict`, every missing and unexpected one).
    Call it on the whole model on every rank before any rank loads its part, so that all fail
    alike. Returns (params by rule name, the rules of the held parameters, model name ->
    checkpoint name, missing, unexpected)."""
    weight_map = model.hf_weight_map() if weight_map is None else weight_map
    params = checkpoint_tensors(model)
    for own, aliased in (aliases or {}).items():
        if own in params:
            params[aliased] = params.pop(own)
    uncovered = set(params) - {rule.zoo for rule in weight_map.rules}
    if uncovered:
        raise RuntimeError(f"{type(model).__name__}.hf_weight_map has no rule for {sorted(uncovered)}")
    available = checkpoint_names(model, reader.keys())
    rules = [rule.reading(available) for rule in weight_map.rules]  # the form the files hold (`rules.Either`)
    held = [rule for rule in rules if rule.zoo in params]
    expected: dict[str, torch.Size] = {}
    for rule in held:
        expected.update(rule.hf_shapes(params[rule.zoo].shape))
    known = {name for rule in rules for name in rule.hf}
    missing = [name for name in expected if name not in available]
    unexpected = [name for name in available if name not in known and not weight_map.ignored(name)]
    mismatched = [f"{name}: checkpoint {tuple(reader.shape(available[name]))}, model {tuple(shape)}"
                  for name, shape in expected.items()
                  if name in available and tuple(reader.shape(available[name])) != tuple(shape)]
    if mismatched or (strict and (missing or unexpected)):
        # the other form of the missing tensors (transformers 5's fused experts: transformers_versions.FUSED_MOE)
        # would do as well
        instead = list(dict.fromkeys(name for rule in weight_map.rules if isinstance(rule, Either)
                                     and any(name in missing for name in rule.hf) for name in rule.alternative.hf))
        raise ValueError(_load_error(type(model).__name__, reader.path, missing, unexpected, mismatched, strict,
                                     instead))
    return params, held, available, missing, unexpected


def checkpoint_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of `model` a Hugging Face checkpoint holds, by name: its parameters (LoRA adapters
    aside: a PEFT adapter directory holds them) and its persistent buffers (DeepSeek-V3's
    e_score_correction_bias), as transformers' state dicts do."""
    tensors = {name: param for name, param in model.named_parameters() if not is_adapter_parameter(name)}
    for name, buffer in model.named_buffers():
        owner, _, attribute = name.rpartition(".")
        if attribute not in model.get_submodule(owner)._non_persistent_buffers_set:
            tensors[name] = buffer
    return tensors


def checkpoint_names(model: nn.Module, keys: list[str]) -> dict[str, str]:
    """The model's name for each checkpoint tensor -> the checkpoint's name.

    A task model loads a bare body's checkpoint (its head is then missing), and a bare body loads
    a task model's checkpoint (the head's tensors are left out), as in transformers. In a
    container's checkpoint (`Container`: Gemma 3's multimodal model) only the tensors under its
    prefix are the model's."""
    container = _container(model, keys)
    names = {key: key for key in keys} if container is None else container.names(keys)
    prefix = model.base_model_prefix + "."
    is_task_model = isinstance(getattr(model, model.base_model_prefix, None), nn.Module)
    prefixed = any(name.startswith(prefix) for name in names)
    if is_task_model and not prefixed:
        return {prefix + name: key for name, key in names.items()}
    if not is_task_model and prefixed:
        return {name[len(prefix):]: key for name, key in names.items() if name.startswith(prefix)}
    return names


def _container(model: nn.Module, keys: list[str]) -> Container | None:
    """The container (of the model's `containers`) whose checkpoint `keys` are, if any."""
    return next((container for container in getattr(model, "containers", {}).values()
                 if any(key.startswith(container.prefix) for key in keys)), None)


def resolve_dtype(dtype: torch.dtype | str | None, config) -> torch.dtype:
    """None or "auto": the checkpoint's dtype (config.json's ``dtype``), as transformers 5 does."""
    if dtype is None:
        dtype = DEFAULT_LOAD_DTYPE
    if dtype == "auto":
        dtype = checkpoint_dtype(config) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype {dtype!r} is not a floating-point torch dtype (e.g. torch.float32, 'bfloat16')")
    return dtype


def _load_error(model: str, path: Path, missing: list[str], unexpected: list[str], mismatched: list[str],
                strict: bool, instead: list[str]) -> str:
    lines = [f"{path} does not fit {model}:"]
    for title, names in (("missing", missing), ("unexpected", unexpected), ("misshaped", mismatched)):
        if names and (strict or title == "misshaped"):
            lines.append(f"  {len(names)} {title} tensor(s): " + ", ".join(names))
            if title == "missing" and instead:
                lines.append(f"  (or, in transformers 5's in-memory form, {len(instead)} tensor(s): "
                             + ", ".join(instead) + ")")
    if strict and (missing or unexpected) and not mismatched:
        lines.append("  Check that the directory holds this model type and size; pass strict=False to "
                     "initialise the missing tensors and skip the unexpected ones (e.g. a new task head).")
    elif mismatched:
        lines.append("  The config.json and the weights disagree: they come from different models.")
    return "\n".join(lines)
