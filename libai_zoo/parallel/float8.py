"""``train.fp8``: which linear layers compute in float8 (torchao's float8 training), and FSDP2's
all-gather of their weights in float8.

`convert_to_float8` runs on the meta-built parts after the tp split and the pipeline cut, before
the data-parallel wrap: every `layers.Linear` (a transformers model's linear layers are ones too,
`transformers_tp_plan`) gets torchao's `Float8LinearConfig` for the recipe, except the LM head,
the layers whose per-rank dimensions are not multiples of 16 (the float8 GEMM's tiles, as
torchtitan filters) and those ``skip`` names. MoE routers compute in float32 and experts run
grouped GEMMs in high precision (torchao's float8 grouped GEMM needs its CUDA kernels); the log
says so. Weights, gradients, optimizer state and checkpoints stay in high precision.

Under ZeRO 1-3 without tp (and without CPU offload), a tensorwise weight is all-gathered by FSDP2 in float8 (torchao's
`WeightWithDynamicFloat8CastTensor`: 1 byte per element instead of 2 or 4), cast with a scale
over the whole weight that `precompute_float8_scales` computes for every such weight in one
all-reduce after each optimizer step, as torchao's ``precompute_float8_dynamic_scale_for_fsdp``
does for its own layers. Split over tp, or rowwise (whose backward needs the weight cast along
another axis), the weights are gathered in high precision and cast in the layer.
"""

from __future__ import annotations

import fnmatch
import logging
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from libai_zoo.config import Float8
from libai_zoo.layers import Linear, LMHead, MoE

logger = logging.getLogger("libai_zoo")

#: Per-rank dimensions the float8 GEMM takes (torchao's and torchtitan's filter).
MULTIPLE = 16


def float8_config(recipe: str):
    """torchao's `Float8LinearConfig` of a ``train.fp8.recipe`` name."""
    from torchao.float8 import Float8LinearConfig
    return Float8LinearConfig.from_recipe_name(recipe)


def convert_to_float8(parts: list[nn.Module], fp8: Float8, *, gather_float8: bool, log: bool = True) -> list[str]:
    """Give the linear layers of `parts` that compute in float8 the recipe's config (module
    docstring); `gather_float8`: FSDP2 will all-gather their weights (ZeRO 1-3 at tp 1), which a
    tensorwise recipe then does in float8. Returns the names of the converted layers; logs the
    filter and every layer it kept in high precision, with the reason."""
    # what torchao's own conversion does first: a fix of inductor's code for float8 casts under compile
    from torchao.float8._inductor_patch import _patch_inductor_min_max_codegen
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from libai_zoo.distributed.float8_linear import mm_config
    _patch_inductor_min_max_codegen()
    config = float8_config(fp8.recipe)
    gather_float8 = gather_float8 and fp8.recipe == "tensorwise"
    converted, kept, seen = [], {}, set()
    for part in parts:
        for name, module in part.named_modules():
            if not isinstance(module, Linear) or id(module) in seen:
                continue
            seen.add(id(module))
            reason = kept_reason(name, module, fp8.skip)
            if reason:
                kept[name] = reason
                continue
            module.float8 = config
            converted.append(name)
            if gather_float8 and module.weight.requires_grad:
                module.weight = nn.Parameter(WeightWithDynamicFloat8CastTensor(
                    module.weight.data, mm_config(config), config.cast_config_weight.target_dtype))
    if not log:
        return converted
    unmatched = [p for p in fp8.skip if not any(r == f"train.fp8.skip {p!r}" for r in kept.values())]
    if unmatched:
        logger.warning("train.fp8.skip %s matches no linear layer (names such as %s)", unmatched,
                       ", ".join(converted[:3] + list(kept)[:1]))
    experts = sum(isinstance(m, MoE) for part in parts for m in part.modules())
    logger.info("float8 (torchao, %s recipe): %d linear layers; kept in high precision: the LM head, MoE routers "
                "and experts, layers whose per-rank sizes are not multiples of %d%s; weights all-gathered in %s",
                fp8.recipe, len(converted), MULTIPLE, f", {list(fp8.skip)}" if fp8.skip else "",
                "float8 by FSDP2" if gather_float8 else "high precision")
    if experts:
        logger.info("float8: the experts of %d MoE layers run their grouped GEMMs in high precision "
                    "(torchao's float8 grouped GEMM needs its CUDA kernels)", experts)
    for name, reason in kept.items():
        logger.info("float8: %s kept in high precision: %s", name, reason)
    return converted


def kept_reason(name: str, layer: Linear, skip: tuple[str, ...]) -> str | None:
    """Why `layer` stays in high precision, or None when it computes in float8."""
    if isinstance(layer, LMHead):
        return "the LM head"
    pattern = next((p for p in skip if fnmatch.fnmatchcase(name, p)), None)
    if pattern is not None:
        return f"train.fp8.skip {pattern!r}"
    weight = layer.weight.to_local() if isinstance(layer.weight, DTensor) else layer.weight
    if layer.rows is not None:
        weight = weight[:sum(end - start for start, end in layer.rows)]
    out_features, in_features = weight.shape
    if out_features % MULTIPLE or in_features % MULTIPLE:
        return f"its per-rank weight is {out_features} × {in_features}, not multiples of {MULTIPLE}"
    return None


def gathered_in_float8(parts: list[nn.Module]) -> list[Linear]:
    """The layers of `parts` whose weights FSDP2 all-gathers in float8 (torchao is imported only
    when some layer computes in float8: a run without float8 does not need it)."""
    layers = [m for part in parts for m in part.modules() if isinstance(m, Linear) and m.float8 is not None]
    if not layers:
        return []
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    return [m for m in layers if isinstance(m.weight, DTensor)
            and isinstance(m.weight._local_tensor, WeightWithDynamicFloat8CastTensor)]


@torch.no_grad()
def precompute_float8_scales(layers: list[Linear]) -> None:
    """The float8 scale of each of `layers`' weights (`gathered_in_float8`), from its whole
    (sharded) values, in one all-reduce: run after each optimizer step, so that the next gathers
    cast with the new weights' scales (a stale scale would cast them with the old ones)."""
    if not layers:
        return
    # tensorwise only (no rounding of scales to powers of 2): `convert_to_float8` gathers no other recipe
    from torchao.float8.float8_utils import EPS
    amax = torch.clamp(torch.stack(torch._foreach_norm([m.weight for m in layers], ord=math.inf)), EPS)  # all-reduce
    dtype = layers[0].float8.cast_config_weight.target_dtype
    scales = (torch.finfo(dtype).max / amax.to(torch.float64)).to_local().to(torch.float32)
    for layer, scale in zip(layers, scales):
        layer.weight._local_tensor._precomputed_scale = scale
