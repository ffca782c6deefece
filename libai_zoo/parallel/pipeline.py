"""Pipeline parallelism on `torch.distributed.pipelining`, for any model that implements the
model contract (`libai_zoo.models.TrainableModel`).

The model's layer stack (an encoder-decoder's two stacks, in a row: `TrainableModel.stacks`) is
cut into contiguous ranges, one per stage; stage s runs on pp rank
s % pp ("looped" placement, what the interleaved schedules expect), or V-shaped for ZBV. Each
stage is a pruned copy of the full model (the approach torchtitan takes): the modules the stage
does not run are left out, the layers it keeps stay under their original indices, so a stage's
parameter names are the full model's ("transformer.h.4.attn.qkv.weight") and optimizers,
clipping and sharded checkpoints see the same names whatever the pp layout. This rank's copies
are its model parts (`Pipeline.model_parts`), real modules the trainer hands to the optimizer.

    stage 0      model.embed(inputs) -> layers[0:a]
    stage s      layers[a:b]             each layer(x, **model.layer_inputs(inputs, x))
    stage S-1    layers[c:L] -> model.head_loss(model.final_norm(x), targets, "sum") x loss_scale
                 (the head and its loss inside the stage: a causal LM's in chunks of tokens)
    two stacks   the stage running the decoder's first layer: x, (enc,) = model.enter_stack(1, x, (), inputs)
                 (the decoder's embedding, the encoder's normalised output); enc then travels with x
                 through every later stage, and its gradient comes back the same way

The batch's main input (``model.main_input_name``) enters the first stage; its other inputs
(attention mask, positions, ...) go to every stage as keyword arguments, split into micro-batches
like the main input. Under tensor parallelism every tp rank of a stage runs the stage on its
shards; the activations between stages are those the layers hand to each other (replicated over
tp, or this rank's part of the sequence under sequence parallelism) and each tp rank exchanges
them with the same tp rank of the neighbouring stage, over the pp group of its (dp, tp) coordinate.

Shapes: `PipelineStage` is built without example tensors, so torch infers the shapes, dtypes
and requires_grad of everything sent between stages from the first micro-batch of the first
step (one extra forward/backward of that micro-batch per stage, outside the training graph and
with the RNG state restored). One schedule is built per set of input shapes (training and
evaluation batches differ) and kept; every rank of a pp group must therefore call
`Pipeline.step` / `eval_step` with inputs of the same shapes (they hold the same dp shard of the
data anyway).
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from libai_zoo.config import ConfigError, PipelineConfig
from libai_zoo.distributed import ContextParallel, ExpertParallel, ParallelContext, TensorParallel
from libai_zoo.layers import uncounted
from libai_zoo.models import Stack, check_trainable

from .tied_weights import SharedParameter, TiedWeights, shared_parameters


@dataclass(frozen=True)
class _ScheduleKind:
    cls: type
    multi: bool  # several stages per rank (takes a list of stages)
    placement: str  # "loop": rank r holds stages r, r + pp, ...; "v": rank r holds r and 2 pp - 1 - r
    min_virtual: int
    max_virtual: int | None
    #: The schedule that evaluates (forward only) the same stages; None: the training one. torch's
    #: zero-bubble schedules run their backward actions in `eval` too and fail there; no torch
    #: schedule runs V-placed stages forward only, so "zbv" cannot evaluate.
    eval_cls: type | None = None
    evaluates: bool = True
    #: Backward split into input and weight gradients (zero bubble): the weight gradients come
    #: after FSDP's backward hooks, so parameters must stay gathered through the step.
    split_backward: bool = False


_KINDS: dict[str, _ScheduleKind] = {
    "gpipe": _ScheduleKind(ScheduleGPipe, False, "loop", 1, 1),
    "1f1b": _ScheduleKind(Schedule1F1B, False, "loop", 1, 1),
    "interleaved_1f1b": _ScheduleKind(ScheduleInterleaved1F1B, True, "loop", 2, None),
    "zero_bubble": _ScheduleKind(ScheduleInterleavedZeroBubble, True, "loop", 1, None,
                                 eval_cls=ScheduleInterleaved1F1B, split_backward=True),
    "zbv": _ScheduleKind(ScheduleZBVZeroBubble, True, "v", 2, 2, evaluates=False, split_backward=True),
}

#: Schedule name -> torch schedule class.
SCHEDULES: dict[str, type] = {name: kind.cls for name, kind in _KINDS.items()}


def split_layers(num_layers: int, num_stages: int, boundaries: list[int] | None = None) -> list[range]:
    """The contiguous range of layers each of `num_stages` stages runs.

    Without `boundaries` the split balances the number of transformer layers only: ranges differ
    by at most one layer and the longer ones come first. The first stage also runs the embedding
    and the last stage the final norm, the LM head and the loss, which this count ignores; the
    last stage getting the shorter range partly makes up for its head. Pass `boundaries` (the
    first layer index of stages 1..S-1, as Megatron-LM's and torchtitan's manual splits) to give
    the end stages fewer layers, e.g. ``[3, 7, 11]`` for 14 layers on 4 stages.
    """
    if num_stages < 1:
        raise ConfigError(f"the number of pipeline stages must be positive, got {num_stages}")
    if num_stages > num_layers:
        raise ConfigError(f"pp × virtual stages = {num_stages} is larger than the number of layers {num_layers}: "
                          f"every stage needs at least one layer; lower pp or the virtual stages per rank")
    if boundaries is None:
        per_stage, extra = divmod(num_layers, num_stages)
        sizes = [per_stage + (s < extra) for s in range(num_stages)]
        starts = [sum(sizes[:s]) for s in range(num_stages)]
        return [range(start, start + size) for start, size in zip(starts, sizes)]
    boundaries = [int(b) for b in boundaries]
    if len(boundaries) != num_stages - 1:
        raise ConfigError(f"boundaries {boundaries} must give the first layer of stages 1..{num_stages - 1}: "
                          f"{num_stages - 1} indices for {num_stages} stages, got {len(boundaries)}")
    edges = [0, *boundaries, num_layers]
    if any(a >= b for a, b in zip(edges, edges[1:])):
        raise ConfigError(f"boundaries {boundaries} must increase strictly within 1..{num_layers - 1} "
                          f"({num_layers} layers), so that every stage holds at least one layer")
    return [range(a, b) for a, b in zip(edges, edges[1:])]


class StageLayers(nn.ModuleList):
    """The layers of one stage, registered under their indices in the full model.

    Iterating yields the layers in order; ``stage_layers[i]`` is layer i of the full model
    (an original index, not a position); parameter names keep the original index
    ("h.4.attn.qkv.weight"). The slice is fixed: appending or inserting is not supported.
    """

    def __init__(self, layers: dict[int, nn.Module]):
        nn.Module.__init__(self)
        for index, layer in layers.items():
            self.add_module(str(index), layer)

    @property
    def indices(self) -> list[int]:
        return [int(name) for name in self._modules]

    def __getitem__(self, index):
        if isinstance(index, slice):
            raise TypeError("StageLayers holds a fixed slice of the full model's layers: index it by layer index")
        try:
            return self._modules[str(int(index))]
        except KeyError:
            raise IndexError(f"layer {index} is not in this stage (it holds layers {self.indices})") from None

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

    def _fixed(self, *args, **kwargs):
        raise TypeError("StageLayers holds a fixed slice of the full model's layers")

    append = extend = insert = pop = __setitem__ = __delitem__ = __iadd__ = __add__ = _fixed
    __repr__ = nn.Module.__repr__  # ModuleList's would number the layers by position


def _full_stacks(model: nn.Module) -> list[tuple[Stack, nn.ModuleList]]:
    """Every stack of a model that implements the contract, with its whole layer list; a
    TypeError/ValueError otherwise."""
    check_trainable(model)
    stacks = [(stack, model.get_submodule(stack.path)) for stack in model.stacks()]
    for stack, layers in stacks:
        if isinstance(layers, StageLayers):
            raise ValueError(f"{type(model).__name__}.{stack.path} is a pipeline stage's slice of the layers: "
                             f"pass the full model")
    return stacks


def _stack_ranges(stacks: list[tuple[Stack, nn.ModuleList]], layer_range: range) -> list[tuple[int, range]]:
    """(stack index, the stack's own layer indices) of each stack `layer_range` (indices into the
    stacks' layers in a row) runs, in order."""
    parts, start = [], 0
    for index, (_, layers) in enumerate(stacks):
        own = range(max(layer_range.start, start) - start, min(layer_range.stop, start + len(layers)) - start)
        if own:
            parts.append((index, own))
        start += len(layers)
    return parts


def _shared_handles(model: nn.Module) -> dict[int, object]:
    """deepcopy memo entries that keep meshes and tp, ep and cp handles (holding process groups) shared."""
    memo: dict[int, object] = {}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, (TensorParallel, ExpertParallel, ContextParallel, DeviceMesh, dist.ProcessGroup)):
                memo[id(value)] = value
        for param in module.parameters(recurse=False):
            if isinstance(param, DTensor):
                memo[id(param.device_mesh)] = param.device_mesh
    return memo


