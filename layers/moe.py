"""Mixture of Experts: a router picks k of E expert MLPs per token, and their outputs, weighted by the
router, replace the dense MLP's (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, gpt-oss).

    x [T, h] -> router -> k (weight, expert) per token -> tokens sorted by expert
             -> experts: one grouped GEMM per projection over the sorted tokens (counts per expert)
             -> unsorted, × weights, summed over the k slots  (+ shared expert) -> [T, h]

The computation of the experts on tokens sorted by expert is one method, `MoE._compute(tokens,
counts)`: it runs the local `Experts` here, and is where expert parallelism exchanges the tokens
with the ranks that hold their experts (all-to-all) and back. The counts per expert are made in
one place, `routing_counts`: the seam through which the planner, whose fake tensors have no
routing, states its own (`routing_counted_by`).

Each forward also returns the layer's router statistics, a float32 [3, E] tensor: row 0 the tokens
routed to each expert (summed over the k slots; no gradient), row 1 the sum over tokens of the
probabilities the load-balancing loss uses (differentiable), row 2 [tokens counted, sum over them of
the router z-loss term logsumexp(logits)², 0, ...]. Padding tokens (`token_mask` 0) are not counted.
Summed over layers they give transformers' auxiliary loss (`load_balancing_loss`) and the z-loss
(`router_z_loss`).

Under expert parallelism (`distributed.shard` calls `MoE.shard_experts_` when ep × tp > 1) the
experts are split over the expert group, ep × tp ranks (`distributed.expert_parallel`): each rank
holds E / (ep·tp) whole experts, DTensors of the global [E, ...] shape. Under tp the routed path
takes this tp rank's share of the tokens (under sequence parallelism its sequence shard already
is one), routes them (the router's gradient is then partial over tp, its statistics summed over
tp), sends them to their experts' ranks and back by all-to-all, and, without sequence
parallelism, gathers every tp rank's outputs again. The shared expert is an MLP split over tp like
any other, on the whole input.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from libai_zoo.distributed import ExpertParallel, TensorParallel, local
from libai_zoo.distributed.collectives import reduce_from_tp, sum_over_tp
from libai_zoo.distributed.expert_parallel import (
    combine,
    dispatch,
    expert_weight,
    gather_tokens,
    local_tokens,
    scatter_tokens,
)

from .linear import Linear
from .lora import LoRA
from .mlp import ACTIVATIONS, MLP, gated
from .parallel_layer import ParallelLayer
from .recomputed import recomputed, recomputes

ROUTERS = ("softmax_topk", "sigmoid_group", "topk_softmax")


def count_slots(slots: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The slots routed to each of `num_experts` experts, an integer [E] tensor, from `slots` (each
    slot's expert id), counted on the device (no host sync): how `routing_counts` counts by default."""
    return slots.new_zeros(num_experts).scatter_add_(0, slots, torch.ones_like(slots))


_count_routing: Callable[[torch.Tensor, int], torch.Tensor] = count_slots


def routing_counts(slots: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The slots routed to each expert [E] (`count_slots`). Every MoE layer counts its routing here
    and nowhere else, so a ``counter`` given to `routing_counted_by` sees and decides every count."""
    return _count_routing(slots, num_experts)


@contextmanager
def routing_counted_by(counter: Callable[[torch.Tensor, int], torch.Tensor]) -> Iterator[None]:
    """Meanwhile every MoE layer's counts per expert are ``counter(slots, num_experts)`` (the
    seam of `routing_counts`): the planner measures a layer on fake tensors, which have no routing,
    with balanced counts (`plan.kernel_emulation`)."""
    global _count_routing
    previous, _count_routing = _count_routing, counter
    try:
        yield
    finally:
        _count_routing = previous


@dataclass
class Routing:
    """A router's choice for T tokens."""

    weights: torch.Tensor  # [T, k] float32: each chosen expert's weight
    experts: torch.Tensor  # [T, k] int64: the chosen experts
    probs: torch.Tensor  # [T, E] float32: the probabilities the load-balancing loss uses
    logits: torch.Tensor  # [T, E] float32


