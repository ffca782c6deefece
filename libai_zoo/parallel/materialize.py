"""Give a model built on the meta device its memory, this rank's part only, and its values.

The trainer builds every model on the meta device, cuts its pipeline stages, splits them over tp
and wraps them for data parallelism (FSDP2 shards over dp) while it holds no memory, and only then
allocates: `materialize` gives each parameter this rank's part (``to_empty``) and fills it.

Fresh weights are layout-invariant: each parameter is drawn whole on the CPU by the model's
`init_parameter` from a generator seeded by the run's seed and the parameter's name, and this
rank keeps its part (`distributed.fill_shard_`). The same seed gives the same full weights whether the
parameter ends up whole, split over tp, cut into pipeline stages or sharded by ZeRO, and the
start-up peak is this rank's shard plus the largest single parameter. Pretrained weights are read
the same way, one parameter at a time, each rank reading its tensor-parallel slice of the file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Container

import torch
from torch import nn

from libai_zoo.distributed import fill_shard_, parameter_uses, retie, to_empty
from libai_zoo.hf import HFWeightReader, load_hf_parts
from libai_zoo.layers import LoRA, is_adapter_parameter


def parameter_seed(seed: int, name: str) -> int:
    """The seed of one parameter's draw: the run's seed and the parameter's full name, hashed."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@torch.no_grad()
def init_parameters(part: nn.Module, seed: int, *, model: nn.Module | None = None,
                    aliases: dict[str, str] | None = None, names: Container[str] | None = None) -> int:
    """Draw the parameters of `part` (whole, or this rank's shards of them) as the full parameters
    of `model` (the whole model `part` was cut from; default `part` itself) with `seed`: each is
    made whole on the CPU by ``model.init_parameter`` and this rank keeps its part. ``aliases``:
    a parameter's name in `part` -> its name in `model` (a pipeline stage's copy of a tied weight).
    ``names``: only these (names in `model`). Returns the number of parameters drawn."""
    model = model if model is not None else part
    drawn = 0
    for own_name, param in part.named_parameters():
        name = (aliases or {}).get(own_name, own_name)
        if names is not None and name not in names:
            continue
        module_path = name.rpartition(".")[0]
        module = model.get_submodule(module_path)
        full = torch.empty(param.shape, dtype=param.dtype)
        generator = torch.Generator().manual_seed(parameter_seed(seed, name))
        if isinstance(module, LoRA):  # an adapter draws its own factors, whatever model it is put on
            module.init_parameter(name.rpartition(".")[2], full, generator)
        else:
            model.init_parameter(name, module, full, generator)
        fill_shard_(param, full)
        drawn += 1
    return drawn


def materialize(part: nn.Module, device: torch.device, *, seed: int, model: nn.Module | None = None,
                aliases: dict[str, str] | None = None) -> dict:
    """Allocate this rank's part of every parameter of `part` (built on the meta device; possibly
    split over tp, a pipeline stage's copy, wrapped by FSDP2) on `device` and fill it: from the
    Hugging Face directory its model was asked from (``from_pretrained`` under the meta device:
    ``model.pretrained_source``), else fresh from `seed` (`init_parameters`). A non-strict load
    draws only what the directory lacks; LoRA adapters are always drawn. Returns what the load
    reported ({} for fresh weights)."""
    model = model if model is not None else part
    ties = parameter_uses(part)
    to_empty(part, device)  # allocates each holder of a tied weight anew: tie them again
    retie(ties)
    part.init_buffers()
    source = getattr(model, "pretrained_source", None)
    if source is None:
        init_parameters(part, seed, model=model, aliases=aliases)
        return {}
    with HFWeightReader(source.path) as reader:
        info, = load_hf_parts(model, [part], reader, strict=source.strict, aliases=aliases)
        info["bytes_read"] = reader.bytes_read
    fresh = set(info["not_loaded"]) | {name for name, _ in part.named_parameters() if is_adapter_parameter(name)}
    if fresh:
        init_parameters(part, seed, model=model, aliases=aliases, names=fresh)
    return info