def stage_modules(model: nn.Module, layer_range: range, is_first: bool, is_last: bool) -> set[str]:
    """The paths of the modules besides its layers that a stage running `layer_range` holds: the
    first stage's, the last stage's, the entry modules of a later stack whose first layer it runs
    and the shared modules of every stack it runs a layer of."""
    stacks = _full_stacks(model)
    held = set(model.first_stage_modules if is_first else ()) | set(model.last_stage_modules if is_last else ())
    for index, own in _stack_ranges(stacks, layer_range):
        stack = stacks[index][0]
        held |= set(stack.shared_modules) | set(stack.entry_modules if index and own.start == 0 else ())
    return held


def optional_modules(model: nn.Module) -> set[str]:
    """Every module path that only some stages hold."""
    return {*model.first_stage_modules, *model.last_stage_modules,
            *(path for stack in model.stacks() for path in (*stack.entry_modules, *stack.shared_modules))}


def prune_for_stage(model: nn.Module, layer_range: range, is_first: bool, is_last: bool) -> nn.Module:
    """A copy of `model` holding only what one stage runs, with the full model's parameter names.

    `layer_range` indexes the model's stacks' layers in a row (one stack: its layers). Each stack
    the stage runs becomes a `StageLayers` of its layers in the range under their original indices
    (the others are empty); of the modules only some stages hold (`stage_modules`), the others are
    None (a module registered under several paths is kept under those the stage holds: T5's shared
    table is `shared` on the first stage, `decoder.embed_tokens` on the decoder's first). Modules
    left out are never copied. Process groups, meshes and tp, ep and cp handles are shared with
    `model`. A weight several of those modules share (a tied embedding and head) stays one
    Parameter within a stage; each stage that holds it gets its own copy.
    """
    stacks = _full_stacks(model)
    total = sum(len(layers) for _, layers in stacks)
    if not layer_range or layer_range.start < 0 or layer_range.stop > total:
        raise ValueError(f"layer range {layer_range} is empty or outside the {total} layers of the model")
    memo = _shared_handles(model)
    own = dict(_stack_ranges(stacks, layer_range))
    dropped = [layer for index, (_, layers) in enumerate(stacks) for i, layer in enumerate(layers)
               if i not in own.get(index, ())]
    held_paths = stage_modules(model, layer_range, is_first, is_last)
    held = {id(model.get_submodule(path)) for path in held_paths}
    dropped += [module for path in optional_modules(model) if id(module := model.get_submodule(path)) not in held]
    for module in dropped:
        memo[id(module)] = None  # deepcopy returns None for it: left out, never copied
    pruned = copy.deepcopy(model, memo)
    for path in optional_modules(model) - held_paths:  # a module held under another path keeps only that one
        owner, _, name = path.rpartition(".")
        if pruned.get_submodule(owner)._modules.get(name) is not None:
            setattr(pruned.get_submodule(owner), name, None)
    for index, (stack, _) in enumerate(stacks):
        owner, _, name = stack.path.rpartition(".")
        stack_owner = pruned.get_submodule(owner)
        copied = getattr(stack_owner, name)
        setattr(stack_owner, name, StageLayers({i: copied[i] for i in own.get(index, ())}))
    return pruned