class Router(ParallelLayer, nn.Module):
    """The router: a [E, h] linear map computed in float32, then one of ``ROUTERS``:

    softmax_topk (Mixtral, Qwen, OLMoE): p = softmax(logits); the k largest p, renormalised to sum 1
        when ``norm_topk_prob``.
    topk_softmax (gpt-oss; ``bias``): the k largest logits, softmax over those k.
    sigmoid_group (DeepSeek-V3): s = sigmoid(logits); experts chosen by s + e_score_correction_bias
        (a buffer that only steers the choice) within the ``topk_group`` of ``n_group`` groups whose
        two best scores sum highest; weights s of the chosen, normalised when ``norm_topk_prob``,
        × ``routed_scaling_factor``. The loss's probabilities are s normalised over the experts.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, kind: str = "softmax_topk",
                 norm_topk_prob: bool = True, bias: bool = False, n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0, score_correction_bias: bool = False,
                 sequence_parallel: bool = True, device=None, dtype=None):
        super().__init__()
        if kind not in ROUTERS:
            raise ValueError(f"router {kind!r} is not one of {ROUTERS}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k = {top_k} experts per token out of num_experts = {num_experts}: "
                             f"choose 1 <= top_k <= num_experts")
        if num_experts % n_group or not 0 < topk_group <= n_group:
            raise ValueError(f"n_group = {n_group} must divide num_experts = {num_experts} and "
                             f"1 <= topk_group = {topk_group} <= n_group")
        self.kind, self.num_experts, self.top_k = kind, num_experts, top_k
        self.norm_topk_prob, self.n_group, self.topk_group = norm_topk_prob, n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(num_experts, device=device, dtype=dtype)) if bias else None
        correction = torch.zeros(num_experts, device=device, dtype=torch.float32) if score_correction_bias else None
        self.register_buffer("e_score_correction_bias", correction)

    def forward(self, x: torch.Tensor) -> Routing:
        """x [T, h]: under tp, this tp rank's share of the tokens (the gradient is partial over tp)."""
        partial = self.tp is not None
        bias = local(self.bias, partial_grad=partial)
        logits = F.linear(x.float(), local(self.weight, partial_grad=partial).float(),
                          None if bias is None else bias.float())
        if self.kind == "softmax_topk":
            probs = logits.softmax(-1)
            weights, experts = probs.topk(self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
        elif self.kind == "topk_softmax":
            top, experts = logits.topk(self.top_k, dim=-1)
            weights, probs = top.softmax(-1), logits.softmax(-1)
        else:
            scores = logits.sigmoid()
            experts = self._grouped_choice(scores.detach())
            weights = scores.gather(1, experts)
            if self.norm_topk_prob:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
            weights = weights * self.routed_scaling_factor
            probs = scores / scores.sum(-1, keepdim=True)
        return Routing(weights, experts, probs, logits)

    def init_buffers(self) -> None:
        """The selection bias starts at 0 (a model built on the meta device; a checkpoint then fills it)."""
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias.zero_()

    @torch.no_grad()
    def update_correction_bias(self, counts: torch.Tensor, rate: float) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing, after an optimizer step: each expert that took
        fewer than the mean of the step's routed tokens gains selection bias, each that took more
        loses it, b_e += rate · sign(mean(counts) − counts_e) (DeepSeek-V3's rate: 0.001). `counts` [E]:
        the tokens routed to each expert in the step, alike on every rank (`MoE.take_routed_tokens`
        summed over the data-parallel ranks)."""
        if self.e_score_correction_bias is None:
            raise ValueError("this router has no e_score_correction_bias to update: build it with "
                             "score_correction_bias=True (DeepSeek-V3's sigmoid_group router)")
        counts = counts.to(self.e_score_correction_bias)
        self.e_score_correction_bias += rate * torch.sign(counts.mean() - counts)

    def logits_of_all_tokens(self, logits: torch.Tensor, tokens: int) -> torch.Tensor:
        """`logits` of the tokens this router saw -> of all `tokens` of its layer's input: under tp
        without sequence parallelism each tp rank routes its share of them (`MoE.forward`), joined
        here in token order (sequence shards stay split)."""
        return gather_tokens(logits, self.tp, tokens) if self.tp is not None and not self.sp else logits

    def _grouped_choice(self, scores: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3's choice: the top k of scores + correction bias within the best groups."""
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        groups = choice.view(-1, self.n_group, self.num_experts // self.n_group)
        best = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(-1).topk(self.topk_group, dim=-1).indices
        allowed = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~allowed.repeat_interleave(groups.shape[-1], dim=1), float("-inf"))
        return choice.topk(self.top_k, dim=-1).indices

    def extra_repr(self) -> str:
        return (f"{self.kind}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"norm_topk_prob={self.norm_topk_prob}{self.parallel_repr()}")


class Experts(ParallelLayer, nn.Module):
    """E expert MLPs as stacked parameters: ``gate_proj``, ``up_proj`` [E, I, h] (``up_proj`` only
    when not ``gated``), ``down_proj`` [E, h, I], biases ``gate_bias``/``up_bias`` [E, I] and
    ``down_bias`` [E, h] with ``bias``. The activation is one of `ACTIVATIONS`, or with
    ``swiglu_limit`` gpt-oss's clamped SwiGLU: (clamp(up, ±limit) + 1) · g · sigmoid(alpha · g),
    g = min(gate, limit).

    `forward(tokens, counts)` takes tokens sorted by expert (counts[e] rows for expert e, in order)
    and computes each projection as one grouped GEMM (`torch._grouped_mm`, int32 offsets) where it
    can run (float32/bf16/fp16, rows of 16-byte multiples), else expert by expert
    (``grouped_mm=False`` always). Under expert parallelism (`shard_experts_`) it holds and computes
    only this rank's block of experts (the tp ranks join the expert group: each holds whole experts).

    ``add_lora(rank, alpha, projection=)`` gives a projection a per-expert low-rank adapter
    (`LoRA` with A [E, rank, in], B [E, out, rank], in ``self.lora[projection]``), computed as two
    more grouped GEMMs (or per expert) beside the projection's, and split over the expert group with
    its experts."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, *, activation: str = "silu",
                 gated: bool = True, bias: bool = False, swiglu_limit: float | None = None,
                 swiglu_alpha: float = 1.702, grouped_mm: bool = True, sequence_parallel: bool = True,
                 device=None, dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
        if swiglu_limit is not None and not gated:
            raise ValueError("the clamped SwiGLU (swiglu_limit) is a gated activation: pass gated=True")
        self.num_experts, self.hidden_size, self.ffn_hidden_size = num_experts, hidden_size, ffn_hidden_size
        self.activation_name, self.act = activation, ACTIVATIONS[activation]
        self.swiglu_limit, self.swiglu_alpha = swiglu_limit, swiglu_alpha
        self.grouped_mm, self.sequence_parallel = grouped_mm, sequence_parallel
        self.elementwise_recompute = "auto"  # train.elementwise_recompute (`set_elementwise_recompute`)

        def param(*shape, when: bool = True):
            return nn.Parameter(torch.empty(num_experts, *shape, device=device, dtype=dtype)) if when else None

        self.gate_proj = param(ffn_hidden_size, hidden_size, when=gated)
        self.up_proj = param(ffn_hidden_size, hidden_size)
        self.down_proj = param(hidden_size, ffn_hidden_size)
        self.gate_bias = param(ffn_hidden_size, when=gated and bias)
        self.up_bias = param(ffn_hidden_size, when=bias)
        self.down_bias = param(hidden_size, when=bias)
        self.expert_parallel: ExpertParallel | None = None
        self.lora: nn.ModuleDict | None = None

    def shard_(self, tp: TensorParallel) -> None:
        """Nothing to split over tp: the experts are split over the expert group (ep × tp ranks,
        `shard_experts_`), which `distributed.shard` does whenever tp > 1."""
        self.tp = tp

    def shard_experts_(self, ep: ExpertParallel) -> None:
        """Keep this rank's block of E / (ep·tp) experts of every stacked parameter (DTensors of the
        global shape, Shard(0) on the expert group's mesh), and of its adapters."""
        for name, _ in list(self.named_parameters(recurse=False)):
            ep.shard_parameter(self, name)
        for adapter in (self.lora or {}).values():  # per-expert factors: split with their experts
            for name in ("A", "B"):
                ep.shard_parameter(adapter, name)
        self.expert_parallel = ep

    @property
    def lora_projections(self) -> tuple[str, ...]:
        """The projections an adapter can go on (`apply_lora`)."""
        return tuple(name for name in ("gate_proj", "up_proj", "down_proj") if getattr(self, name) is not None)

    def add_lora(self, rank: int, alpha: float, *, dropout: float = 0.0, projection: str) -> LoRA:
        """Attach a rank-`rank` adapter per expert to `projection` (A [E, rank, in], B [E, out, rank])."""
        if self.tp is not None or self.expert_parallel is not None:
            raise ValueError("add LoRA adapters before the model is split (apply_lora, then distributed.shard)")
        if dropout:
            raise ValueError(f"LoRA dropout {dropout} on the experts' {projection}: expert adapters take none (PEFT's "
                             f"adapters on stacked expert parameters cannot either); set train.lora.dropout=0 or "
                             f"leave the experts out of train.lora.target_modules")
        weight = getattr(self, projection)
        if self.lora is None:
            self.lora = nn.ModuleDict()
        self.lora[projection] = LoRA(weight.shape[2], weight.shape[1], rank, alpha, num_experts=self.num_experts,
                                     device=weight.device, dtype=weight.dtype)
        return self.lora[projection]

    @torch.no_grad()
    def merge_lora_(self) -> None:
        """Fold each adapter into its projection (W[e] += scale · B[e] A[e]) and remove them (in one process)."""
        if self.tp is not None or self.expert_parallel is not None:
            raise ValueError("merging the experts' LoRA adapters needs them in one process; these are split")
        for projection, adapter in self.lora.items():
            weight = getattr(self, projection)
            weight += adapter.delta_weight().to(weight.dtype)
        self.lora = None

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """tokens [N, h] sorted by expert, counts [E] (their sum N) -> [N, h]; under expert
        parallelism E is this rank's experts."""
        weights = {name: expert_weight(getattr(self, name), self.expert_parallel)
                   for name in ("gate_proj", "up_proj", "down_proj", "gate_bias", "up_bias", "down_bias")}
        adapters = {name: (expert_weight(a.A, self.expert_parallel), expert_weight(a.B, self.expert_parallel),
                           a.scale) for name, a in (self.lora or {}).items()}
        tokens = tokens.to(weights["up_proj"].dtype)
        factors = [factor for a, b, _ in adapters.values() for factor in (a, b)]
        grouped = self.grouped_mm and self._groupable([tokens, *(w for w in weights.values() if w is not None),
                                                       *factors])
        return (self._grouped if grouped else self._looped)(tokens, counts, weights, adapters)

    def _groupable(self, tensors: list[torch.Tensor]) -> bool:
        """Whether torch._grouped_mm runs on these tokens and weights: float32/bf16/fp16 (bf16 only
        under torch.compile or on fake tensors: its meta kernel's rule), rows of 16-byte multiples
        (the adapters' ranks too) at 16-byte aligned addresses, a GPU of compute capability 8.0 or more."""
        tokens = tensors[0]
        size = tokens.element_size()
        ranks = [adapter.rank for adapter in (self.lora or {}).values()]
        if (tokens.dtype not in (torch.float32, torch.bfloat16, torch.float16)
                or any(dim * size % 16 for dim in (self.hidden_size, self.ffn_hidden_size, *ranks))):
            return False
        if torch.compiler.is_compiling() or tokens.device.type == "meta" or is_fake(tokens):
            return tokens.dtype == torch.bfloat16
        if tokens.device.type == "cuda" and torch.cuda.get_device_capability(tokens.device) < (8, 0):
            return False
        return all(t.data_ptr() % 16 == 0 for t in tensors)

    def _activate(self, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
        """act(up), or the gated activation keeping only gate and up for backward (`gated`; recomputing
        it frees memory, so only ``elementwise_recompute`` = "never" keeps autograd's tensors)."""
        if gate is None:
            return self.act(up)
        recompute = recomputes(self.elementwise_recompute, True)
        if self.swiglu_limit is None:
            return gated(self.act, gate, up, recompute)
        return recomputed(self._clamped_swiglu, gate, up) if recompute else self._clamped_swiglu(gate, up)

    def _clamped_swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.swiglu_limit)
        return (up.clamp(-self.swiglu_limit, self.swiglu_limit) + 1) * gate * torch.sigmoid(gate * self.swiglu_alpha)

    def _grouped(self, tokens: torch.Tensor, counts: torch.Tensor, w: dict, adapters: dict) -> torch.Tensor:
        offsets = counts.cumsum(0).to(torch.int32)
        owner = None if w["up_bias"] is None else torch.repeat_interleave(  # each row's expert, for its bias
            torch.arange(len(counts), device=tokens.device), counts, output_size=len(tokens))

        def mm(x, weight):
            return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)

        def linear(x, name, bias):
            y = mm(x, w[name]) if bias is None else mm(x, w[name]) + bias[owner]
            if name in adapters:
                a, b, scale = adapters[name]
                y = y + mm(mm(x, a), b) * scale
            return y

        gate = None if w["gate_proj"] is None else linear(tokens, "gate_proj", w["gate_bias"])
        hidden = self._activate(gate, linear(tokens, "up_proj", w["up_bias"]))
        return linear(hidden, "down_proj", w["down_bias"])

    def _looped(self, tokens: torch.Tensor, counts: torch.Tensor, w: dict, adapters: dict) -> torch.Tensor:
        def linear(x, e, name, bias):
            y = F.linear(x, w[name][e], None if bias is None else bias[e])
            if name in adapters:
                a, b, scale = adapters[name]
                y = y + F.linear(F.linear(x, a[e]), b[e]) * scale
            return y

        outputs = []
        for e, x in enumerate(tokens.split(counts.tolist())):
            gate = None if w["gate_proj"] is None else linear(x, e, "gate_proj", w["gate_bias"])
            hidden = self._activate(gate, linear(x, e, "up_proj", w["up_bias"]))
            outputs.append(linear(hidden, e, "down_proj", w["down_bias"]))
        return torch.cat(outputs) if outputs else tokens.new_zeros(0, self.hidden_size)

    def extra_repr(self) -> str:
        activation = "clamped_swiglu" if self.swiglu_limit is not None else self.activation_name
        return (f"num_experts={self.num_experts}, {self.hidden_size} -> {self.ffn_hidden_size}, activation={activation}, "
                f"gated={self.gate_proj is not None}, grouped_mm={self.grouped_mm}{self.parallel_repr()}")


class MoE(ParallelLayer, nn.Module):
    """The MLP of a Mixture-of-Experts layer: `Router` (``router`` names its kind; ``norm_topk_prob``,
    ``router_bias``, ``n_group``, ``topk_group``, ``routed_scaling_factor``,
    ``score_correction_bias`` configure it), `Experts` of ``ffn_hidden_size`` neurons, and optionally
    a ``shared_expert`` (an `MLP` of ``shared_expert_size`` neurons every token goes through) scaled
    by sigmoid(``shared_expert_gate``(x)) (Qwen2-MoE).

    Dropless by default; with ``capacity_factor`` each expert takes at most ceil(factor · T · k / E)
    of a forward's T tokens (the first ones in token order), the others' slots are dropped (the
    token keeps its residual and its other experts); ``dropped_tokens`` counts them over the training
    forwards since `take_dropped_tokens`. `forward(x, token_mask)` returns (y, stats): see the module docstring."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, ffn_hidden_size: int, *,
                 router: str = "softmax_topk", norm_topk_prob: bool = True, router_bias: bool = False,
                 n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
                 score_correction_bias: bool = False, activation: str = "silu", gated: bool = True,
                 bias: bool = False, swiglu_limit: float | None = None, swiglu_alpha: float = 1.702,
                 shared_expert_size: int | None = None, shared_expert_gate: bool = False,
                 capacity_factor: float | None = None, grouped_mm: bool = True, sequence_parallel: bool = True,
                 device=None, dtype=None):
        super().__init__()
        if num_experts < 2:
            raise ValueError(f"num_experts = {num_experts}: a Mixture of Experts has at least 2 (use an MLP)")
        if shared_expert_gate and shared_expert_size is None:
            raise ValueError("shared_expert_gate scales a shared expert: give shared_expert_size too")
        factory = dict(sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.sequence_parallel = sequence_parallel
        self.router = Router(hidden_size, num_experts, top_k, kind=router, norm_topk_prob=norm_topk_prob,
                             bias=router_bias, n_group=n_group, topk_group=topk_group,
                             routed_scaling_factor=routed_scaling_factor,
                             score_correction_bias=score_correction_bias, **factory)
        self.experts = Experts(num_experts, hidden_size, ffn_hidden_size, activation=activation, gated=gated,
                               bias=bias, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha,
                               grouped_mm=grouped_mm, **factory)
        self.shared_expert = None if shared_expert_size is None else MLP(
            hidden_size, shared_expert_size, activation=activation, gated=True, bias=False, **factory)
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False, **factory) if shared_expert_gate else None
        self.routed_tokens: torch.Tensor | None = None  # [E] since take_routed_tokens, in training
        self.count_routing = True  # off inside `uncounted`
        #: slots dropped over capacity by the training forwards since `take_dropped_tokens`
        self.dropped_tokens: torch.Tensor | None = None
        self.expert_parallel: ExpertParallel | None = None

    def shard_experts_(self, ep: ExpertParallel) -> None:
        """Split the experts over the expert group (`distributed.shard` calls it when ep × tp > 1):
        this rank keeps E / (ep·tp) of them and exchanges its tokens with the group's ranks."""
        self.experts.shard_experts_(ep)
        self.expert_parallel = ep

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., h] (this rank's sequence shard under sequence parallelism), token_mask of x's
        leading shape (of the whole sequence under sequence parallelism; 0 = padding, not counted
        in the statistics) -> (y like x, stats [3, E])."""
        if token_mask is not None and self.sp:
            start, end = self.tp.local_range(token_mask.shape[1])
            token_mask = token_mask[:, start:end]
        tokens = x.reshape(-1, x.shape[-1])
        mask = None if token_mask is None else token_mask.reshape(-1)
        share = self.tp is not None and not self.sp  # the routed path runs on this tp rank's share of the tokens
        if share:
            tokens, mask = scatter_tokens(tokens, self.tp), None if mask is None else local_tokens(mask, self.tp)
        routing = self.router(tokens)
        stats = self._stats(routing, mask)
        y = self._routed(tokens, routing)
        if share:
            y = gather_tokens(y, self.tp, len(x.reshape(-1, x.shape[-1])))
        y = y.view_as(x)
        if self.shared_expert is not None:
            y = y + self._shared(x)
        if self.tp is not None:
            stats = reduce_from_tp(stats, self.tp)
        # training forwards only: not activation checkpointing's recomputation (it runs inside backward)
        if self._counting():
            counted = stats[0].detach()
            self.routed_tokens = counted if self.routed_tokens is None else self.routed_tokens + counted
        if self.cp is not None:  # the whole sequences' statistics (the auxiliary loss is not linear in them), each
            stats = sum_over_tp(stats, self.cp)  # rank's gradient its share: summed over cp both ways (the cp group)
        return y, stats

    def _counting(self) -> bool:
        return (self.count_routing and self.training and torch.is_grad_enabled()
                and torch._C._current_graph_task_id() == -1)

    def take_routed_tokens(self) -> torch.Tensor:
        """The tokens routed to each expert [E] by this rank's training forwards since the last call
        (padding not counted; alike on the tp ranks), and start counting again: what the step logs,
        and what `Router.update_correction_bias` takes after each optimizer step."""
        counts = self.routed_tokens if self.routed_tokens is not None else torch.zeros(self.num_experts)
        self.routed_tokens = None
        return counts

    def take_dropped_tokens(self) -> torch.Tensor:
        """The slots dropped over capacity by this rank's training forwards since the last call."""
        dropped, self.dropped_tokens = self.dropped_tokens, None
        return torch.zeros((), dtype=torch.long) if dropped is None else dropped

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's output, × sigmoid(gate(x)) with a gate."""
        shared = self.shared_expert(x)
        if self.shared_expert_gate is None:
            return shared
        return torch.sigmoid(self.shared_expert_gate(x)) * shared

    def _stats(self, routing: Routing, mask: torch.Tensor | None) -> torch.Tensor:
        """[3, E]: tokens per expert, summed loss probabilities, [tokens, summed z-loss, 0...]."""
        experts, probs = routing.experts, routing.probs
        z = torch.logsumexp(routing.logits, dim=-1).square()
        mask = probs.new_ones(len(probs)) if mask is None else mask.to(probs.dtype)
        counts = probs.new_zeros(self.num_experts).scatter_add_(0, experts.reshape(-1),
                                                                mask.repeat_interleave(experts.shape[1]))
        totals = torch.stack([mask.sum(), (z * mask).sum()])
        return torch.stack([counts, (probs * mask[:, None]).sum(0), F.pad(totals, (0, self.num_experts - 2))])

    def _routed(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The experts' weighted outputs summed per token: slots sorted by expert (stable: token
        order within an expert), over capacity dropped, computed, weighted and added back."""
        slots = routing.experts.reshape(-1)
        order = torch.argsort(slots, stable=True)
        counts = routing_counts(slots, self.num_experts)
        if self.capacity_factor is not None:
            order, counts = self._drop_over_capacity(order, counts, len(tokens))
        token_of = order // self.top_k
        out = self._compute(tokens[token_of], counts)
        out = (out * routing.weights.reshape(-1)[order, None]).to(tokens.dtype)
        return torch.zeros_like(tokens).index_add_(0, token_of, out)

    def _drop_over_capacity(self, order: torch.Tensor, counts: torch.Tensor,
                            num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sorted slots without those past each expert's capacity, and the kept counts."""
        capacity = math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)
        starts = counts.cumsum(0) - counts
        rank_in_expert = torch.arange(len(order), device=order.device) - starts.repeat_interleave(counts)
        kept = counts.clamp(max=capacity)
        if self._counting():
            dropped = (counts - kept).sum().detach()
            self.dropped_tokens = dropped if self.dropped_tokens is None else self.dropped_tokens + dropped
        return order[rank_in_expert < capacity], kept

    def _compute(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts on `tokens` sorted by expert (counts [E] rows each) -> their outputs, in
        the same order; under expert parallelism computed on the experts' ranks (all-to-all there
        and back)."""
        if self.expert_parallel is None:
            return self.experts(tokens, counts)
        rows, local_counts, route = dispatch(tokens, counts, self.expert_parallel)
        return combine(self.experts(rows, local_counts), route, self.expert_parallel)

    def extra_repr(self) -> str:
        capacity = "dropless" if self.capacity_factor is None else f"capacity_factor={self.capacity_factor}"
        return f"num_experts={self.num_experts}, top_k={self.top_k}, {capacity}{self.parallel_repr()}"


@contextmanager
def uncounted(model: nn.Module) -> Iterator[None]:
    """The MoE layers of `model` do not count their routing meanwhile (a forward that is not a
    training step's: a pipeline's shape inference)."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for layer in layers:
        layer.count_routing = False
    try:
        yield
    finally:
        for layer in layers:
            layer.count_routing = True


def load_balancing_loss(stats: torch.Tensor, num_experts: int) -> torch.Tensor:
    """transformers' auxiliary loss (Switch Transformer's) from router statistics summed over the
    MoE layers: E · Σ_e (tokens to e / N) · (summed probability of e / N), N the tokens counted
    (over all layers)."""
    tokens = stats[2, 0]
    return num_experts * torch.sum((stats[0] / tokens) * (stats[1] / tokens))


def router_z_loss(stats: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss, the mean over the counted tokens of logsumexp(router logits)²."""
    return stats[2, 1] / stats[2, 0]
