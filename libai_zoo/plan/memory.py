"""Bytes one rank holds under a layout, term by term, computed from the model's parameter table.

Static state is exact (the planner must equal `dry_run` and a real run to the byte):

    params     each parameter's tp slice (`ParameterInfo.tp_dim`), on the stages this pp rank runs
               (`split_layers`, `stage_ranks`; a parameter outside the layers on each stage that holds
               its module, `stage_modules`: the embedding on the first, the final norm and head on the
               last, a tied weight or a stack's shared bias counted at each), and at ZeRO 1-3 this
               rank's rows of it over dp × cp (FSDP2 cuts dim 0 of the tp slice as torch.chunk does,
               so rank 0 of the group holds the most: ceil(rows / (dp·cp)); an expert tensor's
               group is edp = dp / ep)
    grads      the same shapes, for trainable parameters: what a rank holds after its gradients
               are reduced (whole at ZeRO 0, sharded at 1-3)
    optimizer  the optimizer's state per parameter, probed once on a small tensor (AdamW: two
               moments like the parameter plus a 4-byte step counter per tensor)

Transient terms, at the step's peak:

    gathered     FSDP2's all-gathered parameters (in the compute dtype under bf16 autocast; at ZeRO-0
                 the bf16 copy `replicate` computes on; under ``train.fp8``'s tensorwise recipe at
                 ZeRO 1-3 without tp the float8 layers' weights in float8, 1 byte an element,
                 `ModelTable.float8_gathered`): every unit of the rank from forward to
                 backward at ZeRO 0-2 (they reshard after
                 backward), the root unit (embeddings, head: FSDP2 keeps the root gathered) plus
                 the two largest layers at ZeRO 3 (the one computing and the one prefetched),
                 everything under a zero-bubble schedule (kept gathered); at ZeRO 1 (and 0 under
                 bf16) with more than one micro-batch also the unsharded gradients it accumulates
    activations  what each layer saves for backward (measured: `activations.py`) × the micro-batches in
                 flight on this rank (gpipe: all; 1F1B: pp − rank; interleaved 1F1B: torch's
                 warm-up count + 1, in chunks of 1/v; zero bubble: the first rank's count on every
                 rank, a chunk being held until its weight gradients; ZBV: the chunks run before
                 the first weight gradient), each layer as it recomputes (`Layout.activation_checkpoint`:
                 the first N layers of each stage, or all, fully or selectively; the others keep
                 everything), plus the backward of one layer (its gradients, about what it saved)
                 and what recomputation brings back of one layer (all it saves but its input, in
                 full; what its recomputed modules save, selectively)
    logits       the last stage's head and loss for one micro-batch (all of them under gpipe), and
                 the logits' gradient backward makes
    optimizer_step  the optimizer step's temporaries (`OptimizerState.step_per_byte`); the step
                 comes after backward, so the peak is the larger of it and the three terms above
    overhead     a stated fixed amount (CUDA context, communication buffers, allocator slack)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import cache, lru_cache

import torch
from omegaconf import DictConfig
from torch import nn

from libai_zoo.config import Recompute
from libai_zoo.layers import LMHead
from libai_zoo.optim import build_optimizer
from libai_zoo.parallel import fsdp_param_dtype, residual_dtype, stage_ranks
from libai_zoo.utils import TensorMemoryPeak

from .activations import Shapes
from .layouts import Layout
from .model_table import ModelTable, ParameterInfo


@dataclass(frozen=True)
class OptimizerState:
    """An optimizer's state per parameter tensor: `per_byte` bytes for every byte of the parameter
    (AdamW: 2.0) plus `fixed` bytes (AdamW: a 4-byte step); and `step_per_byte`, the temporaries
    its step allocates at once per byte of the parameters it updates (a multi-tensor step works on
    all of them together)."""

    per_byte: float
    fixed: int
    step_per_byte: float = 0.0

    @classmethod
    def probe(cls, optim_cfg: DictConfig) -> OptimizerState:
        """Build the configured optimizer over a few small matrices, step twice (the first allocates
        the state), and measure its state and the second step's temporaries, as this machine's
        torch runs it."""
        params = nn.ParameterList([nn.Parameter(torch.zeros(64, 64)) for _ in range(3)])
        optimizer = build_optimizer(optim_cfg, [params])
        for param in params:
            param.grad = torch.ones_like(param)
        optimizer.step()
        with TensorMemoryPeak() as peak:
            optimizer.step()
        param = params[0]
        like = fixed = 0
        for value in optimizer.state[param].values():
            if isinstance(value, torch.Tensor):
                size = value.numel() * value.element_size()
                if value.numel() == param.numel():
                    like += size
                else:
                    fixed += size
        param_bytes = param.numel() * param.element_size()
        return cls(like / param_bytes, fixed, peak.bytes / (len(params) * param_bytes))


ADAMW = OptimizerState(2.0, 4)
GiB = 2**30


@dataclass(frozen=True)
class StateBytes:
    """One rank's persistent training state."""

    params: int
    grads: int
    optimizer: int


