"""What the planner knows of a model, read once from it built on the meta device: every parameter
with its shape, the dimension tensor parallelism splits and where the pipeline puts it, plus the
sizes the time model needs, and the measured activations (`activations.SavedActivations`). No process
group and no memory."""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch
from omegaconf import DictConfig
from torch import nn

from libai_zoo import distributed
from libai_zoo.config import ConfigError, Float8
from libai_zoo.hf import apply_lora_config
from libai_zoo.layers import Attention, LatentAttention, Linear, LMHead, MoE, TransformerLayer
from libai_zoo.layers.recomputed import set_elementwise_recompute
from libai_zoo.models import CausalLM, all_layers, check_trainable, instantiate_model
from libai_zoo.parallel import check_stage_holdings, kept_reason, optional_modules, split_layers, stage_modules

from .activations import SavedActivations, image_pair


@dataclass(frozen=True)
class ParameterInfo:
    """One parameter (a tied one once, with every place it is used)."""

    shape: tuple[int, ...]
    element_size: int
    #: The dimension tensor parallelism splits, or None when every tp rank holds it whole.
    tp_dim: int | None
    #: Index among the stacks' layers in a row, or None for a parameter outside them ...
    layer: int | None
    #: ... held by the stages that hold any of these modules (`stage_modules`: the embedding, the head,
    #: both when tied; a decoder's entry and its position bias).
    holders: frozenset[str]
    requires_grad: bool
    #: Whether every tp rank holds it whole at a given tp though tp_dim splits it at others (a fused
    #: qkv at a tp above its KV heads, which it replicates): what the layers do at that tp.
    whole_at: Callable[[int], bool] = field(default=lambda tp: False, compare=False, repr=False)
    #: An MoE layer's stacked experts [E, ...]: split along dim 0 over the expert group (ep × tp
    #: ranks) whenever it has more than one rank, and sharded by ZeRO over edp = dp / ep.
    expert: bool = False

    def tp_local_shape(self, tp: int, ep: int = 1) -> tuple[int, ...]:
        """The slice one rank holds before ZeRO: its tp slice, or an expert tensor's block of
        E / (ep·tp) experts."""
        if self.expert:
            return (self.shape[0] // (ep * tp), *self.shape[1:])
        if self.tp_dim is None or self.whole_at(tp):
            return self.shape
        return tuple(size // tp if dim == self.tp_dim else size for dim, size in enumerate(self.shape))


class _SplitRecorder:
    """Stands in for `distributed.TensorParallel` in a layer's ``shard_``: records which dimension each
    parameter is split along, and splits nothing."""

    rank, sequence_parallel = 0, False

    def __init__(self, size: int = 1):
        self.size = size
        self.dims: dict[int, int] = {}

    def local_range(self, total: int) -> tuple[int, int]:
        return distributed.local_range(total, self.rank, self.size)

    def shard_parameter(self, module: nn.Module, name: str, dim: int) -> None:
        param = getattr(module, name)
        if param is not None:
            self.dims[id(param)] = dim

    def replicate_parameter(self, module: nn.Module, name: str) -> None:
        """A replicated parameter is not split: nothing to record."""


class _ExpertRecorder:
    """Stands in for `distributed.ExpertParallel` in `MoE.shard_experts_`: records which
    parameters are split over the expert group, and splits nothing."""

    ep, tp, size, rank = 1, 1, 1, 0

    def __init__(self):
        self.experts: set[int] = set()

    def shard_parameter(self, module: nn.Module, name: str) -> None:
        self.experts.add(id(getattr(module, name)))


def _place(name: str, stacks: list[tuple[str, int]], optional: set[str]) -> tuple[int | None, frozenset[str]]:
    """(index among the stacks' layers in a row, no holders) for a layer's parameter, else (None,
    the paths of the modules only some stages hold that hold it)."""
    for path, offset in stacks:
        if name.startswith(path + "."):
            return offset + int(name[len(path) + 1:].split(".", 1)[0]), frozenset()
    holders = frozenset(path for path in optional if name == path or name.startswith(path + "."))
    if not holders:
        raise ValueError(f"parameter {name} is neither in a layer stack {[path for path, _ in stacks]} nor in a module "
                         f"the model contract places on some pipeline stages {sorted(optional)}")
    return None, holders


class ModelTable:
    """A meta-built model (it implements the model contract; unsharded) as the planner sees it;
    `float8`: ``train.fp8`` (`run_settings(cfg).fp8`), which of its linear layers compute in float8."""

    def __init__(self, model: nn.Module, float8: Float8 | None = None):
        check_trainable(model)
        #: ``train.fp8``: the linear layers `float8_weights` names compute in float8; None: none do
        self.float8 = float8
        self.model_type = type(model).__name__
        self.config = model.config
        layers = all_layers(model)
        self.num_layers = len(layers)
        attention = [[m for m in layer.modules() if isinstance(m, (Attention, LatentAttention))] for layer in layers]
        if not attention[0]:
            raise ConfigError(f"{self.model_type}'s layers hold none of the zoo's attention layers, whose sizes and "
                              f"splits the planner's time and memory models read (transformers' own models, made "
                              f"trainable, are among them): set the layout by hand (dist.dp/tp/pp, train.zero_stage)")
        #: the time model's sizes: the residual stream's width (the first layer's), the attention width
        #: (heads × head_dim) of a layer on average over the layers (an encoder-decoder's decoder layer
        #: attends twice; Swin's stages widen), and whether its attention and MLP share one tp sync
        self.hidden_size: int = attention[0][0].out.out_features
        self.attention_width: float = sum(m.attention_width for ms in attention for m in ms) / self.num_layers
        self._attention = attention[0]
        self.parallel_block = isinstance(layers[0], TransformerLayer) and layers[0].spec.parallel_block
        #: the head's outputs per token: a language model's vocabulary (0 for a classifier, whose
        #: outputs per sample are few)
        heads = [m for m in model.modules() if isinstance(m, LMHead)]
        self.vocab_size: int = heads[0].out_features if heads else \
            (model.input_limits()["vocab_size"] or 0) * (model.loss_unit == "token")
        #: the tokens of a sample when the data does not say: an image model's patches
        self.image_tokens: int | None = _image_tokens(model)
        self.flops_per_token = model.flops_per_token
        self.activations = SavedActivations(model, float8)
        self._unsharded = copy.deepcopy(model)  # the recorder below marks the model's layers as split
        self._tp_problems: dict[int, list[str]] = {}
        self._whole: dict[int, frozenset[int]] = {}
        self._float8: dict[int, frozenset[int]] = {}
        recorder = _record_splits(model, 1)
        experts = _record_experts(model)
        stacks, offset = [], 0
        for stack in model.stacks():
            stacks.append((stack.path, offset))
            offset += len(model.get_submodule(stack.path))
        #: the index of each stack's first layer among the stacks' layers in a row
        self.stack_starts: tuple[int, ...] = tuple(offset for _, offset in stacks)
        optional = optional_modules(model)
        places: dict[int, tuple[nn.Parameter, list[tuple[int | None, frozenset[str]]]]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            places.setdefault(id(param), (param, []))[1].append(_place(name, stacks, optional))
        self.parameters: list[ParameterInfo] = []
        for index, (key, (param, where)) in enumerate(places.items()):
            in_layers = {layer for layer, _ in where if layer is not None}
            if len(in_layers) > 1 or (in_layers and len(where) > 1):
                raise ValueError(f"a parameter of shape {tuple(param.shape)} is shared between layers "
                                 f"{sorted(in_layers)} or between a layer and another module: the planner places "
                                 f"each on one stage")
            self.parameters.append(ParameterInfo(
                tuple(param.shape), param.element_size(), recorder.dims.get(key),
                in_layers.pop() if in_layers else None, frozenset().union(*(held for _, held in where)),
                param.requires_grad, functools.partial(self._held_whole, index), key in experts))

        # layers whose parameters are alike (shapes, splits, trainability, float8 at tp 1: a skip
        # pattern may name some layers only) are one group, counted once
        float8_weights = self.float8_weights(1)
        signatures = [tuple((p.shape, p.tp_dim, p.requires_grad, p.expert, i in float8_weights)
                            for i, p in enumerate(self.parameters) if p.layer == index)
                      for index in range(self.num_layers)]
        distinct = list(dict.fromkeys(signatures))
        #: the parameter group of each layer of the stacks, and the first layer of each group
        self.layer_groups: tuple[int, ...] = tuple(distinct.index(s) for s in signatures)
        self.group_layers: tuple[int, ...] = tuple(signatures.index(s) for s in distinct)
        #: the Mixture-of-Experts layers: each one's (experts, experts per token); {} for a dense model
        self.moe: dict[int, tuple[int, int]] = {
            index: (module.num_experts, module.top_k) for index, layer in enumerate(layers)
            for module in layer.modules() if isinstance(module, MoE)}
        self._ep_problems: dict[tuple[int, int], list[str]] = {}
        self._layout_problems: dict[tuple[bool, int, int], list[str]] = {}
        self._stage_problems: dict[tuple[int, str, int], str | None] = {}

    def stage_holdings(self, num_stages: int) -> tuple[tuple[range, frozenset[str]], ...]:
        """Of each of `num_stages` pipeline stages (the layers split evenly): the layers it runs (indices
        among the stacks' layers in a row) and the paths of the other modules it holds, as the
        pipeline cuts it (`stage_modules`)."""
        return _stage_holdings(self, num_stages)

    def layout_problems(self, *, sequence_parallel: bool = False, cp: int = 1, ep: int = 1) -> list[str]:
        """Why the model cannot run with sequence parallelism, at this cp or this ep ([] when it can):
        its own `layout_problems`, and context parallelism's (a causal LM whose layers split a sequence)."""
        key = (sequence_parallel, cp, ep)
        if key not in self._layout_problems:
            model = self._unsharded
            problems = model.layout_problems(sequence_parallel=sequence_parallel, cp=cp, ep=ep)
            if cp > 1:
                problems += ([] if isinstance(model, CausalLM) else
                             [f"{self.model_type} is not a causal LM, whose sequences context parallelism splits"])
                problems += distributed.cp_problems(model, cp)
                if self.float8 is not None:
                    problems.append("train.fp8 takes no scale over the cp ranks a sequence is split over")
            self._layout_problems[key] = problems
        return self._layout_problems[key]

    def stage_problem(self, pp: int, schedule: str, virtual_stages: int) -> str | None:
        """Why the model's stages cannot run this pipeline (`check_stage_holdings`: carried tensors under a
        split backward, one weight twice on a rank), or None."""
        key = (pp, schedule, virtual_stages)
        if key not in self._stage_problems:
            try:
                check_stage_holdings(self._unsharded, pp, schedule=schedule, virtual_stages=virtual_stages)
                self._stage_problems[key] = None
            except ConfigError as error:
                self._stage_problems[key] = str(error)
        return self._stage_problems[key]

    @classmethod
    def from_config(cls, model_cfg: DictConfig, lora: DictConfig | dict | None = None,
                    float8: Float8 | None = None, elementwise_recompute: str = "auto") -> ModelTable:
        """Instantiate a model recipe (a LazyCall, or a from_pretrained call, which reads nothing)
        on the meta device, with the LoRA adapters ``train.lora`` puts on it (its base frozen);
        `float8`: ``train.fp8`` (`run_settings(cfg).fp8`); its layers recompute their cheap ops as
        ``train.elementwise_recompute`` says, so the activations are measured as the run keeps them."""
        with torch.device("meta"):
            model = instantiate_model(model_cfg)
            apply_lora_config(model, lora or {})
            set_elementwise_recompute(model, elementwise_recompute)
            return cls(model, float8)

    def float8_weights(self, tp: int = 1) -> frozenset[int]:
        """The parameters (indices in `parameters`) that are the weights of the linear layers
        computing in float8 at `tp` (none without `float8`): `convert_to_float8`'s own choice, its
        `kept_reason` asked of every `layers.Linear` at the per-rank weight a rank holds at that tp
        (the LM head, ``train.fp8.skip`` and the layers whose per-rank sizes are not multiples of
        16 stay in high precision)."""
        if self.float8 is None or (tp > 1 and self.tp_problems(tp)):
            return frozenset()
        if tp not in self._float8:
            self._float8[tp] = _float8_weights(self._unsharded, self.parameters, self.float8.skip, tp)
        return self._float8[tp]

    @cached_property
    def float8_gathered(self) -> frozenset[int]:
        """The parameters FSDP2 all-gathers in float8, 1 byte an element, at ZeRO 1-3 over dp × cp
        > 1 without tp (`convert_to_float8`'s ``gather_float8``): the trainable `float8_weights` at
        tp 1 under the tensorwise recipe; none under the others."""
        if self.float8 is None or self.float8.recipe != "tensorwise":
            return frozenset()
        return frozenset(i for i in self.float8_weights(1) if self.parameters[i].requires_grad)

    def float8_layer_parameters(self, tp: int) -> float:
        """Of `layer_parameters`, the elements of the weights computing in float8 at `tp` (the
        stacks' layers' `float8_weights`), on average over the layers."""
        return sum(math.prod(self.parameters[i].shape) for i in self.float8_weights(tp)
                   if self.parameters[i].layer is not None) / self.num_layers

    @cached_property
    def layer_parameters(self) -> float:
        """Elements one token multiplies in a layer of the stack, on average over the layers: an MoE
        layer's experts count top_k / num_experts of theirs (the active parameters)."""
        total = 0.0
        for param in self.parameters:
            if param.layer is not None:
                experts, top_k = self.moe.get(param.layer, (1, 1))
                total += math.prod(param.shape) * (top_k / experts if param.expert else 1)
        return total / self.num_layers

    def kv_width(self, tp: int) -> int:
        """Elements per token of the keys and values one tp rank's attention of a layer holds: what
        context parallelism all-gathers over its group (`gathered_kv_width`)."""
        return sum(gathered_kv_width(module, tp) for module in self._attention)

    @property
    def total_parameters(self) -> int:
        return sum(math.prod(p.shape) for p in self.parameters)

    def tp_problems(self, tp: int) -> list[str]:
        """Why the model cannot be split over `tp` ranks ([] when it can): the layers' own rules."""
        if tp not in self._tp_problems:
            self._tp_problems[tp] = distributed.tp_problems(self._unsharded, tp) if tp > 1 else []
        return self._tp_problems[tp]

    @cached_property
    def layer_expert_parameters(self) -> float:
        """Of `layer_parameters`, the experts' active elements (top_k of each MoE layer's experts)."""
        return sum(math.prod(p.shape) * self.moe[p.layer][1] / self.moe[p.layer][0]
                   for p in self.parameters if p.expert) / self.num_layers

    def ep_problems(self, ep: int, tp: int) -> list[str]:
        """Why the experts cannot be split over an expert group of ep × tp ranks ([] when they can;
        a dense model admits only ep = 1)."""
        if (ep, tp) not in self._ep_problems:
            if not self.moe:
                problems = [] if ep == 1 else [f"ep = {ep}: {self.model_type} has no experts to split"]
            else:
                problems = distributed.expert_problems(self._unsharded, ep, tp)
            self._ep_problems[ep, tp] = problems
        return self._ep_problems[ep, tp]

    def _held_whole(self, index: int, tp: int) -> bool:
        """Whether parameter `index`, split by tp in general, is held whole at `tp`: the layers'
        ``shard_`` run at that tp on a copy of the model, recorded (once per tp)."""
        if tp not in self._whole:
            whole: frozenset[int] = frozenset()
            if tp > 1 and not self.tp_problems(tp):
                model = copy.deepcopy(self._unsharded)
                dims = _record_splits(model, tp).dims
                ids = list(dict.fromkeys(id(p) for _, p in model.named_parameters(remove_duplicate=False)))
                whole = frozenset(i for i, key in enumerate(ids)
                                  if key not in dims and self.parameters[i].tp_dim is not None)
            self._whole[tp] = whole
        return index in self._whole[tp]


@functools.lru_cache(maxsize=1024)
def _stage_holdings(table: ModelTable, num_stages: int) -> tuple[tuple[range, frozenset[str]], ...]:
    ranges = split_layers(table.num_layers, num_stages)
    return tuple((layers, frozenset(stage_modules(table._unsharded, layers, stage == 0, stage == num_stages - 1)))
                 for stage, layers in enumerate(ranges))


def _image_tokens(model: nn.Module) -> int | None:
    """The patches an image model's embedding makes of its config's image (None for a text model)."""
    if model.main_input_name != "pixel_values":
        return None
    (height, width), (rows, columns) = (image_pair(getattr(model.config, key)) for key in ("image_size", "patch_size"))
    return (height // rows) * (width // columns)


def gathered_kv_width(attention: nn.Module, tp: int) -> int:
    """Elements per token of the keys and values a tp rank of `attention` computes (its KV heads,
    one when tp exceeds them: each rank then holds a replica; a latent attention's per-head keys
    and values of its heads)."""
    if isinstance(attention, LatentAttention):
        return attention.num_heads // tp * (attention.qk_head_dim + attention.v_head_dim)
    kv_heads = attention.num_kv_heads // tp if attention.num_kv_heads % tp == 0 else 1
    return 2 * kv_heads * attention.head_dim


def _float8_weights(model: nn.Module, parameters: list[ParameterInfo], skip: tuple[str, ...],
                    tp: int) -> frozenset[int]:
    """The indices of the weights of `model`'s linear layers that `convert_to_float8` converts at
    `tp`: at tp 1 asked of the model as built; at tp > 1 of a copy whose layers' ``shard_`` ran
    with a recorder of size tp (a replicated qkv's rows) and whose weights stand in at the shape a
    rank holds (`ParameterInfo.tp_local_shape`)."""
    if tp > 1:
        model = copy.deepcopy(model)
    index = {key: i for i, key in
             enumerate(dict.fromkeys(id(p) for _, p in model.named_parameters(remove_duplicate=False)))}
    linears = [(name, module, index[id(module.weight)]) for name, module in model.named_modules()
               if isinstance(module, Linear)]
    if tp > 1:
        _record_splits(model, tp)
        for _, module, i in linears:
            module.weight = nn.Parameter(torch.empty(parameters[i].tp_local_shape(tp), device="meta"),
                                         requires_grad=parameters[i].requires_grad)
    return frozenset(i for name, module, i in linears if kept_reason(name, module, skip) is None)


def _record_experts(model: nn.Module) -> set[int]:
    """The parameters the MoE layers' own `MoE.shard_experts_` split over the expert group (ids)."""
    recorder = _ExpertRecorder()
    for module in model.modules():
        if isinstance(module, MoE):
            module.shard_experts_(recorder)
    return recorder.experts


def _record_splits(model: nn.Module, tp: int) -> _SplitRecorder:
    """Run every parallel layer's ``shard_`` with a recorder of size `tp` (it marks the layers as
    split, splits nothing): which dimension each parameter is split along."""
    recorder = _SplitRecorder(tp)
    for module in model.modules():
        if callable(getattr(module, "shard_", None)):
            module.shard_(recorder)
    return recorder
