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

Adapters on an MoE layer's stacked experts are PEFT's ``target_parameters`` LoRA on the parameters
transformers 5 holds in memory (`rules.Stacked.fused`: ``….experts.gate_up_proj``, ``down_proj``):
PEFT keeps each as one ``lora_A`` [E·r, in] (expert-major rows) and ``lora_B`` [out, r·E]
(rank-major columns), wrapping the experts module once per adapted parameter in its order of
registration, so the first one's factors sit deepest (``….experts.base_layer.lora_A.weight``).
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
from libai_zoo.layers import apply_lora, lora_adapters
from libai_zoo.utils.transformers_versions import conversion_mapping

from .rules import Adapter, Either, PackedQKV, Stacked, Transposed, joined

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # what PeftModel puts before the base model's module names


def _rules(model: nn.Module) -> dict:
    """Each parameter's rule in the form adapters are named after (`Either`'s first: PEFT's)."""
    return {rule.zoo: rule.rule if isinstance(rule, Either) else rule for rule in model.hf_weight_map().rules}


def _rule(rules: dict, adapted: str):
    """The rule of an adapted layer's weight (a `Linear`'s ``<name>.weight``, an expert projection's ``<name>``)."""
    return rules.get(f"{adapted}.weight") or rules[adapted]


def _full(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if isinstance(param, DTensor) else param).detach().float().cpu()


def _expert_keys(rules: dict, parameters: list[str]) -> dict[str, str]:
    """{adapted expert parameter: the module path PEFT names its factors after}: the experts module,
    with a ``.base_layer`` per adapted parameter registered after it on that module."""
    order = list(dict.fromkeys(rule.fused for rule in rules.values() if isinstance(rule, Stacked) and rule.fused))
    adapted = [name for name in order if name in parameters]
    keys = {}
    for name in adapted:
        module = name.rpartition(".")[0]
        later = [other for other in adapted[adapted.index(name) + 1:] if other.rpartition(".")[0] == module]
        keys[name] = module + ".base_layer" * len(later)
    return keys


def _renames(model: nn.Module) -> list[tuple[str, str]]:
    """(checkpoint name pattern, in-memory name) of the modules transformers renames on load for the
    model's type, in its order: PEFT adapts the modules in memory and names its adapters so
    (Swin's attention.self.query is attention.q_proj, its output.dense mlp.fc2)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    mapping = conversion_mapping()  # transformers 4 renames nothing: the modules are the checkpoint's
    if mapping is None or model_type is None:
        return []
    return [(source, target) for converter in mapping.get_checkpoint_conversion_mapping(model_type) or ()
            if isinstance(converter, mapping.WeightRenaming)
            for source, target in zip(converter.source_patterns, converter.target_patterns)]


def _peft_name(renames: list[tuple[str, str]], module: str) -> str:
    """A checkpoint module's name as PEFT knows it (in memory)."""
    for source, target in renames:
        module = re.sub(source, target, module)
    return module


def _checkpoint_name(renames: list[tuple[str, str]], module: str) -> str:
    """The inverse of `_peft_name`: the renames undone, last first (transformers' patterns are plain
    names, anchored at most; the reader keeps a result only where a rule knows it)."""
    for source, target in reversed(renames):
        module = module.replace(target, source.strip("^$").replace("\\", ""))
    return module


@torch.no_grad()
def save_peft_adapter(model: nn.Module, path: str | Path, *, base_model_name_or_path: str | None = None) -> Path:
    """Write `model`'s LoRA adapters (whole, or split over tp: every rank calls it, rank 0 writes)
    as a PEFT adapter directory that ``peft.PeftModel.from_pretrained(base, path)`` loads; the
    rank and alpha most layers have are the config's ``r`` and ``lora_alpha``, others go in its
    ``rank_pattern``/``alpha_pattern``."""
    rules, adapters = _rules(model), lora_adapters(model)
    if not adapters:
        raise ValueError(f"{type(model).__name__} holds no LoRA adapter (train.lora.rank = 0?): nothing to write")
    tensors, ranks, alphas, pieces, transposed = {}, {}, {}, [], False
    for name, lora in adapters.items():
        rule = _rule(rules, name)
        transposed |= isinstance(rule, Transposed) or isinstance(rule, PackedQKV) and rule.transposed
        pieces += rule.save_adapter(Adapter(_full(lora.A), _full(lora.B), lora.scale)).items()
    parts = joined(pieces)  # Phi-3's gate_up_proj, the experts' gate_up_proj: the adapters of gate and up joined
    blocks = Counter(module for module, _ in pieces)
    missing = [rule.zoo for rule in rules.values() if isinstance(rule, Stacked) and rule.zoo not in adapters
               and blocks[rule.fused] not in (0, rule.blocks)]
    if missing:
        raise ValueError(f"{missing} have no adapter, but their experts' other projection in the same transformers "
                         f"parameter does: adapt the experts' gate_proj and up_proj both (or neither)")
    expert_keys = _expert_keys(rules, [module for module, part in parts.items() if part.A.dim() == 3])
    _check_peft_reads_dense_as_dense(rules, [module for module in parts if module not in expert_keys])
    renames = _renames(model)
    parts = {_peft_name(renames, module): part for module, part in parts.items()}
    expert_keys = {_peft_name(renames, module): key for module, key in expert_keys.items()}
    for module, part in parts.items():
        A, B, key = part.A, part.B, module
        if A.dim() == 3:  # PEFT's layout of an adapter on stacked experts
            A, B, key = A.flatten(0, 1), B.permute(1, 2, 0).flatten(1), expert_keys[module]
        tensors[f"{PREFIX}{key}.lora_A.weight"] = A.clone()  # A is shared by fused modules
        tensors[f"{PREFIX}{key}.lora_B.weight"] = B.contiguous()
        ranks[module], alphas[module] = part.A.shape[-2], part.scale * part.A.shape[-2]
    path = Path(path)
    group = run_group()
    if group is None or dist.get_rank(group) == 0:
        rank, alpha = Counter(ranks.values()).most_common(1)[0][0], Counter(alphas.values()).most_common(1)[0][0]
        dropouts = {lora.dropout for lora in adapters.values()}
        modules = sorted(module for module in ranks if module not in expert_keys)
        config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM" if hasattr(model, "lm_head") else None,
            "base_model_name_or_path": base_model_name_or_path, "r": rank, "lora_alpha": alpha,
            "lora_dropout": max(dropouts), "target_modules": modules or None,
            "target_parameters": sorted(expert_keys) or None, "fan_in_fan_out": transposed,
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