@dataclass
class MemoryBreakdown:
    """Predicted bytes of the rank that holds the most (`pp_rank`), term by term."""

    params: int
    grads: int
    optimizer: int
    gathered: int
    activations: int
    logits: int
    optimizer_step: int
    overhead: int
    pp_rank: int = 0

    @property
    def total(self) -> int:
        """The state, plus the larger of the two peaks: backward (gathered parameters, activations,
        logits) and the optimizer step (its temporaries, while the gradients still exist)."""
        return _peak(self.params + self.grads + self.optimizer + self.overhead, self.gathered, self.activations,
                     self.logits, self.optimizer_step)

    def as_dict(self) -> dict[str, int]:
        """The terms and their total (read field by field: `asdict` deep-copies, thousands of times a plan)."""
        return {**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "pp_rank"}, "total": self.total}


def _peak(state: int, gathered: int, activations: int, logits: int, optimizer_step: int) -> int:
    """`MemoryBreakdown.total` of its terms (`state`: parameters, gradients, optimizer state, overhead)."""
    return state + max(gathered + activations + logits, optimizer_step)


def _data_parallel(param: ParameterInfo, dp: int, ep: int, dp_rank: int) -> tuple[int, int]:
    """(size, this rank's index) of the group ZeRO shards `param` over: dp, or for an expert
    tensor edp = dp / ep (dp rank = edp rank × ep + ep rank)."""
    return (dp // ep, dp_rank // ep) if param.expert else (dp, dp_rank)


def _shard_elements(param: ParameterInfo, tp: int, dp: int, ep: int, zero_stage: int, dp_rank: int) -> int:
    """Elements of `param` this rank keeps: its tp slice (an expert tensor's block of experts), and
    at ZeRO 1-3 its rows of it over its data-parallel group."""
    shape = param.tp_local_shape(tp, ep)
    dp, dp_rank = _data_parallel(param, dp, ep, dp_rank)
    if zero_stage == 0 or dp == 1:
        return math.prod(shape)
    rows = shape[0]
    per_rank = -(-rows // dp)
    kept = max(0, min(per_rank, rows - dp_rank * per_rank))
    return kept * math.prod(shape[1:])


def rank_stages(table: ModelTable, layout: Layout, pp_rank: int) -> tuple[tuple[int, bool, bool], ...]:
    """(number of layers, holds the first stage's modules, holds the last's) of each stage `pp_rank` runs."""
    return tuple((len(layers), first, last) for layers, first, last, _ in
                 _rank_stage_layers(table, layout.pp, layout.schedule, layout.virtual_stages, pp_rank))


def rank_layers(table: ModelTable, layout: Layout, pp_rank: int) -> tuple[int, ...]:
    """The indices of the layers `pp_rank` runs."""
    return _rank_layers(table, layout.pp, layout.schedule, layout.virtual_stages, pp_rank)


@lru_cache(maxsize=65536)
def _rank_layers(table: ModelTable, pp: int, schedule: str | None, virtual_stages: int, pp_rank: int) -> tuple[int, ...]:
    return tuple(index for layers, _, _, _ in _rank_stage_layers(table, pp, schedule, virtual_stages, pp_rank)
                 for index in layers)


@lru_cache(maxsize=65536)
def _rank_stage_layers(table: ModelTable, pp: int, schedule: str | None, virtual_stages: int,
                       pp_rank: int) -> tuple[tuple[range, bool, bool, frozenset[str]], ...]:
    """(indices of its layers, holds the first stage's modules, holds the last's, the paths of the
    modules besides its layers it holds) of each stage `pp_rank` runs."""
    num_stages = pp * virtual_stages
    owners = stage_ranks(pp, schedule, virtual_stages) if pp > 1 else [0]
    return tuple((layers, s == 0, s == num_stages - 1, held)
                 for s, (layers, held) in enumerate(table.stage_holdings(num_stages)) if owners[s] == pp_rank)


def _group(table: ModelTable, key: int | frozenset[str]) -> list[ParameterInfo]:
    """The parameters of one layer of parameter group `key` (an int: `ModelTable.layer_groups`), or
    (the paths of the modules a stage holds besides its layers) those of them (a tied weight once)."""
    return [p for _, p in _indexed_group(table, key)]


def _indexed_group(table: ModelTable, key: int | frozenset[str]) -> list[tuple[int, ParameterInfo]]:
    """`_group`, each parameter with its index in `ModelTable.parameters`."""
    if isinstance(key, int):
        return [(i, p) for i, p in enumerate(table.parameters) if p.layer == table.group_layers[key]]
    return [(i, p) for i, p in enumerate(table.parameters) if p.layer is None and p.holders & key]


def gathers_float8(table: ModelTable, tp: int, zero_stage: int) -> bool:
    """Whether FSDP2 all-gathers the float8 layers' weights in float8 (`ModelTable.float8_gathered`,
    `convert_to_float8`'s ``gather_float8``): at ZeRO 1-3 without tp (over dp × cp > 1)."""
    return bool(table.float8_gathered) and zero_stage >= 1 and tp == 1


@lru_cache(maxsize=65536)
def _stage_groups(table: ModelTable, pp: int, schedule: str | None, virtual_stages: int,
                  pp_rank: int) -> tuple[tuple[int | frozenset[str], int], ...]:
    """What `pp_rank` holds as (`_group` key, count): its layers by parameter group, then each of
    its stages' other modules (their paths, 1)."""
    counts: dict[int, int] = {}
    others = []
    for layers, _, _, held in _rank_stage_layers(table, pp, schedule, virtual_stages, pp_rank):
        for index in layers:
            group = table.layer_groups[index]
            counts[group] = counts.get(group, 0) + 1
        others.append((held, 1))
    return tuple(sorted(counts.items())) + tuple(others)


@lru_cache(maxsize=65536)
def _group_state(table: ModelTable, key: int | frozenset[str], tp: int, dp: int, ep: int, zero_stage: int,
                 dp_rank: int, optimizer: OptimizerState) -> StateBytes:
    params = grads = state = 0
    for param in _group(table, key):
        size = _shard_elements(param, tp, dp, ep, zero_stage, dp_rank) * param.element_size
        params += size
        if param.requires_grad:
            grads += size
            state += int(optimizer.per_byte * size) + optimizer.fixed
    return StateBytes(params, grads, state)


def state_bytes(table: ModelTable, layout: Layout, pp_rank: int = 0, dp_rank: int = 0,
                optimizer: OptimizerState = ADAMW) -> StateBytes:
    """Parameters, gradients and optimizer state one rank holds between steps (exact); `dp_rank`:
    its rank in the dp × cp group ZeRO shards over (dp rank × cp + cp rank)."""
    return _state(table, layout.pp, layout.schedule, layout.virtual_stages, pp_rank, layout.tp, layout.dp_cp,
                  layout.ep, layout.zero_stage, dp_rank, optimizer)


@lru_cache(maxsize=65536)
def _state(table: ModelTable, pp: int, schedule: str | None, virtual_stages: int, pp_rank: int, tp: int, dp: int,
           ep: int, zero_stage: int, dp_rank: int, optimizer: OptimizerState) -> StateBytes:
    params = grads = state = 0
    for key, count in _stage_groups(table, pp, schedule, virtual_stages, pp_rank):
        group = _group_state(table, key, tp, dp, ep, zero_stage, dp_rank, optimizer)
        params += count * group.params
        grads += count * group.grads
        state += count * group.optimizer
    return StateBytes(params, grads, state)


@lru_cache(maxsize=65536)
def _group_unsharded(table: ModelTable, key: int | frozenset[str], tp: int, dp: int, ep: int,
                     element_size: int | None, trainable_only: bool = False, experts: bool | None = None,
                     float8: bool = False) -> int:
    """All-gathered bytes of a group's parameters (FSDP2 pads each to equal chunks of rows over its
    data-parallel group); `experts` True/False: only the expert tensors, or only the others;
    `float8`: the weights `ModelTable.float8_gathered` names at 1 byte an element."""
    total = 0
    for index, param in _indexed_group(table, key):
        if (trainable_only and not param.requires_grad) or (experts is not None and param.expert != experts):
            continue
        shape = param.tp_local_shape(tp, ep)
        size, _ = _data_parallel(param, dp, ep, 0)
        rows = -(-shape[0] // size) * size
        element = 1 if float8 and index in table.float8_gathered else element_size or param.element_size
        total += rows * math.prod(shape[1:]) * element
    return total


def unsharded_bytes(table: ModelTable, layout: Layout, pp_rank: int, element_size: int | None, *,
                    trainable_only: bool = False, experts: bool | None = None, float8: bool = False) -> int:
    """All-gathered bytes of everything `pp_rank` holds (`element_size` None: the parameters' own;
    `experts` True/False: only the experts' tensors, or all but them; `float8`: the weights FSDP2
    gathers in float8, `ModelTable.float8_gathered`, at 1 byte an element)."""
    return _unsharded(table, layout.pp, layout.schedule, layout.virtual_stages, pp_rank, layout.tp, layout.dp_cp,
                      layout.ep, element_size, trainable_only, experts, float8)


@lru_cache(maxsize=65536)
def _unsharded(table: ModelTable, pp: int, schedule: str | None, virtual_stages: int, pp_rank: int, tp: int, dp: int,
               ep: int, element_size: int | None, trainable_only: bool, experts: bool | None,
               float8: bool = False) -> int:
    return sum(count * _group_unsharded(table, key, tp, dp, ep, element_size, trainable_only, experts, float8)
               for key, count in _stage_groups(table, pp, schedule, virtual_stages, pp_rank))


def gathered_bytes(table: ModelTable, layout: Layout, pp_rank: int, num_micro_batches: int,
                   compute_dtype: torch.dtype | None) -> int:
    """FSDP2's gathered parameters, and the whole gradients it accumulates over micro-batches, at
    the step's peak. Without pp: ZeRO 1-2 keep every unit gathered from forward to backward, ZeRO-3
    the root and about two layers (computing, prefetched); ZeRO-1 accumulates whole gradients.
    ZeRO-0 gathers nothing, but under bf16 autocast `replicate` holds a bf16 copy of every unit
    through the step and accumulates whole float32 gradients, as ZeRO-1.
    Under pp the schedule syncs a stage once, after its last micro-batch: every ZeRO stage
    accumulates whole gradients, and ZeRO-3 keeps the stage gathered from its first backward.
    Under ``train.fp8``'s tensorwise recipe at ZeRO 1-3 without tp the float8 layers' weights are
    gathered in float8 (`gathers_float8`); the gradients stay float32."""
    return _gathered(table, layout.pp, layout.schedule, layout.virtual_stages, pp_rank, layout.tp, layout.dp_cp,
                     layout.ep, layout.zero_stage, num_micro_batches > 1, compute_dtype)


@lru_cache(maxsize=65536)
def _gathered(table: ModelTable, pp: int, schedule: str | None, virtual_stages: int, pp_rank: int, tp: int, dp: int,
              ep: int, zero_stage: int, accumulates: bool, compute_dtype: torch.dtype | None) -> int:
    if dp == 1 or (zero_stage == 0 and compute_dtype is None):
        return 0
    element = compute_dtype.itemsize if compute_dtype is not None else None
    float8 = gathers_float8(table, tp, zero_stage)
    position = (table, pp, schedule, virtual_stages, pp_rank, tp, dp, ep)
    if zero_stage < 3 or pp > 1:
        total = _unsharded(*position, element, False, None, float8)
    else:
        sizes = (tp, dp, ep, element, False, None, float8)
        groups = _stage_groups(table, pp, schedule, virtual_stages, pp_rank)
        layers = [(_group_unsharded(table, key, *sizes), count) for key, count in groups if isinstance(key, int)]
        biggest = sorted((size for size, count in layers for _ in range(min(2, count))), reverse=True)[:2]
        total = sum(biggest) + sum(_group_unsharded(table, key, *sizes)
                                   for key, _ in groups if not isinstance(key, int))
    if accumulates and (zero_stage <= 1 or pp > 1):
        total += _unsharded(*position, 4, True, None)  # float32: FSDP's reduce dtype
    return total


def micro_batches_in_flight(layout: Layout, pp_rank: int, num_micro_batches: int) -> float:
    """Micro-batches whose activations pp rank `pp_rank` holds at once, in units of all its layers:
    the most stage chunks (1/v of them) whose forward has run and whose backward has not, in the
    order torch's schedule runs them. Under the zero-bubble schedules a chunk is held until its
    weight gradients (W): the input-gradient pass (I) keeps the graph for them."""
    return _in_flight(layout.pp, layout.schedule, layout.virtual_stages, pp_rank, num_micro_batches)


def _in_flight(pp: int, schedule: str | None, v: int, pp_rank: int, m: int) -> float:
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, pp - pp_rank))
    if schedule == "zbv":
        # stage pp_rank runs 2 pp − 1 − pp_rank forwards and stage 2 pp − 1 − pp_rank runs pp_rank + 1
        # before the first W (of at most m micro-batches each); after it one W follows each forward
        return (min(m, 2 * pp - 1 - pp_rank) + min(m, pp_rank + 1)) / 2
    per_round = m // max(1, m // pp)
    if schedule == "zero_bubble":
        # warm-up (v − 1)·per_round + pp − 1 − pp_rank forwards, then each W trails its I by
        # pp_rank steps: every rank holds what the first does (ZB-H1's memory)
        return min((v - 1) * per_round + pp, m * v) / v
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - pp_rank), m * v)  # interleaved 1F1B
    return min(warmup + 1, m * v) / v


