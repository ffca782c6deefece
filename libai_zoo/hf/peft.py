"""LoRA adapters as PEFT writes and reads them: a directory with ``adapter_config.json`` and
``adapter_model.safetensors``, named after the Hugging Face modules.

    save_peft_adapter(model, "adapter_dir")         # peft.PeftModel.from_pretrained(hf_model, "adapter_dir")
    adapters = read_peft_adapter("adapter_dir", model)   # {layer name: Adapter}, in libai_zoo's layout
    apply_lora_config(model, {"rank": 8, "alpha": 16})    # train.lora (or {"adapter": "adapter_dir"})
    load_peft_adapter(model, "adapter_dir")         # into the adapters `apply_lora` put on the model

The model's weight map (`hf_weight_map`) says which Hugging Face modules each layer is: an adapter
on a fused ``qkv`` becomes one per q_proj, k_proj and v_proj (A repeated, B's rows split), GPT-2's
packed c_attn (and Phi-3's qkv_proj) keeps one with B's rows in [q | k | v] order; the adapters of
layers that are blocks of one module (Phi-3's gate and up in gate_up_proj) are joined into one, of
their summed rank. Reading the other way, fused modules' adapters with different A's (as PEFT
trains them) are stacked into one of their summed rank, and a module made of blocks gives each
block's layer its rows of B (and the whole A).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from libai_zoo.config.schema import LoraConfig
from libai_zoo.distributed import fill_shard_, run_group
from libai_zoo.layers import apply_lora, lora_layers

from .rules import Adapter, PackedQKV, Transposed, joined

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # what PeftModel puts before the base model's module names


def _rules(model: nn.Module) -> dict:
    return {rule.zoo: rule for rule in model.hf_weight_map().rules}


def _full(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if isinstance(param, DTensor) else param).detach().float().cpu()


@torch.no_grad()
def save_peft_adapter(model: nn.Module, path: str | Path, *, base_model_name_or_path: str | None = None) -> Path:
    """Write `model`'s LoRA adapters (whole, or split over tp: every rank calls it, rank 0 writes)
    as a PEFT adapter directory that ``peft.PeftModel.from_pretrained(base, path)`` loads; the
    rank and alpha most layers have are the config's ``r`` and ``lora_alpha``, others go in its
    ``rank_pattern``/``alpha_pattern``."""
    rules, layers = _rules(model), lora_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} holds no LoRA adapter (train.lora.rank = 0?): nothing to write")
    tensors, ranks, alphas, pieces, transposed = {}, {}, {}, [], False
    for name, layer in layers.items():
        rule = rules[f"{name}.weight"]
        transposed |= isinstance(rule, Transposed) or isinstance(rule, PackedQKV) and rule.transposed
        pieces += rule.save_adapter(Adapter(_full(layer.lora.A), _full(layer.lora.B), layer.lora.scale)).items()
    for module, part in joined(pieces).items():  # Phi-3's gate_up_proj: the adapters of gate and up joined
        tensors[f"{PREFIX}{module}.lora_A.weight"] = part.A.clone()  # A is shared by fused modules
        tensors[f"{PREFIX}{module}.lora_B.weight"] = part.B.contiguous()
        ranks[module], alphas[module] = part.A.shape[0], part.scale * part.A.shape[0]
    path = Path(path)
    group = run_group()
    if group is None or dist.get_rank(group) == 0:
        rank, alpha = Counter(ranks.values()).most_common(1)[0][0], Counter(alphas.values()).most_common(1)[0][0]
        dropouts = {layer.lora.dropout for layer in layers.values()}
        config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM" if hasattr(model, "lm_head") else None,
            "base_model_name_or_path": base_model_name_or_path, "r": rank, "lora_alpha": alpha,
            "lora_dropout": max(dropouts), "target_modules": sorted(ranks), "fan_in_fan_out": transposed,
            "bias": "none", "use_rslora": False, "use_dora": False, "init_lora_weights": True,
            "inference_mode": True, "modules_to_save": None,
            "rank_pattern": {m: r for m, r in ranks.items() if r != rank},
            "alpha_pattern": {m: a for m, a in alphas.items() if a != alpha},
        }
        path.mkdir(parents=True, exist_ok=True)
        (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    if group is not None:
        dist.barrier(group=group)
    return path


def read_peft_adapter(path: str | Path, model: nn.Module) -> dict[str, Adapter]:
    """The adapters of a PEFT LoRA directory as `model`'s layers hold them ({layer name: Adapter},
    whole tensors, float32); `model` may live on the meta device. Refuses what LoRA here is not
    (DoRA, bias training, modules PEFT saves whole) and modules the model has no layer for."""
    path = Path(path)
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(f"{path} is not a PEFT adapter directory: it needs {ADAPTER_CONFIG} and "
                                f"{ADAPTER_WEIGHTS} (peft's save_pretrained writes both)")
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    unsupported = [f"{key}={config[key]!r}" for key, plain in (("peft_type", "LORA"), ("use_dora", False),
                                                                ("bias", "none"), ("modules_to_save", None))
                   if config.get(key, plain) != plain]
    if config.get("init_lora_weights", True) not in (True, False, "gaussian"):  # pissa, olora, loftq change the base
        unsupported.append(f"init_lora_weights={config['init_lora_weights']!r}")
    if unsupported:
        raise ValueError(f"{path}: {', '.join(unsupported)} is not a plain LoRA adapter, the only kind libai_zoo loads")
    factors: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(path / ADAPTER_WEIGHTS), framework="pt") as file:
        for key in file.keys():
            match = re.fullmatch(rf"(?:{re.escape(PREFIX)})?(.+)\.lora_([AB])(?:\.default)?\.weight", key)
            if match is None:
                raise ValueError(f"{path / ADAPTER_WEIGHTS}: {key} is not a LoRA factor (…lora_A.weight/lora_B.weight)")
            factors.setdefault(match[1], {})[match[2]] = file.get_tensor(key).float()
    adapters = {module: Adapter(f["A"], f["B"], _scale(config, module, f["A"].shape[0]))
                for module, f in factors.items()}
    result, used = {}, set()
    for name, rule in _rules(model).items():
        modules = [n.removesuffix(".weight") for n in rule.hf if n.removesuffix(".weight") in adapters]
        if name.endswith(".weight") and modules:
            result[name.removesuffix(".weight")] = rule.load_adapter(adapters)
            used.update(modules)
    unused = sorted(set(adapters) - used)
    if unused:
        raise ValueError(f"{path}: the adapters of {unused} match no layer of {type(model).__name__}: it was "
                         f"trained for another model")
    return result


def apply_lora_config(model: nn.Module, lora: dict) -> dict[str, tuple[int, float]]:
    """Put the adapters ``train.lora`` asks for on `model` (`apply_lora`; it may live on the meta
    device): ``rank``, ``alpha``, ``dropout`` on ``target_modules``; or each of ``layers`` (layer
    name -> [rank, alpha]) as given; or the layers, ranks and alphas of the PEFT directory
    ``adapter`` (its factors are read later: `load_peft_adapter`). Keys left out take their defaults
    (`LoraConfig`). Returns the adapted layers' (rank, alpha); nothing when there is no LoRA (rank 0,
    no adapter)."""
    lora = {**dataclasses.asdict(LoraConfig()), **lora}
    layers = lora["layers"]
    if not layers and lora["adapter"]:
        layers = {name: (a.A.shape[0], a.scale * a.A.shape[0])
                  for name, a in read_peft_adapter(lora["adapter"], model).items()}
    if not layers and not lora["rank"]:
        return {}
    shapes = {name: (int(rank), float(alpha)) for name, (rank, alpha) in layers.items()} if layers else None
    apply_lora(model, lora["rank"], lora["alpha"], dropout=lora["dropout"], target_modules=lora["target_modules"],
               layers=shapes)
    return {name: (layer.lora.rank, layer.lora.alpha) for name, layer in lora_layers(model).items()}


def _scale(config: dict, module: str, rank: int) -> float:
    """PEFT's scale of one module: lora_alpha / r, or / sqrt(r) with rsLoRA; patterns first."""
    def pattern(key: str, default):
        for expression, value in (config.get(key) or {}).items():
            if re.fullmatch(rf"(.*\.)?({expression})", module):
                return value
        return default
    alpha = pattern("alpha_pattern", config.get("lora_alpha", 8))
    return alpha / (rank ** 0.5 if config.get("use_rslora") else rank)