def _check_peft_reads_dense_as_dense(rules: dict, modules: list[str]) -> None:
    """Refuse dense adapters PEFT would put on the experts: on transformers 5, PEFT (0.21) turns every
    target named like the experts' per-expert projections (Qwen-MoE's gate_proj, up_proj,
    down_proj; any path ending so) into an adapter on the stacked experts' parameters."""
    expert_names = {rule.name.removesuffix(".weight").rpartition(".")[2] for rule in rules.values()
                    if isinstance(rule, Stacked)}
    clashing = sorted(module for module in modules if module.rpartition(".")[2] in expert_names)
    if clashing:
        raise ValueError(f"the adapters of {clashing} cannot be written for PEFT: on transformers 5 PEFT takes every "
                         f"target named {sorted(expert_names)} for the MoE experts' stacked parameters and would put "
                         f"them there; adapt these dense MLPs (dense layers, shared expert) only if you merge the "
                         f"adapters (zoo-to-hf without --adapter), or leave them out of train.lora.target_modules "
                         f"(e.g. qkv, out, experts)")


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
    rules = _rules(model)
    # PEFT's in-memory names back to the checkpoint's where a rule knows those (Swin's), as they are
    # where the rules speak transformers 5's own (Mixtral's fused experts)
    renames, known = _renames(model), {module for rule in rules.values() for module in rule.adapter_names}
    peft_names = {name: module for module in factors if (name := _checkpoint_name(renames, module)) in known}
    factors = {name: factors[module] for name, module in peft_names.items()} | \
        {module: f for module, f in factors.items() if module not in peft_names.values()}
    experts = {rule.fused: rule.count for rule in rules.values() if isinstance(rule, Stacked) and rule.fused}
    wanted = config.get("target_parameters") or ()
    targeted = [name for name in experts if any(name == t or name.endswith("." + t) for t in wanted)]
    for name, key in _expert_keys(rules, targeted).items():  # PEFT's layout of stacked experts' adapters -> ours
        if key in factors:
            f, count = factors.pop(key), experts[name]
            factors[name] = {"A": f["A"].unflatten(0, (count, -1)),
                             "B": f["B"].unflatten(1, (-1, count)).permute(2, 0, 1)}
    adapters = {module: Adapter(f["A"], f["B"], _scale(config, peft_names.get(module, module), f["A"].shape[-2]))
                for module, f in factors.items()}
    result, used = {}, set()
    for name, rule in rules.items():
        modules = [module for module in rule.adapter_names if module in adapters]
        if modules:
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
        layers = {name: (a.A.shape[-2], a.scale * a.A.shape[-2])
                  for name, a in read_peft_adapter(lora["adapter"], model).items()}
    if not layers and not lora["rank"]:
        return {}
    shapes = {name: (int(rank), float(alpha)) for name, (rank, alpha) in layers.items()} if layers else None
    apply_lora(model, lora["rank"], lora["alpha"], dropout=lora["dropout"], target_modules=lora["target_modules"],
               layers=shapes)
    return {name: (lora.rank, lora.alpha) for name, lora in lora_adapters(model).items()}


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
    for name, lora in lora_adapters(model).items():
        adapter = adapters.get(name)
        if adapter is None:
            raise ValueError(f"{path} has no adapter for {name}: start from an adapter trained on the same "
                             f"train.lora.target_modules")
        if tuple(adapter.A.shape) != tuple(lora.A.shape) or not torch.isclose(
                torch.tensor(adapter.scale), torch.tensor(lora.scale)):
            raise ValueError(f"{path}: the adapter of {name} has rank {adapter.A.shape[-2]} and scale "
                             f"{adapter.scale:g}; "
                             f"the model's has rank {lora.rank} and scale {lora.scale:g}: set "
                             f"train.lora.rank and alpha as the adapter was trained")
        fill_shard_(lora.A, adapter.A.to(lora.A.dtype))
        fill_shard_(lora.B, adapter.B.to(lora.B.dtype))
        filled.append(name)
    return filled