@lru_cache(maxsize=65536)
def _stage_layer_kinds(table: ModelTable, pp: int, schedule: str | None, virtual_stages: int,
                       recompute: Recompute | None, pp_rank: int) -> tuple[tuple[int, bool, int], ...]:
    """(layer kind, recomputed, how many of the layers `pp_rank` runs are of it and recompute so or
    not) for each kind it runs: a stage recomputes its first ``num_layers`` layers (all when None)."""
    kinds = table.activations.layer_kinds
    recomputed = _recomputed_layers(table, pp, schedule, virtual_stages, recompute, pp_rank)
    counts: dict[tuple[int, bool], int] = {}
    for index in _rank_layers(table, pp, schedule, virtual_stages, pp_rank):
        key = kinds[index], index in recomputed
        counts[key] = counts.get(key, 0) + 1
    return tuple((kind, recomputes, count) for (kind, recomputes), count in sorted(counts.items()))


def recomputed_layers(table: ModelTable, layout: Layout, pp_rank: int) -> frozenset[int]:
    """The indices of the layers `pp_rank` runs that recompute: the first ``num_layers`` of each of
    its stages (all when None), none without `Layout.activation_checkpoint`."""
    return _recomputed_layers(table, layout.pp, layout.schedule, layout.virtual_stages,
                              layout.activation_checkpoint, pp_rank)


