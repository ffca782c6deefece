"""A transformers model's tensor-parallel plan (``_tp_plan``), carried out with the zoo's parallel
layers: LiBai's swap of a transformers model's linear layers for its own, automated.

    colwise, local_colwise          -> `layers.Linear(parallel="col")`
    colwise_gather_output           -> the same, its output gathered (a whole output: the module's
                                       reader does not know the split)
    rowwise, local_rowwise          -> `layers.Linear(parallel="row")`
    embedding_rowwise (the tokens)  -> `layers.VocabEmbedding` (the vocabulary split)
    the LM head                     -> `layers.LMHead` (its vocabulary split; the loss is the zoo's
                                       vocabulary-parallel cross entropy on each rank's slice)
    anything else                   kept whole on every tp rank (packed expert tensors, norms,
                                    sequence-parallel marks: no sequence parallelism here)
    every other nn.Linear           -> `KeptLinear`: whole on every rank, its weight a plain
                                       tensor (transformers' code may read it), LoRA's target by
                                       its transformers name

Only modules that are exactly `nn.Linear` / `nn.Embedding` are swapped (a subclass may compute
more than its parent: Gemma's scaled embedding), with their parameters, so names, ties and values
are unchanged and one process computes exactly as before. The modules a plan names under one
parent split together or not at all: a row layer needs its column partners split (an MoE's
packed experts keep their whole MLP). The attention modules of a model with a tp plan compute with
the local heads the split projections give them (transformers' own tp runs them so).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from libai_zoo.layers import Linear, LMHead, VocabEmbedding

COLUMN = ("colwise", "local_colwise", "colwise_gather_output")
ROW = ("rowwise", "local_rowwise")
EMBEDDING = ("embedding_rowwise",)


def name_pattern(key: str) -> re.Pattern:
    """A transformers module-name pattern ("*" for a layer or expert index) as a regular expression."""
    return re.compile(re.escape(key).replace(r"\*", r"\d+"))


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    owner, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(owner), attribute, new)


def _linear(old: nn.Linear, cls: type, **kwargs) -> nn.Module:
    with torch.device("meta"):
        new = cls(old.in_features, old.out_features, bias=old.bias is not None, **kwargs)
    new.weight, new.bias = old.weight, old.bias
    return new


def apply_tp_plan(model: nn.Module) -> list[tuple[str, str]]:
    """Swap the modules `model`'s tp plan splits for the zoo's parallel layers (in place; they split
    when `distributed.shard` runs at tp > 1, and compute as before until then). Returns (module
    name, "col" | "gathered" | "row" | "vocab") of each module the plan splits; [] without a plan.
    Every other `nn.Linear` but the head becomes a `KeptLinear`, LoRA's target by its name."""
    plan = dict(getattr(model, "_tp_plan", None) or {})
    swapped = _split_by_plan(model, plan) if plan else []
    head = model.get_output_embeddings()
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and module is not head:
            _swap(model, name, _linear(module, KeptLinear, parallel="data", sequence_parallel=False))
    return swapped


class KeptLinear(Linear):
    """A linear layer tp does not split: `nn.Linear` on every rank (with its LoRA adapter, if one
    is added), its parameters left plain tensors, as the code of a transformers model that reads a
    layer's weight itself (a Mamba mixer's projections) expects."""

    def shard_(self, tp) -> None:
        """Kept whole and plain: nothing to split, no communication."""


def _split_by_plan(model: nn.Module, plan: dict[str, str]) -> list[tuple[str, str]]:
    """The plan's column, row and vocabulary splits (see `apply_tp_plan`)."""
    patterns = [(name_pattern(key), style) for key, style in plan.items()]
    styles = {}
    for name, module in model.named_modules():
        style = next((s for p, s in patterns if p.fullmatch(name)), None)
        if style is not None:
            styles[name] = (module, style)
    for name, param in model.named_parameters():  # a plan entry naming a parameter (attention sinks)
        style = next((s for p, s in patterns if p.fullmatch(name)), None)
        if style is not None:
            styles[name] = (param, style)  # not a module: its group cannot split
    groups: dict[str, list[str]] = {}
    for name in styles:
        groups.setdefault(name.rpartition(".")[0], []).append(name)
    swapped: list[tuple[str, str]] = []
    head = model.get_output_embeddings()
    for names in groups.values():
        kinds = {}
        for name in names:
            module, style = styles[name]
            if module is head:
                continue  # the head follows the embedding, below
            if type(module) is nn.Linear and style in COLUMN + ROW:
                kinds[name] = "row" if style in ROW else "gathered" if style == "colwise_gather_output" else "col"
            elif type(module) is nn.Embedding and style in EMBEDDING:
                kinds[name] = "vocab"
            else:
                kinds[name] = None
        if None in kinds.values():
            continue  # a partner cannot split: the whole group stays whole
        for name, kind in kinds.items():
            module = styles[name][0]
            if kind == "vocab":
                with torch.device("meta"):
                    new = VocabEmbedding(module.num_embeddings, module.embedding_dim, module.padding_idx,
                                         sequence_parallel=False)
                new.weight = module.weight
            else:
                new = _linear(module, Linear, parallel="row" if kind == "row" else "col", sequence_parallel=False,
                              gather_output=kind == "gathered")
            _swap(model, name, new)
            swapped.append((name, kind))
    embedding = model.get_input_embeddings()
    if type(head) is nn.Linear and head.bias is None and (
            head.weight is not embedding.weight or isinstance(embedding, VocabEmbedding)):
        head_name = next(name for name, module in model.named_modules() if module is head)
        _swap(model, head_name, _linear(head, LMHead))
        swapped.append((head_name, "vocab"))
    return swapped


def tp_plan_problems(model: nn.Module, tp_size: int) -> list[str]:
    """Why `model` (made trainable) cannot be split over `tp_size` ranks by its tp plan."""
    if tp_size == 1:
        return []
    name = type(model).__name__
    if not model.tp_split:
        return [f"{name} declares no tensor-parallel plan (base_model_tp_plan): train it with data parallelism "
                f"and ZeRO (dist.tp=1), or use a libai_zoo model of its family"]
    problems = []
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for key in ("num_attention_heads", "num_key_value_heads"):
        try:
            heads = getattr(config, key, None)
        except Exception:  # noqa: BLE001 - a per-layer value (transformers' per_layer_config): the layers split it
            heads = None
        if isinstance(heads, int) and heads % tp_size:
            problems.append(f"{key} = {heads} is not divisible by tp = {tp_size}: each rank computes whole heads; "
                            f"lower tp")
    return problems
