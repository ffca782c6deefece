"""Pipeline parallelism for the causal LMs on `torch.distributed.pipelining`.

The layer stack of a causal LM (GPT2LMHeadModel, LlamaForCausalLM) is cut into contiguous
ranges, one per stage; stage s runs on pp rank s % pp ("looped" placement, what the interleaved
schedules expect), or V-shaped for ZBV. Each stage is a pruned copy of the full model
(the approach torchtitan takes): the modules the stage does not run are left out, the layers it
keeps stay under their original indices, so a stage's parameter names are the full model's
("transformer.h.4.attn.qkv.weight") and optimizers, clipping and sharded checkpoints see the
same names whatever the pp layout.

    stage 0      embed(input_ids) -> layers[0:a]
    stage s      layers[a:b]
    stage S-1    layers[c:L] -> final_norm -> LM head (local, vocabulary-parallel logits)
                 -> vocab-parallel cross entropy (sum over tokens) x loss_scale

Under tensor parallelism every tp rank of a stage runs the stage on its shards; the activations
between stages are those the layers hand to each other (replicated over tp, or this rank's part
of the sequence under sequence parallelism) and each tp rank exchanges them with the same tp
rank of the neighbouring stage, over the pp group of its (dp, tp) coordinate.

Shapes: `PipelineStage` is built without example tensors, so torch infers the shapes, dtypes
and requires_grad of everything sent between stages from the first micro-batch of the first
step (one extra forward/backward of that micro-batch per stage, outside the training graph and
with the RNG state restored). One schedule is built per local batch shape (training and
evaluation batches differ) and kept; every rank of a pp group must therefore call
`Pipeline.step` / `eval_step` with a batch of the same shape (they hold the same dp shard of the
data anyway).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor

from libai_zoo.dist import ParallelContext, TensorParallel
from libai_zoo.layers import Linear, ParallelCrossEntropy

try:  # newer schedules; absent from older torch releases
    from torch.distributed.pipelining import ScheduleInterleavedZeroBubble
except ImportError:  # pragma: no cover
    ScheduleInterleavedZeroBubble = None
try:
    from torch.distributed.pipelining import ScheduleZBVZeroBubble
except ImportError:  # pragma: no cover
    ScheduleZBVZeroBubble = None


@dataclass(frozen=True)
class _ScheduleKind:
    cls: type
    multi: bool  # several stages per rank (takes a list of stages)
    placement: str  # "loop": rank r holds stages r, r + pp, ...; "v": rank r holds r and 2 pp - 1 - r
    min_virtual: int
    max_virtual: int | None


_KINDS: dict[str, _ScheduleKind] = {
    "gpipe": _ScheduleKind(ScheduleGPipe, False, "loop", 1, 1),
    "1f1b": _ScheduleKind(Schedule1F1B, False, "loop", 1, 1),
    "interleaved_1f1b": _ScheduleKind(ScheduleInterleaved1F1B, True, "loop", 2, None),
}
if ScheduleInterleavedZeroBubble is not None:
    _KINDS["zero_bubble"] = _ScheduleKind(ScheduleInterleavedZeroBubble, True, "loop", 1, None)
if ScheduleZBVZeroBubble is not None:
    _KINDS["zbv"] = _ScheduleKind(ScheduleZBVZeroBubble, True, "v", 2, 2)

#: Schedule name -> torch schedule class (only those the installed torch has).
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
        raise ValueError(f"the number of pipeline stages must be positive, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(f"pp × virtual stages = {num_stages} is larger than the number of layers {num_layers}: "
                         f"every stage needs at least one layer; lower pp or the virtual stages per rank")
    if boundaries is None:
        per_stage, extra = divmod(num_layers, num_stages)
        sizes = [per_stage + (s < extra) for s in range(num_stages)]
        starts = [sum(sizes[:s]) for s in range(num_stages)]
        return [range(start, start + size) for start, size in zip(starts, sizes)]
    boundaries = [int(b) for b in boundaries]
    if len(boundaries) != num_stages - 1:
        raise ValueError(f"boundaries {boundaries} must give the first layer of stages 1..{num_stages - 1}: "
                         f"{num_stages - 1} indices for {num_stages} stages, got {len(boundaries)}")
    edges = [0, *boundaries, num_layers]
    if any(a >= b for a, b in zip(edges, edges[1:])):
        raise ValueError(f"boundaries {boundaries} must increase strictly within 1..{num_layers - 1} "
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

    def __setitem__(self, index, module: nn.Module) -> None:
        """Replace layer `index` (an original index this stage holds), e.g. by a wrapped layer."""
        self[index]  # IndexError unless held
        self.add_module(str(int(index)), module)

    def _fixed(self, *args, **kwargs):
        raise TypeError("StageLayers holds a fixed slice of the full model's layers")

    append = extend = insert = pop = __delitem__ = __iadd__ = __add__ = _fixed
    __repr__ = nn.Module.__repr__  # ModuleList's would number the layers by position


def _causal_lm_parts(model: nn.Module) -> tuple[str, nn.Module, nn.ModuleList]:
    """(prefix, body, layer stack) of a causal LM a pipeline can cut; a ValueError otherwise."""
    prefix = getattr(model, "base_model_prefix", None)
    body = getattr(model, prefix, None) if isinstance(prefix, str) else None
    needs = ("layers_name", "first_stage_modules", "last_stage_modules", "embed", "final_norm")
    missing = [n for n in needs if body is None or getattr(body, n, None) is None]
    head = getattr(model, "lm_head", None)
    if body is None or missing or not isinstance(head, Linear) or not hasattr(head, "loss_fn"):
        raise ValueError(
            f"a pipeline runs a causal LM (GPT2LMHeadModel, LlamaForCausalLM): a model whose body under "
            f"`base_model_prefix` has embed/final_norm, names its layer stack (layers_name) and its first/last "
            f"stage modules, and whose `lm_head` is a layers.LMHead; {type(model).__name__} "
            + ("has no such body" if body is None else f"lacks {missing}" if missing else "has no LMHead lm_head"))
    layers = getattr(body, body.layers_name, None)
    if not isinstance(layers, nn.ModuleList) or isinstance(layers, StageLayers):
        raise ValueError(f"{type(model).__name__}.{prefix}.{body.layers_name} is not the full layer stack "
                         f"(an nn.ModuleList): pass the full model, not a pipeline stage")
    return prefix, body, layers


def _shared_handles(model: nn.Module) -> dict[int, object]:
    """deepcopy memo entries that keep meshes and tp handles (holding process groups) shared."""
    memo: dict[int, object] = {}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, (TensorParallel, DeviceMesh, torch_dist.ProcessGroup)):
                memo[id(value)] = value
        for param in module.parameters(recurse=False):
            if isinstance(param, DTensor):
                memo[id(param.device_mesh)] = param.device_mesh
    return memo


def prune_for_stage(model: nn.Module, layer_range: range, is_first: bool, is_last: bool) -> nn.Module:
    """A copy of `model` holding only what one stage runs, with the full model's parameter names.

    The layer stack becomes a `StageLayers` of the layers in `layer_range` under their original
    indices; the body's ``first_stage_modules`` (embeddings) are None unless `is_first`, its
    ``last_stage_modules`` (final norm) and ``lm_head`` are None unless `is_last`. Modules left
    out are never copied. Process groups, meshes and tp handles are shared with `model`.
    A weight tied between embedding and head stays one Parameter when the stage is both first and
    last; otherwise the stage that keeps one end gets its own copy of it.
    """
    prefix, body, layers = _causal_lm_parts(model)
    if not layer_range or layer_range.start < 0 or layer_range.stop > len(layers):
        raise ValueError(f"layer range {layer_range} is empty or outside the {len(layers)} layers of the model")
    memo = _shared_handles(model)
    dropped = [layers[i] for i in range(len(layers)) if i not in layer_range]
    if not is_first:
        dropped += [getattr(body, name) for name in body.first_stage_modules]
    if not is_last:
        dropped += [getattr(body, name) for name in body.last_stage_modules] + [model.lm_head]
    for module in dropped:
        if module is not None:
            memo[id(module)] = None  # deepcopy returns None for it: left out, never copied
    pruned = copy.deepcopy(model, memo)
    pruned_body = getattr(pruned, prefix)
    copied = getattr(pruned_body, body.layers_name)
    setattr(pruned_body, body.layers_name, StageLayers({i: copied[i] for i in layer_range}))
    return pruned


class PipelineStageModule(nn.Module):
    """One pipeline stage: ``model`` is the pruned copy (full-model parameter names).

    forward(x): the first stage takes input_ids and embeds them; then the stage's layers; the last
    stage applies the final norm and returns the LM head's local logits (vocabulary-split under
    tp; the loss is computed on them without gathering).
    """

    def __init__(self, model: nn.Module, stage_index: int, num_stages: int, layer_range: range):
        super().__init__()
        self.model = model
        self.stage_index, self.num_stages, self.layer_range = stage_index, num_stages, layer_range
        self._prefix = model.base_model_prefix
        self._layers_name = getattr(model, self._prefix).layers_name

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def body(self) -> nn.Module:
        return getattr(self.model, self._prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        body = self.body
        if self.is_first:
            x = body.embed(x)
        for layer in getattr(body, self._layers_name):
            x = layer(x)
        if self.is_last:
            x = Linear.forward(self.model.lm_head, body.final_norm(x))  # local logits: no all-gather
        return x

    def extra_repr(self) -> str:
        return (f"stage {self.stage_index} of {self.num_stages}, layers {self.layer_range.start}.."
                f"{self.layer_range.stop - 1}")


def _stage_ranks(pp: int, num_stages: int, placement: str) -> list[int]:
    """pp rank of every stage."""
    if placement == "loop":
        return [s % pp for s in range(num_stages)]
    return [s if s < pp else 2 * pp - 1 - s for s in range(num_stages)]  # "v": 0..pp-1 then back


def _check_micro_batches(name: str, n: int, pp: int) -> None:
    if n < 1:
        raise ValueError(f"num_micro_batches must be at least 1, got {n}")
    if name == "1f1b" and n < pp:
        raise ValueError(f"1F1B needs at least pp = {pp} micro-batches per step, got {n}: "
                         f"raise train.global_batch_size or lower micro_batch_size")
    if name in ("interleaved_1f1b", "zero_bubble"):
        rounds = max(1, n // pp)
        if n % rounds:
            raise ValueError(
                f"{name} runs the micro-batches in rounds of about pp = {pp}: torch needs num_micro_batches "
                f"divisible by the number of rounds max(1, num_micro_batches // pp) = {rounds}, got {n}; "
                f"use a multiple of pp = {pp} (or fewer than 2 × pp)")


class Pipeline:
    """Everything a trainer needs to run a causal LM pipelined on this rank.

    ``model`` is the full model, built identically on every rank (same seed or same checkpoint)
    and already split over tp by `dist.shard` at tp > 1; this rank's stages are pruned copies of
    it (stage s on pp rank s % pp for the looped schedules; V-shaped for "zbv"), so ``model``
    itself can be freed afterwards. ``virtual_stages`` is the number of stages per rank
    (1 for "gpipe"/"1f1b", >= 2 for "interleaved_1f1b", >= 1 for "zero_bubble", exactly 2 for "zbv").
    ``boundaries``: see `split_layers`.

    Constraints (checked here, before the first step): pp × virtual_stages ≤ number of layers;
    "1f1b" needs num_micro_batches ≥ pp; "interleaved_1f1b" and "zero_bubble" need
    num_micro_batches divisible by max(1, num_micro_batches // pp) (torch's rounds: any multiple
    of pp works, and so does any count below 2 × pp); the local batch must divide into
    num_micro_batches (checked at each step).

    A step: ``loss = pipeline.step(ids, labels, loss_scale)`` on every rank (repeat for gradient
    accumulation), then once before the optimizer: `dist.finalize_grads` on each of
    `modules()` under sequence parallelism, `sync_tied_grads()`, the dp gradient reduction,
    clipping (counting `tied_duplicates()` once) and the optimizer step over `parameters()`.
    """

    def __init__(self, model: nn.Module, ctx: ParallelContext, *, schedule: str = "1f1b", num_micro_batches: int,
                 virtual_stages: int = 1, boundaries: list[int] | None = None):
        if schedule not in _KINDS:
            raise ValueError(f"unknown pipeline schedule {schedule!r}: choose one of {sorted(_KINDS)} "
                             f"(torch {torch.__version__})")
        kind = _KINDS[schedule]
        prefix, body, layers = _causal_lm_parts(model)
        if ctx.mesh is None:
            raise ValueError("a pipeline needs a process group: launch with torchrun and dist.init(pp=...)")
        if virtual_stages < kind.min_virtual or (kind.max_virtual is not None and virtual_stages > kind.max_virtual):
            wanted = (f"exactly {kind.min_virtual}" if kind.min_virtual == kind.max_virtual
                      else f"at least {kind.min_virtual}")
            raise ValueError(f"schedule {schedule!r} runs {wanted} virtual stage(s) per rank, got "
                             f"virtual_stages={virtual_stages}")
        _check_micro_batches(schedule, num_micro_batches, ctx.pp)
        self.ctx, self.schedule_name, self.kind = ctx, schedule, kind
        self.pp, self.pp_rank, self.pp_group = ctx.pp, ctx.pp_rank, ctx.group("pp")
        self.num_micro_batches = num_micro_batches
        self.num_stages = ctx.pp * virtual_stages
        self.layer_ranges = split_layers(len(layers), self.num_stages, boundaries)
        self.stage_ranks = _stage_ranks(self.pp, self.num_stages, kind.placement)
        self.stages = [
            PipelineStageModule(prune_for_stage(model, self.layer_ranges[s], s == 0, s == self.num_stages - 1),
                                s, self.num_stages, self.layer_ranges[s])
            for s in range(self.num_stages) if self.stage_ranks[s] == self.pp_rank]
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)
        self.last_stage_rank = self.stage_ranks[-1]

        head = model.lm_head
        self._cross_entropy = ParallelCrossEntropy(head.loss_fn.ignore_index, reduction="sum")
        self._cross_entropy.tp = head.tp
        self._loss_scale, self._shifted = 1.0, False

        # A head tied to an embedding: the first and the last stage each hold a copy.
        self.tied_name = next((f"{prefix}.{name}.weight" for name in body.first_stage_modules
                               if getattr(getattr(body, name), "weight", None) is head.weight), None)
        self._tied_group = None
        if self.tied_name is not None and self.num_stages > 1 and self.stage_ranks[0] != self.last_stage_rank:
            ranks = ctx.mesh.mesh  # [pp, dp, tp]
            for d in range(ranks.shape[1]):
                for t in range(ranks.shape[2]):
                    pair = sorted({int(ranks[self.stage_ranks[0], d, t]), int(ranks[self.last_stage_rank, d, t])})
                    group = torch_dist.new_group(pair)  # every rank creates every group, in the same order
                    if ctx.rank in pair:
                        self._tied_group = group
        self._schedules: dict[tuple, object] = {}

    # ---- what the trainer hands to the optimizer, clipping and checkpoints
    def modules(self) -> list[nn.Module]:
        """This rank's pruned models (full-model parameter names), one per local stage."""
        return [stage.model for stage in self.stages]

    def merged_model(self) -> nn.Module:
        """One module holding every part of this rank's stages under the full model's names: what
        the optimizer, gradient clipping and sharded checkpoints take (the stage modules run the
        schedule). With one stage per rank it is that stage's pruned model itself."""
        models = self.modules()
        merged = models[0] if len(models) == 1 else _merge(models)
        if merged is not models[0]:  # what the step and evaluation ask of the model
            merged.num_loss_targets, merged.loss_targets = models[0].num_loss_targets, models[0].loss_targets
        return merged

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter of this rank's stages, each once."""
        seen: dict[int, nn.Parameter] = {}
        for stage in self.stages:
            for param in stage.model.parameters():
                seen.setdefault(id(param), param)
        return list(seen.values())

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(full-model name, parameter) of this rank's stages, each once."""
        seen: set[int] = set()
        for stage in self.stages:
            for name, param in stage.model.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield name, param

    def _tied_params(self) -> tuple[nn.Parameter | None, nn.Parameter | None]:
        first = next((s.model.get_parameter(self.tied_name) for s in self.stages if s.is_first), None)
        last = next((s.model.lm_head.weight for s in self.stages if s.is_last), None)
        return first, last

    def tied_aliases(self) -> dict[str, str]:
        """{name of this rank's duplicate of the tied weight: the name the first stage holds it under}."""
        return {"lm_head.weight": self.tied_name} if self.tied_duplicates() else {}

    def tied_duplicates(self) -> list[nn.Parameter]:
        """The last stage's copy of a weight tied to the first stage's embedding (on the rank holding the
        last stage; empty elsewhere): count it once in a global gradient norm."""
        if self.tied_name is None or self.num_stages == 1:
            return []
        first, last = self._tied_params()
        return [] if last is None or last is first else [last]

    @torch.no_grad()
    def sync_tied_grads(self) -> None:
        """Sum the gradients of the tied embedding/head copies of the first and last stage, so both copies
        hold the full gradient and get the same optimizer update. Call it once per optimizer step, after
        the last backward (and after `dist.finalize_grads` under sequence parallelism): calling it after
        each of several accumulated steps would count the other end's part again. Every rank calls it;
        a no-op without tied weights or with one stage."""
        if self.tied_name is None or self.num_stages == 1:
            return
        first, last = self._tied_params()
        if first is not None and last is not None:  # both ends on this rank (V placement)
            if first is not last:
                total = _grad_or_zeros(first) + _grad_or_zeros(last)
                first.grad, last.grad = total, total.clone()
            return
        param = first if first is not None else last
        if param is None:
            return
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grad = param.grad
        torch_dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=self._tied_group)

    # ---- one training step
    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel cross entropy, summed over the micro-batch's targets (position t scored
        against labels[t + 1], or labels[t] when they come shifted), times the step's loss_scale."""
        ignore = self._cross_entropy.ignore_index
        targets = labels if self._shifted else F.pad(labels, (0, 1), value=ignore)[..., 1:]
        return self._cross_entropy(logits, targets.to(logits.device)) * self._loss_scale

    def _schedule_for(self, shape: tuple) -> object:
        """The schedule for local batches of `shape`, built (and its shapes inferred) once per shape."""
        if shape not in self._schedules:
            device, group = self.ctx.device, self.pp_group
            stages = [PipelineStage(stage, stage.stage_index, self.num_stages, device, group=group)
                      for stage in self.stages]
            kwargs = dict(n_microbatches=self.num_micro_batches, loss_fn=self._loss, scale_grads=False)
            self._schedules[shape] = self.kind.cls(stages if self.kind.multi else stages[0], **kwargs)
        return self._schedules[shape]

    def _run(self, train: bool, input_ids: torch.Tensor, labels: torch.Tensor, loss_scale: float,
             shifted: bool) -> torch.Tensor | None:
        if input_ids.dim() != 2 or labels.shape != input_ids.shape:
            raise ValueError(f"input_ids and labels must both be [batch, sequence], got {tuple(input_ids.shape)} "
                             f"and {tuple(labels.shape)}")
        if input_ids.shape[0] % self.num_micro_batches:
            raise ValueError(f"the local batch of {input_ids.shape[0]} sequences does not split into "
                             f"num_micro_batches = {self.num_micro_batches} equal micro-batches")
        schedule = self._schedule_for(tuple(input_ids.shape))
        self._loss_scale, self._shifted = float(loss_scale), shifted
        device = self.ctx.device
        args = (input_ids.to(device),) if self.has_first else ()
        target = labels.to(device) if self.has_last else None
        losses: list[torch.Tensor] = []
        if train:
            schedule.step(*args, target=target, losses=losses, return_outputs=False)
        else:
            schedule.eval(*args, target=target, losses=losses)
        if not self.has_last:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum()

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor, loss_scale: float, *,
             shifted: bool = False) -> torch.Tensor | None:
        """Forward and backward of this rank's stages over the local batch [B, S], split into
        num_micro_batches. Each micro-batch's loss is the sum of its token losses times
        `loss_scale`; gradients accumulate into ``.grad`` (summed over micro-batches).
        ``shifted``: `labels` are already aligned with the positions (a model's shift_labels).
        Returns the sum of the micro-batch losses (detached) on the rank holding the last stage,
        None elsewhere. Every rank of the pp group passes a batch of the same shape."""
        return self._run(True, input_ids, labels, loss_scale, shifted)

    def eval_step(self, input_ids: torch.Tensor, labels: torch.Tensor, *, shifted: bool = False) -> float:
        """Forward only: the sum of the local batch's token losses, on every rank of the pp group."""
        return self.broadcast_loss(self._run(False, input_ids, labels, 1.0, shifted))

    def broadcast_loss(self, loss: torch.Tensor | None) -> float:
        """The last stage's value of `loss` on every rank of the pp group (call it on all of them)."""
        value = torch.zeros(1, dtype=torch.float64, device=self.ctx.device)
        if loss is not None:
            value.fill_(float(loss))
        torch_dist.broadcast(value, group=self.pp_group, group_src=self.last_stage_rank)
        return value.item()

    def __repr__(self) -> str:
        local = ", ".join(f"{s.stage_index}: layers {s.layer_range.start}..{s.layer_range.stop - 1}"
                          for s in self.stages)
        return (f"Pipeline(schedule={self.schedule_name}, pp={self.pp}, stages={self.num_stages}, "
                f"micro_batches={self.num_micro_batches}, pp_rank={self.pp_rank} holds {{{local}}})")


def _merge(modules: list[nn.Module]) -> nn.Module:
    """A module whose children are the union of `modules`' children, merged the same way below,
    so its parameter names are the names they have in each of them. Layer stacks are united."""
    if all(m is modules[0] for m in modules):
        return modules[0]
    if all(isinstance(m, StageLayers) for m in modules):
        return StageLayers({int(name): layer for m in modules for name, layer in m._modules.items()})
    merged = nn.Module()
    for name in dict.fromkeys(n for m in modules for n in m._modules):
        children = [m._modules[name] for m in modules if m._modules.get(name) is not None]
        if children:
            merged.add_module(name, _merge(children))
    for name in dict.fromkeys(n for m in modules for n in m._parameters):
        param = next((m._parameters[name] for m in modules if m._parameters.get(name) is not None), None)
        if param is not None:
            merged.register_parameter(name, param)
    return merged


def _grad_or_zeros(param: nn.Parameter) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)