@lru_cache(maxsize=65536)
def _recomputed_layers(table: ModelTable, pp: int, schedule: str | None, virtual_stages: int,
                       recompute: Recompute | None, pp_rank: int) -> frozenset[int]:
    if recompute is None:
        return frozenset()
    stages = _rank_stage_layers(table, pp, schedule, virtual_stages, pp_rank)
    return frozenset(index for layers, _, _, _ in stages for part in _stack_parts(table, layers)
                     for index in part[:recompute.num_layers])


def _stack_parts(table: ModelTable, layers: range) -> list[range]:
    """`layers` cut where a stack starts: each part's layers belong to one stack (the pipeline wraps
    the first ``num_layers`` of each for recomputation)."""
    edges = sorted({layers.start, layers.stop, *(s for s in table.stack_starts if layers.start < s < layers.stop)})
    return [range(a, b) for a, b in zip(edges, edges[1:])]


@lru_cache(maxsize=65536)
def _activations(table: ModelTable, part: str, shapes: Shapes, kind: int, recompute: Recompute | None,
                 low_precision_weights: bool) -> int:
    """One micro-batch's saved bytes of a layer of `kind` (recomputing what `recompute` says), the
    "embedding", the "entry" of later stack `kind` or the "head" (cached: the planner asks the same shapes of thousands of layouts)."""
    saved = table.activations
    if part == "layer":
        return saved.layer(kind, shapes, recompute=recompute, low_precision_weights=low_precision_weights)
    if part == "embedding":
        return saved.embedding(shapes, low_precision_weights=low_precision_weights)
    if part == "entry":
        return saved.entry(kind, shapes, low_precision_weights=low_precision_weights)
    return saved.head(shapes, low_precision_weights=low_precision_weights)