@torch.no_grad()
def load_peft_adapter(model: nn.Module, path: str | Path, adapters: dict[str, Adapter] | None = None) -> list[str]:
    """Fill the adapters `model` holds (whole, split over tp or ZeRO, or a pipeline stage's: a
    copy with the whole model's names) from a PEFT directory (or from its `read_peft_adapter`
    result); each must have the file's rank and scale. Returns the layers filled."""
    adapters = read_peft_adapter(path, model) if adapters is None else adapters
    filled = []
    for name, layer in lora_layers(model).items():
        adapter = adapters.get(name)
        if adapter is None:
            raise ValueError(f"{path} has no adapter for {name}: start from an adapter trained on the same "
                             f"train.lora.target_modules")
        if tuple(adapter.A.shape) != tuple(layer.lora.A.shape) or not torch.isclose(
                torch.tensor(adapter.scale), torch.tensor(layer.lora.scale)):
            raise ValueError(f"{path}: the adapter of {name} has rank {adapter.A.shape[0]} and scale "
                             f"{adapter.scale:g}; "
                             f"the model's has rank {layer.lora.rank} and scale {layer.lora.scale:g}: set "
                             f"train.lora.rank and alpha as the adapter was trained")
        fill_shard_(layer.lora.A, adapter.A.to(layer.lora.A.dtype))
        fill_shard_(layer.lora.B, adapter.B.to(layer.lora.B.dtype))
        filled.append(name)
    return filled