#: The keyword under which every stage gets its micro-batch's targets (the last stage scores them).
TARGETS = "pipeline_targets"


@dataclass(frozen=True)
class PipelineStepResult:
    """What `Pipeline.step` did, the same on every rank of the pp group: the sum over micro-batches
    of their losses (each × the step's `loss_scale`) without the auxiliary terms, and a Mixture of
    Experts' mean auxiliary loss (None for a model without one)."""

    loss: float
    aux_loss: float | None


class PipelineStageModule(nn.Module):
    """One pipeline stage: ``model`` is the pruned copy (full-model parameter names).

    forward(x, **inputs): the first stage embeds the main input x (with the other inputs); then the
    stage's layers (of a later stack whose first layer it runs, after `enter_stack`: the tensors it
    carries, an encoder's output, then travel to every later stage beside x); the last stage returns the micro-batch's loss, summed over its targets
    (``inputs[TARGETS]``) and times `loss_scale`: the head runs inside the stage, where FSDP has
    gathered its weights, and a causal LM never holds all its logits. A Mixture of Experts' routing
    statistics travel between stages beside x (forward(x, stats, **inputs)), so the last stage adds
    the auxiliary loss of all the layers, as one process computes it.
    """

    def __init__(self, model: nn.Module, stage_index: int, num_stages: int, layer_range: range):
        super().__init__()
        self.model = model
        self.stage_index, self.num_stages, self.layer_range = stage_index, num_stages, layer_range
        self.loss_scale = 1.0
        #: The weight of each micro-batch's auxiliary loss (1 / micro-batches: their mean), and the
        #: auxiliary losses the last stage added in this step.
        self.aux_scale = 1.0
        self.aux_losses: list[torch.Tensor] = []
        #: The next forward is torch's shape inference for a new schedule (its first step runs one
        #: extra forward per stage, on the first micro-batch or on empty tensors).
        self.metadata_pass = False

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def forward(self, x: torch.Tensor, *carried: torch.Tensor,
                **inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self.metadata_pass:  # torch's shape inference, on empty tensors: no routing to count
            self.metadata_pass = False
            with uncounted(self.model):
                return self._forward(x, *carried, record=False, **inputs)
        return self._forward(x, *carried, record=True, **inputs)

    def _forward(self, x: torch.Tensor, *extra: torch.Tensor, record: bool,
                 **inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        model = self.model
        targets = inputs.pop(TARGETS)
        stacks = model.stacks()
        runs = [(k, layers) for k, stack in enumerate(stacks) if len(layers := model.get_submodule(stack.path))]
        carried: tuple[torch.Tensor, ...] = ()
        if self.is_first:
            first_inputs = {model.main_input_name: x, **inputs}
            stats = model.router_stats(first_inputs)
            if stats is not None:  # a leaf that asks for a gradient, so every stage sends one back
                stats.requires_grad_(True)
            x = model.embed(first_inputs)
        else:  # what the previous stage sent: x, the carried tensors of the stack it ran, the statistics
            k, layers = runs[0]
            count = stacks[k - 1 if k and layers.indices[0] == 0 else k].carries
            carried, rest = extra[:count], extra[count:]
            stats = rest[0] if rest else None
        for k, layers in runs:
            if k and layers.indices[0] == 0:
                x, carried = model.enter_stack(k, x, carried, inputs)
            layer_inputs = model.stack_layer_inputs(k, inputs, x, carried)
            for layer in layers:
                if stats is None:
                    x = layer(x, **layer_inputs)
                else:
                    x, stats = layer(x, **layer_inputs, router_stats=stats)
        if not self.is_last:
            # a carried tensor passes on as a copy: a node of this stage's graph (not a view, which the
            # zero-bubble schedules cannot detach in place), its gradient the later stages' and this one's
            sent = (x, *(t.clone() for t in carried), *(() if stats is None else (stats,)))
            return sent if len(sent) > 1 else x
        loss = model.head_loss(model.final_norm(x), targets, reduction="sum") * self.loss_scale
        if stats is not None and self.training and model.has_aux_loss:
            aux = model.aux_loss(stats)
            if record:
                self.aux_losses.append(aux.detach())
            loss = loss + aux * self.aux_scale
        return loss

    def extra_repr(self) -> str:
        return (f"stage {self.stage_index} of {self.num_stages}, layers {self.layer_range.start}.."
                f"{self.layer_range.stop - 1}")


def stage_shared_parameters(model: nn.Module, layer_ranges: list[range]) -> list[SharedParameter]:
    """The parameters more than one of the stages running `layer_ranges` hold, through the modules
    besides their layers that they hold (`stage_modules`)."""
    last = len(layer_ranges) - 1
    return shared_parameters(model, [stage_modules(model, r, s == 0, s == last) for s, r in enumerate(layer_ranges)])


def splits_backward(schedule: str) -> bool:
    """Whether `schedule` computes input and weight gradients apart (the zero-bubble ones): a
    checkpointed layer is then recomputed for each, and FSDP keeps parameters gathered."""
    return _KINDS[schedule].split_backward


def schedule_evaluates(schedule: str) -> bool:
    """Whether a run with `schedule` can evaluate (torch has no forward-only schedule for ZBV)."""
    return _KINDS[schedule].evaluates


def stage_ranks(pp: int, schedule: str, virtual_stages: int = 1) -> list[int]:
    """The pp rank that runs each of the ``pp × virtual_stages`` stages under `schedule`."""
    return _stage_ranks(pp, pp * virtual_stages, _KINDS[schedule].placement)


def _stage_ranks(pp: int, num_stages: int, placement: str) -> list[int]:
    """pp rank of every stage."""
    if placement == "loop":
        return [s % pp for s in range(num_stages)]
    return [s if s < pp else 2 * pp - 1 - s for s in range(num_stages)]  # "v": 0..pp-1 then back


def _check_micro_batches(name: str, n: int, pp: int) -> None:
    if n < 1:
        raise ConfigError(f"num_micro_batches must be at least 1, got {n}")
    if name == "1f1b" and n < pp:
        raise ConfigError(f"1F1B needs at least pp = {pp} micro-batches per step, got {n}: "
                          f"raise train.global_batch_size or lower micro_batch_size")
    if name in ("interleaved_1f1b", "zero_bubble"):
        rounds = max(1, n // pp)
        if n % rounds:
            raise ConfigError(
                f"{name} runs the micro-batches in rounds of about pp = {pp}: torch needs num_micro_batches "
                f"divisible by the number of rounds max(1, num_micro_batches // pp) = {rounds}, got {n}; "
                f"use a multiple of pp = {pp} (or fewer than 2 × pp)")


def check_pipeline_layout(num_layers: int, pp: int, *, schedule: str, num_micro_batches: int,
                          virtual_stages: int = PipelineConfig.virtual_stages,
                          boundaries: Sequence[int] | None = None) -> None:
    """Refuse a pipeline layout that cannot run (a ConfigError that names the fix); needs no process
    group, so a run can be refused before it starts one."""
    if schedule not in _KINDS:
        raise ConfigError(f"unknown pipeline schedule {schedule!r}: choose one of {sorted(_KINDS)}")
    kind = _KINDS[schedule]
    if virtual_stages < kind.min_virtual or (kind.max_virtual is not None and virtual_stages > kind.max_virtual):
        wanted = (f"exactly {kind.min_virtual}" if kind.min_virtual == kind.max_virtual
                  else f"at least {kind.min_virtual}")
        raise ConfigError(f"schedule {schedule!r} runs {wanted} virtual stage(s) per rank, got "
                          f"virtual_stages={virtual_stages}")
    _check_micro_batches(schedule, num_micro_batches, pp)
    split_layers(num_layers, pp * virtual_stages, boundaries)


def check_stage_holdings(model: nn.Module, pp: int, *, schedule: str,
                         virtual_stages: int = PipelineConfig.virtual_stages,
                         boundaries: Sequence[int] | None = None) -> None:
    """Refuse a pipeline of several stacks that cannot run (a ConfigError naming the fix; no process
    group needed): a zero-bubble schedule's split backward with tensors carried between stages (torch
    runs the second, weight pass through a graph the first freed), and a rank holding two stages that
    hold one weight under one name (T5's position bias on two of its encoder stages): its optimizer
    and checkpoints know a weight by its name, once."""
    stacks = _full_stacks(model)
    num_stages = pp * virtual_stages
    ranges = split_layers(sum(len(layers) for _, layers in stacks), num_stages, boundaries)
    carrying = [s for s, r in enumerate(ranges[:-1]) if any(stacks[k][0].carries for k, _ in _stack_ranges(stacks, r))]
    if _KINDS[schedule].split_backward and carrying:
        raise ConfigError(f"schedule {schedule!r} splits backward into input and weight passes, which torch cannot "
                          f"run through the tensors {type(model).__name__}'s stages {carrying} send on (the encoder's "
                          f"output): choose 1f1b, interleaved_1f1b or gpipe, or boundaries that put the whole decoder "
                          f"on the last stage")
    ranks = _stage_ranks(pp, num_stages, _KINDS[schedule].placement)
    for shared in stage_shared_parameters(model, ranges):
        held = Counter((ranks[stage], name) for stage, name in shared.names.items())
        (rank, name), copies = held.most_common(1)[0]
        if copies > 1:
            stages = [stage for stage, other in shared.names.items() if (ranks[stage], other) == (rank, name)]
            raise ConfigError(f"{name} is held by pipeline stages {stages}, all on pp rank {rank}: a rank holds a "
                              f"weight once by its name; choose 1f1b or gpipe (one stage per rank), or boundaries "
                              f"(train.pipeline.boundaries) under which no stack spans more than pp stages")


class Pipeline:
    """This rank's share of a model run pipelined: its stages' model parts and the schedule that
    runs them.

    ``model`` is the full model (it implements the model contract), usually still on the meta
    device (the trainer fills the stages afterwards: `materialize`) and not yet split over tp
    (`parallelize` shards each stage after the cut); this rank's stages are pruned copies of it (stage s on pp rank s % pp
    for the looped schedules; V-shaped for "zbv"), which hold no memory of ``model``'s. ``virtual_stages`` is the
    number of stages per rank (1 for "gpipe"/"1f1b", >= 2 for "interleaved_1f1b", >= 1 for
    "zero_bubble", exactly 2 for "zbv"). ``boundaries``: see `split_layers`.

    Constraints (checked here, before the first step): pp × virtual_stages ≤ number of layers;
    "1f1b" needs num_micro_batches ≥ pp; "interleaved_1f1b" and "zero_bubble" need
    num_micro_batches divisible by max(1, num_micro_batches // pp) (torch's rounds: any multiple
    of pp works, and so does any count below 2 × pp); the local batch must divide into
    num_micro_batches (checked at each step).

    A step: ``result = pipeline.step(inputs, targets, loss_scale)`` on every rank (the model's
    `split_batch` of the local batch; repeat for gradient accumulation), then once before the
    optimizer: `distributed.finalize_grads` on each of `model_parts` under sequence parallelism,
    `tied.sync_grads()`, clipping (counting `tied.duplicates()` once) and the optimizer step over
    the parts' parameters. Data parallelism wraps each of `stages` (FSDP2: `DataParallel.wrap`);
    the schedule then reduces a stage's gradients over dp once, after its last micro-batch.
    """

    def __init__(self, model: nn.Module, ctx: ParallelContext, *, schedule: str = PipelineConfig.schedule,
                 num_micro_batches: int, virtual_stages: int = PipelineConfig.virtual_stages,
                 boundaries: Sequence[int] | None = None):
        num_layers = sum(len(layers) for _, layers in _full_stacks(model))
        problems = model.pipeline_problems()
        if problems:
            raise ConfigError(f"{type(model).__name__} cannot run at pp = {ctx.pp}: " + "; ".join(problems))
        check_pipeline_layout(num_layers, ctx.pp, schedule=schedule, num_micro_batches=num_micro_batches,
                              virtual_stages=virtual_stages, boundaries=boundaries)
        check_stage_holdings(model, ctx.pp, schedule=schedule, virtual_stages=virtual_stages, boundaries=boundaries)
        if ctx.mesh is None:
            raise ValueError("a pipeline needs a process group: launch with torchrun and distributed.init(pp=...)")
        kind = _KINDS[schedule]
        self.ctx, self.schedule_name, self.kind = ctx, schedule, kind
        self.pp, self.pp_rank, self.pp_group = ctx.pp, ctx.pp_rank, ctx.group("pp")
        self.num_micro_batches = num_micro_batches
        self.num_stages = ctx.pp * virtual_stages
        self.layer_ranges = split_layers(num_layers, self.num_stages, boundaries)
        self.stage_ranks = _stage_ranks(self.pp, self.num_stages, kind.placement)
        self.stages = [
            PipelineStageModule(prune_for_stage(model, self.layer_ranges[s], s == 0, s == self.num_stages - 1),
                                s, self.num_stages, self.layer_ranges[s])
            for s in range(self.num_stages) if self.stage_ranks[s] == self.pp_rank]
        #: This rank's pruned copies of the model, one per local stage: what the optimizer,
        #: clipping and checkpoints take.
        self.model_parts: list[nn.Module] = [stage.model for stage in self.stages]
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)
        self.last_stage_rank = self.stage_ranks[-1]
        self.main_input_name = model.main_input_name
        self.has_aux_loss = model.has_aux_loss

        #: Weights several stages hold (an embedding and its LM head): their copies' gradients are
        #: summed over the pp ranks holding them (`TiedWeights.sync_grads`).
        self.tied = TiedWeights(stage_shared_parameters(model, self.layer_ranges) if self.num_stages > 1 else [],
                                {stage.stage_index: stage.model for stage in self.stages}, self.stage_ranks, ctx)
        self._schedules: dict[tuple, object] = {}

    # ---- one training step
    @staticmethod
    def _loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: the last stage has already computed its micro-batch's loss."""
        return outputs

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule computes weight gradients apart from input gradients (zero bubble)."""
        return self.kind.split_backward

    @property
    def evaluates(self) -> bool:
        """Whether `eval_step` runs under this schedule (not under "zbv")."""
        return self.kind.evaluates

    def _schedule_for(self, train: bool, shapes: tuple) -> object:
        """The training or evaluation schedule for inputs of these shapes, built (and its shapes
        inferred) once per shape."""
        if (train, shapes) not in self._schedules:
            device, group = self.ctx.device, self.pp_group
            stages = [PipelineStage(stage, stage.stage_index, self.num_stages, device, group=group)
                      for stage in self.stages]
            for stage in self.stages:
                stage.metadata_pass = train  # evaluation infers shapes without gradients: nothing is counted
            kwargs = dict(n_microbatches=self.num_micro_batches, loss_fn=self._loss, scale_grads=False)
            cls, multi = self.kind.cls, self.kind.multi
            if not train and self.kind.eval_cls is not None:  # one local stage: GPipe runs it forward only
                cls, multi = (self.kind.eval_cls, True) if len(stages) > 1 else (ScheduleGPipe, False)
            self._schedules[train, shapes] = cls(stages if multi else stages[0], **kwargs)
        return self._schedules[train, shapes]

    def _run(self, train: bool, inputs: dict[str, torch.Tensor], targets: torch.Tensor,
             loss_scale: float) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the sum of the micro-batch losses without the auxiliary terms, the mean auxiliary loss or
        None) on the rank of the last stage; (None, None) elsewhere."""
        main = inputs.get(self.main_input_name)
        if main is None:
            raise ValueError(f"the batch has no {self.main_input_name!r}, the input the first stage embeds "
                             f"(it has {sorted(inputs)})")
        if main.shape[0] % self.num_micro_batches or targets.shape[0] != main.shape[0]:
            raise ValueError(f"the local batch of {main.shape[0]} samples ({targets.shape[0]} targets) does not split "
                             f"into num_micro_batches = {self.num_micro_batches} equal micro-batches")
        if not train and not self.evaluates:
            raise ValueError(f"schedule {self.schedule_name!r} cannot evaluate (no torch schedule runs V-placed "
                             f"stages forward only): train with another schedule, or without dataloader.test")
        shapes = tuple((key, tuple(value.shape)) for key, value in sorted(inputs.items()))
        schedule = self._schedule_for(train, shapes)
        for stage in self.stages:
            stage.loss_scale, stage.aux_scale = float(loss_scale), 1.0 / self.num_micro_batches
            stage.aux_losses.clear()
        device = self.ctx.device
        args = (main.to(device),) if self.has_first else ()
        others = {key: value.to(device) for key, value in inputs.items() if key != self.main_input_name}
        others[TARGETS] = targets.to(device)
        target = others[TARGETS] if self.has_last else None
        losses: list[torch.Tensor] = []
        if train:
            schedule.step(*args, target=target, losses=losses, return_outputs=False, **others)
        else:
            schedule.eval(*args, target=target, losses=losses, return_outputs=False, **others)
        if not self.has_last:
            return None, None
        summed = torch.stack([loss.detach() for loss in losses]).sum()
        aux = [a for stage in self.stages for a in stage.aux_losses]
        if not aux:
            return summed, None
        aux_loss = torch.stack(aux).mean()  # the step's mean auxiliary loss, and the losses without it
        return summed - aux_loss, aux_loss

    def step(self, inputs: dict[str, torch.Tensor], targets: torch.Tensor, loss_scale: float) -> PipelineStepResult:
        """Forward and backward of this rank's stages over the local batch, split into
        num_micro_batches. Each micro-batch's loss is the sum over its targets times `loss_scale`;
        gradients accumulate into ``.grad`` (summed over micro-batches). Every rank of the pp group
        passes inputs of the same shapes and gets the same result (broadcast from the last stage)."""
        loss, aux_loss = self._run(True, inputs, targets, loss_scale)
        return PipelineStepResult(self._broadcast(loss), self._broadcast(aux_loss) if self.has_aux_loss else None)

    def eval_step(self, inputs: dict[str, torch.Tensor], targets: torch.Tensor) -> float:
        """Forward only: the sum of the local batch's losses over its targets, on every rank of the pp group."""
        return self._broadcast(self._run(False, inputs, targets, 1.0)[0])

    def _broadcast(self, loss: torch.Tensor | None) -> float:
        """The last stage's value of `loss` on every rank of the pp group (call it on all of them)."""
        value = torch.zeros(1, dtype=torch.float64, device=self.ctx.device)
        if loss is not None:
            value.fill_(float(loss))
        dist.broadcast(value, group=self.pp_group, group_src=self.last_stage_rank)
        return value.item()

    def __repr__(self) -> str:
        local = ", ".join(f"{s.stage_index}: layers {s.layer_range.start}..{s.layer_range.stop - 1}"
                          for s in self.stages)
        return (f"Pipeline(schedule={self.schedule_name}, pp={self.pp}, stages={self.num_stages}, "
                f"micro_batches={self.num_micro_batches}, pp_rank={self.pp_rank} holds {{{local}}})")