def activation_bytes(table: ModelTable, layout: Layout, seq_len: int, num_micro_batches: int,
                     amp_dtype: torch.dtype | None, device: str = "cuda", routing_imbalance: float = 1.0,
                     fp32_residual: bool = False) -> tuple[tuple[int, int], ...]:
    """(activations of the layers and embedding, logits and loss of the head) held at the peak by
    each pp rank, on a "cuda" or "cpu" device (their attention kernels and dropout masks differ);
    MoE layers routed as `Shapes.routing_imbalance` states; under cp a rank's seq_len / cp tokens,
    its attention holding the gathered keys and values of the whole sequence
    (`SavedActivations.gathered_kv`). Cached by what they depend on: the ZeRO stage changes nothing
    but whether FSDP2's bf16 parameters are there, which every stage at dp × cp > 1 has."""
    shapes = Shapes(layout.micro_batch_size, seq_len, layout.tp, layout.sequence_parallel, amp_dtype, device,
                    layout.ep, routing_imbalance if table.moe else 1.0, residual_dtype(amp_dtype, fp32_residual),
                    layout.cp)
    # FSDP2 hands the layers bf16 parameters under bf16 autocast at every ZeRO stage: no matmul keeps a cast copy
    low = layout.dp_cp > 1 and fsdp_param_dtype(amp_dtype) is not None
    ranks = _rank_structure(table, layout.pp, layout.schedule, layout.virtual_stages, layout.activation_checkpoint,
                            num_micro_batches)
    return _activation_bytes(table, ranks, layout.activation_checkpoint, shapes, low, num_micro_batches,
                             layout.schedule == "gpipe")


