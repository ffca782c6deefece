"""transformers 4 and 5 told apart in one place: each difference the zoo meets, stated once.

The zoo runs on transformers >= 4.46 (pyproject.toml). Where the two name a thing differently it
reads either; where they behave differently it does as transformers 5 does. The callers (config,
hf, models) ask here instead of testing versions themselves. This module sits in `utils`, the
first of the house's layers, so every package may import it, and imports nothing of transformers
until asked (`libai_zoo.config` loads no transformers).
"""

from __future__ import annotations

import importlib
from dataclasses import is_dataclass
from types import ModuleType
from typing import Any

#: config.json's keys for the weights' dtype, newest first: ``dtype`` (transformers 5), ``torch_dtype`` (4).
DTYPE_KEYS = ("dtype", "torch_dtype")

#: The dtype a model loads at when none is asked: "auto", the checkpoint's own (`checkpoint_dtype`), as
#: transformers 5 does; transformers 4 loads float32. The zoo does as 5 whichever is installed.
DEFAULT_LOAD_DTYPE = "auto"

#: Where transformers 5 holds an MoE layer in memory, under its decoder layer: ``mlp`` (Mixtral's
#: ``block_sparse_moe`` renamed), the router ``mlp.gate`` and the experts stacked, ``FUSED_GATE_UP``
#: [E, 2I, h] ([gate; up] per expert) and ``FUSED_DOWN`` [E, h, I]. transformers 4 holds what the hub
#: saves, one tensor per expert and projection (``experts.{e}.w1``, ``experts.{e}.gate_proj``). PEFT's
#: adapters on the experts name 5's parameters.
FUSED_MOE = "mlp"
FUSED_GATE_UP = "experts.gate_up_proj"
FUSED_DOWN = "experts.down_proj"


def conversion_mapping() -> ModuleType | None:
    """transformers 5's `transformers.conversion_mapping`: what its loading does to a model type's
    checkpoint (`get_checkpoint_conversion_mapping`: `WeightRenaming`s of modules, per-expert
    tensors stacked by `MergeModulelist` and joined by `Concatenate`); None on transformers 4, which
    loads the tensors as saved, under their saved names."""
    try:
        mapping = importlib.import_module("transformers.conversion_mapping")
    except ImportError:
        return None
    used = ("get_checkpoint_conversion_mapping", "WeightRenaming", "MergeModulelist", "Concatenate")
    return mapping if all(hasattr(mapping, name) for name in used) else None


def rope_parameters(config) -> dict:
    """A config's RoPE settings: transformers 5's ``rope_parameters`` (``rope_theta`` and the scaling
    in one dict), else transformers 4's ``rope_scaling`` (the scaling only; {} when none)."""
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}


def rope_theta(params: dict, config, default: float = 10000.0) -> float:
    """RoPE's base: ``rope_theta`` in the RoPE parameters (transformers 5), else the config's own
    ``rope_theta`` attribute (transformers 4), else `default`."""
    return float(params.get("rope_theta", getattr(config, "rope_theta", default)))


def partial_rotary_factor(config) -> float:
    """The share of each head's channels that rotate (GPT-NeoX): ``partial_rotary_factor`` in the
    ``rope_parameters`` (transformers 5), else the config's ``rotary_pct`` (transformers 4), else all."""
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("partial_rotary_factor", getattr(config, "rotary_pct", 1.0)))


def cache_output_name(output_class: type) -> str:
    """The name under which transformers' model outputs (`output_class`, a dataclass) carry the KV
    caches: ``cache`` since transformers 5.24 (which warns on the old one), ``past_key_values`` before."""
    return "cache" if "cache" in output_class.__dataclass_fields__ else "past_key_values"


def tie_word_embeddings_as_saved(config, kwargs: dict) -> bool:
    """Whether config.json ties the head (``tie_word_embeddings``, true unless it says false), read
    before transformers 5's T5Config and MT5Config ``__post_init__`` force it true (5 unties the head
    only when the checkpoint holds a different lm_head.weight); transformers 4 keeps the value given."""
    return kwargs.get("tie_word_embeddings", getattr(config, "tie_word_embeddings", True)) is not False


def checkpoint_dtype(config) -> Any:
    """The dtype a config gives the weights (`DTYPE_KEYS`: ``dtype`` in transformers 5, ``torch_dtype``
    in 4); None when it gives none."""
    return next((value for value in (getattr(config, key, None) for key in DTYPE_KEYS) if value), None)


def is_dataclass_type(target: Any) -> bool:
    """Whether `target` is a dataclass type, which omegaconf reads as a structured-config schema
    instead of a value: transformers 5's config classes are dataclasses, transformers 4's are not."""
    return isinstance(target, type) and is_dataclass(target)