@lru_cache(maxsize=4096)
def _rank_structure(table: ModelTable, pp: int, schedule: str | None, virtual_stages: int,
                    recompute: Recompute | None, num_micro_batches: int
                    ) -> tuple[tuple[float, tuple[tuple[int, bool, int], ...], bool, tuple[int, ...], bool], ...]:
    """What each pp rank's activations depend on besides the shapes: (micro-batches in flight, its
    layer kinds (`_stage_layer_kinds`), whether it holds the first stage, the later stacks whose
    first layer it runs (it enters them: `enter_stack`), whether it holds the last stage)."""
    ranks = []
    for pp_rank in range(pp):
        stages = _rank_stage_layers(table, pp, schedule, virtual_stages, pp_rank)
        layers = set(_rank_layers(table, pp, schedule, virtual_stages, pp_rank))
        ranks.append((_in_flight(pp, schedule, virtual_stages, pp_rank, num_micro_batches),
                      _stage_layer_kinds(table, pp, schedule, virtual_stages, recompute, pp_rank),
                      any(first for _, first, _, _ in stages),
                      tuple(k for k, start in enumerate(table.stack_starts) if k and start in layers),
                      any(last for _, _, last, _ in stages)))
    return tuple(ranks)


@lru_cache(maxsize=65536)
def _activation_bytes(table: ModelTable, ranks: tuple, recompute: Recompute | None, shapes: Shapes, low: bool,
                      num_micro_batches: int, gpipe: bool) -> tuple[tuple[int, int], ...]:
    """`activation_bytes` of the pp ranks `ranks` (`_rank_structure`) describes (cached: the ZeRO
    stage, dp and the rest of a layout do not change them)."""
    @cache  # asked of every pp rank: a local table spares hashing the shapes each time
    def layer(kind: int, recomputed: bool) -> int:
        return _activations(table, "layer", shapes, kind, recompute if recomputed else None, low)

    head = None
    result = []
    for in_flight, kinds, first, entered, last in ranks:
        held = sum(count * layer(kind, recomputed) for kind, recomputed, count in kinds)
        if first:
            held += _activations(table, "embedding", shapes, 0, None, low)
        held += sum(_activations(table, "entry", shapes, k, None, low) for k in entered)
        # a layer's backward makes gradients of about the size of what it saved; a recomputing layer
        # first brings back what it did not keep
        whole_layer = max((layer(kind, False) for kind, _, _ in kinds), default=0)
        brought_back = max((layer(kind, False) - layer(kind, True) for kind, recomputed, _ in kinds if recomputed),
                           default=0)
        total = int(in_flight * held) + whole_layer + brought_back
        logits = 0
        if last:
            if head is None:
                head = _activations(table, "head", shapes, 0, None, low)
                # backward makes the float32 logits' gradient (one chunk's when the loss runs in chunks)
                tokens = shapes.micro_batch * shapes.seq_len // shapes.cp
                head += min(tokens * table.vocab_size // shapes.tp * 4, LMHead.chunk_bytes)
            logits = head * (num_micro_batches if gpipe else 1)
        result.append((total, logits))
    return tuple(result)


def rank_memory(table: ModelTable, layout: Layout, *, seq_len: int, global_batch_size: int,
                amp_dtype: torch.dtype | None = None, optimizer: OptimizerState = ADAMW,
                overhead: int = 0, device: str = "cuda", routing_imbalance: float = 1.0,
                fp32_residual: bool = False) -> MemoryBreakdown:
    """The predicted peak of the rank that holds the most (every pp rank at dp rank 0) on a "cuda"
    or "cpu" device; an MoE model's most loaded rank of an expert group receiving
    `routing_imbalance` × its share of the routed tokens."""
    m = layout.num_micro_batches(global_batch_size)
    activations = activation_bytes(table, layout, seq_len, m, amp_dtype, device, routing_imbalance, fp32_residual)
    states = _rank_states(table, layout.pp, layout.schedule, layout.virtual_stages, layout.tp, layout.dp_cp,
                          layout.ep, layout.zero_stage, m > 1, fsdp_param_dtype(amp_dtype), optimizer)
    # the totals first, one breakdown for the largest: a plan asks this of every pp rank of 10⁵ layouts
    totals = [_peak(state.params + state.grads + state.optimizer + overhead, gathered, acts, logits, step)
              for (acts, logits), (state, gathered, step) in zip(activations, states)]
    pp_rank = totals.index(max(totals))
    (acts, logits), (state, gathered, step) = activations[pp_rank], states[pp_rank]
    return MemoryBreakdown(state.params, state.grads, state.optimizer, gathered, acts, logits, step, overhead, pp_rank)


@lru_cache(maxsize=65536)
def _rank_states(table: ModelTable, pp: int, schedule: str | None, virtual_stages: int, tp: int, dp: int, ep: int,
                 zero_stage: int, accumulates: bool, compute_dtype: torch.dtype | None,
                 optimizer: OptimizerState) -> tuple[tuple[StateBytes, int, int], ...]:
    """(state, gathered bytes, optimizer step's temporaries) of each pp rank at dp rank 0: what does
    not depend on the micro-batch's shape, shared by the layouts that differ only in it."""
    ranks = []
    for pp_rank in range(pp):
        state = _state(table, pp, schedule, virtual_stages, pp_rank, tp, dp, ep, zero_stage, 0, optimizer)
        gathered = _gathered(table, pp, schedule, virtual_stages, pp_rank, tp, dp, ep, zero_stage, accumulates,
                             compute_dtype)
        ranks.append((state, gathered, int(optimizer.step_per_byte * state.params)))
    return tuple(ranks)
