"""`TrainStep`: one optimizer step over a global batch's micro-batches (accumulation, mixed
precision, clipping, the skip of a non-finite step), returning a `StepResult`. The flow of a step
is told in docs/design.md §5.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from libai_zoo import distributed
from libai_zoo.distributed import ParallelContext
from libai_zoo.layers import MoE
from libai_zoo.optim import clip_grad_norm_, local_shards, unique_parameters
from libai_zoo.parallel import (
    DataParallel,
    Pipeline,
    context_parallel_part,
    gathered_in_float8,
    precompute_float8_scales,
)

logger = logging.getLogger("libai_zoo")


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did; the same on every rank except `sync_wait_s`."""

    #: The mean loss over every target of the global batch (without a Mixture of Experts' auxiliary loss).
    loss: float
    #: The global gradient norm before clipping.
    grad_norm: float
    #: Samples of the global batch.
    samples: int
    #: Tokens of the global batch; None when its batches have no ``input_ids``.
    tokens: int | None
    #: The optimizer step was skipped (a non-finite gradient norm, or an fp16 overflow).
    skipped: bool
    #: The loss or the gradient norm was not finite (an fp16 overflow aside): counts toward divergence.
    diverged: bool
    #: Seconds this rank waited in the step's first collective (its lateness shows in the others').
    sync_wait_s: float
    #: fp16's loss scale after the step; None in other modes.
    loss_scale: float | None = None
    #: A Mixture of Experts' auxiliary terms as the loss includes them (router_aux_loss_coef × the
    #: load-balancing loss, + the z-loss), averaged over the micro-batches of the global batch; None
    #: for a model without them.
    aux_loss: float | None = None
    #: A Mixture of Experts' routing over the global batch: the most loaded expert's tokens over the
    #: mean per expert, in the worst layer (1: balanced), and the slots dropped over capacity.
    expert_imbalance: float | None = None
    dropped_tokens: float | None = None

    def scalars(self) -> dict[str, float]:
        """The fields as the scalars a run records (metrics.json, the console)."""
        scalars = {"loss": self.loss, "grad_norm": self.grad_norm, "skipped": float(self.skipped),
                   "diverged": float(self.diverged), "sync_wait_s": self.sync_wait_s, "samples": self.samples}
        if self.tokens is not None:
            scalars["tokens"] = self.tokens
        if self.loss_scale is not None:
            scalars["loss_scale"] = self.loss_scale
        if self.aux_loss is not None:
            scalars["aux_loss"] = self.aux_loss
        if self.expert_imbalance is not None:
            scalars["moe/imbalance"] = self.expert_imbalance
            scalars["moe/dropped_tokens"] = self.dropped_tokens
        return scalars


class TrainStep:
    """Callable on a list of micro-batches (dicts of tensors with targets); returns a `StepResult`.

    ``model_parts``: the model this rank trains (one module, or its pipeline stages' parts), which
    implements the model contract. ``amp_dtype`` None trains in the parameters' dtype; bf16
    autocasts; fp16 autocasts with a dynamic loss scaler that skips a step whose gradients
    overflowed and lowers the scale. A step whose gradient norm is not finite is skipped in every
    mode. ``clip_grad_norm`` None or 0: no clipping. ``ctx``: the run's parallel context (None: one
    process), over whose world group the targets are counted; ``data_parallel`` (wrapped around the
    model, it reduces gradients over dp during backward) syncs on the last micro-batch;
    ``pipeline`` runs the micro-batches through the pipeline schedule. Under context parallelism
    each micro-batch is cut to this cp rank's part of every sequence (`context_parallel_part`) and
    the gradients meet over dp × cp. ``device``: where the batches go (the context's device by default).
    """

    def __init__(self, model_parts: Sequence[nn.Module], optimizer: torch.optim.Optimizer, *,
                 ctx: ParallelContext | None = None, device: torch.device | None = None,
                 amp_dtype: torch.dtype | None = None, clip_grad_norm: float | None = None,
                 data_parallel: DataParallel | None = None, pipeline: Pipeline | None = None,
                 expert_bias_update_rate: float = 0.0):
        if ctx is None and (data_parallel is not None or pipeline is not None):
            raise ValueError("a data-parallel or pipelined TrainStep counts its targets over the run's ranks: pass "
                             "ctx, the ParallelContext the model was parallelized with")
        device = device or (ctx.device if ctx is not None else torch.device("cpu"))
        self.model_parts, self.optimizer, self.device = list(model_parts), optimizer, device
        self.model = self.model_parts[0]  # what the contract's batch methods are asked of
        self.params = unique_parameters(self.model_parts)
        self.names = {id(p): name for part in self.model_parts for name, p in part.named_parameters()}
        #: The parameters whose gradients were not finite in the last skipped step (this rank's shards).
        self.nonfinite_grads: list[str] = []
        self.amp_dtype, self.clip_grad_norm = amp_dtype, clip_grad_norm or 0.0
        self.data_parallel, self.pipeline = data_parallel, pipeline
        self.dp = ctx.dp if ctx is not None else 1  # ranks reading different samples
        # ranks scoring different tokens (dp × cp), over which the gradients are averaged
        self.shards = ctx.data_parallel_size if ctx is not None else 1
        self.world_group = ctx.world_group if ctx is not None else None
        self.replicas = ctx.world_size // self.shards if ctx is not None else 1  # ranks of the same tokens (tp × pp)
        self.context_parallel = ctx.context_parallel if ctx is not None else None
        if pipeline is not None and amp_dtype == torch.float16:
            raise ValueError("fp16 loss scaling is not available under pipeline parallelism: use train.amp.dtype=bf16")
        self.scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
        #: Layers whose weights FSDP2 gathers in float8: their scales are computed after each step.
        self.float8_gathered = gathered_in_float8(self.model_parts)
        self.moe_layers = [m for part in self.model_parts for m in part.modules() if isinstance(m, MoE)]
        self.expert_bias_update_rate = expert_bias_update_rate
        self.tp_group = ctx.group("tp") if ctx is not None and ctx.tp > 1 else None
        # Whether the model has MoE layers at all, and routers with a correction bias (a pipeline
        # stage may hold none): every rank then takes part in the routing's reductions alike.
        found = torch.tensor([float(bool(self.moe_layers)), float(any(
            m.router.e_score_correction_bias is not None for m in self.moe_layers))], device=device)
        if pipeline is not None:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=pipeline.pp_group)
        self.has_moe, has_bias = bool(found[0]), bool(found[1])
        if expert_bias_update_rate and not has_bias:
            raise ValueError(f"train.expert_bias_update_rate = {expert_bias_update_rate} moves the routers' "
                             f"e_score_correction_bias (DeepSeek-V3's balancing), which this model's routers do not "
                             f"have: set it to 0")

    def _total(self, counts: list[float]) -> float:
        """The targets of the whole global batch (summed over dp and cp). Summed over every rank (the
        tp and pp ranks of a dp × cp rank count the same tokens), so that this is the step's first collective
        of all ranks: the time this rank waited in it for the others is recorded (`sync_wait_s`)."""
        total = torch.tensor(sum(counts), dtype=torch.float64, device=self.device)
        start = time.perf_counter()
        if self.world_group is not None:
            dist.all_reduce(total, group=self.world_group)
            total /= self.replicas
        self.sync_wait_s = time.perf_counter() - start
        if total.item() == 0:
            raise ValueError("no labelled targets in this step's batches (every label is -100)")
        return total.item()

    def refresh_float8_scales(self) -> None:
        """After the weights change (an optimizer step, a rollback's load): the float8 scales of the
        weights FSDP2 gathers in float8, from their new values (`precompute_float8_scales`)."""
        precompute_float8_scales(self.float8_gathered)

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    def __call__(self, micro_batches: list[dict]) -> StepResult:
        batches = [{k: v.to(self.device, non_blocking=True) for k, v in b.items()} for b in micro_batches]
        tokens = sum(b["input_ids"].numel() for b in batches) * self.dp \
            if all("input_ids" in b for b in batches) else None
        if self.context_parallel is not None:
            batches = [context_parallel_part(batch, self.model, self.context_parallel) for batch in batches]
        split = [self.model.split_batch(batch) for batch in batches]
        counts = [float(self.model.num_loss_targets(targets)) for _, targets in split]
        total = self._total(counts)
        if self.pipeline is not None:
            loss, aux = self._pipelined(split, total)
        else:
            loss, aux = self._accumulated(batches, counts, total)
        if self.data_parallel is not None:
            self.data_parallel.all_reduce_sum(loss)
            if aux is not None:
                aux = self.data_parallel.all_reduce_sum(aux) / self.shards
        for part in self.model_parts:
            distributed.finalize_grads(part)
        self.scaler.unscale_(self.optimizer)
        pp_group = [self.pipeline.pp_group] if self.pipeline is not None else []
        excluded = self.pipeline.tied.duplicates() if self.pipeline is not None else []
        grad_norm = clip_grad_norm_(self.params, self.clip_grad_norm, sum_over=pp_group, exclude=excluded)
        skipped = False
        loss_value = loss.item()  # the same on every rank (reduced over dp, broadcast from the last stage)
        # Diverged: a non-finite loss, or a non-finite gradient norm that loss scaling does not explain.
        diverged = not math.isfinite(loss_value) or (not self.scaler.is_enabled() and not torch.isfinite(grad_norm))
        with local_shards(self.optimizer):  # an elementwise optimizer steps this rank's shards
            if self.scaler.is_enabled():
                scale = self.scaler.get_scale()
                self.scaler.step(self.optimizer)  # skipped inside when a gradient overflowed
                self.scaler.update()
                skipped = self.scaler.get_scale() < scale
            elif not diverged:
                self.optimizer.step()
            else:
                skipped = True
        if skipped:
            self.nonfinite_grads = self._nonfinite_grads()
            logger.warning("skipped the optimizer step: the loss is %s, the gradient norm %s", loss_value,
                           grad_norm.item())
        self.optimizer.zero_grad(set_to_none=True)
        self.refresh_float8_scales()
        imbalance, dropped = self._routing(update_bias=not skipped) if self.has_moe else (None, None)
        return StepResult(loss=loss_value, grad_norm=grad_norm.item(), samples=sum(_batch_size(b) for b in batches) * self.dp,
                          tokens=tokens, skipped=skipped, diverged=diverged, sync_wait_s=self.sync_wait_s,
                          loss_scale=self.scaler.get_scale() if self.scaler.is_enabled() else None,
                          aux_loss=None if aux is None else aux.item(), expert_imbalance=imbalance,
                          dropped_tokens=dropped)

    def _pipelined(self, split: list[tuple[dict, torch.Tensor]], total: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward and backward of every micro-batch through the pipeline schedule: (this rank's share
        of the mean loss, the mean auxiliary loss or None), the same on every stage."""
        inputs = {key: torch.cat([batch_inputs[key] for batch_inputs, _ in split]) for key in split[0][0]}
        targets = torch.cat([batch_targets for _, batch_targets in split])
        with self._autocast():
            result = self.pipeline.step(inputs, targets, loss_scale=self.shards / total)
        self.pipeline.tied.sync_grads()
        loss = torch.tensor(result.loss / self.shards, device=self.device)
        return loss, None if result.aux_loss is None else torch.tensor(result.aux_loss, device=self.device)

    def _accumulated(self, batches: list[dict], counts: list[float],
                     total: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward and backward of each micro-batch in turn, gradients accumulated (data parallelism
        syncs on the last): (this rank's share of the mean loss, the mean auxiliary loss of this
        rank's micro-batches or None)."""
        loss, aux = torch.zeros((), device=self.device), None
        for i, (batch, count) in enumerate(zip(batches, counts)):
            context = self.data_parallel.micro_batch(last=i == len(batches) - 1) \
                if self.data_parallel is not None else nullcontext()
            if not count and self.context_parallel is not None:
                batch = _one_scored_target(batch)
            with context:
                with self._autocast():
                    output = self.model(**batch, return_logits=False)
                # Each rank's share of the global mean; the dp (× cp) reduction averages, hence × dp·cp.
                micro_loss = output.loss
                objective = micro_loss * (count * self.shards / total)
                if self.model.has_aux_loss:  # a mean over micro-batches, not over targets
                    term = self.model.aux_loss(output.router_stats)
                    micro_loss = micro_loss - term
                    objective = micro_loss * (count * self.shards / total) + term / len(batches)
                    aux = term.detach().float() / len(batches) + (0 if aux is None else aux)
                self.scaler.scale(objective).backward()
            loss += micro_loss.detach().float() * (count / total)
        return loss, aux

    def _routing(self, update_bias: bool) -> tuple[float, float]:
        """The step's routing over the global batch: (worst layer's max / mean tokens per expert,
        slots dropped), from each MoE layer's counts summed over dp (× cp); then DeepSeek-V3's bias update
        of every router that has a correction bias, at `expert_bias_update_rate`."""
        imbalance = torch.zeros((), device=self.device)
        dropped = torch.zeros((), device=self.device)
        if self.moe_layers:
            loads = torch.stack([m.take_routed_tokens().to(self.device) for m in self.moe_layers]).float()
            dropped += sum(m.take_dropped_tokens().to(self.device) for m in self.moe_layers)
            if self.tp_group is not None:  # each tp rank drops from its own share of the tokens
                dist.all_reduce(dropped, group=self.tp_group)
            if self.data_parallel is not None:
                self.data_parallel.all_reduce_sum(loads)
                self.data_parallel.all_reduce_sum(dropped)
            imbalance = (loads.max(1).values / loads.mean(1).clamp_min(1e-9)).max()
            if update_bias and self.expert_bias_update_rate:
                for layer, load in zip(self.moe_layers, loads):
                    if layer.router.e_score_correction_bias is not None:
                        layer.router.update_correction_bias(load, self.expert_bias_update_rate)
        if self.pipeline is not None:  # the stages hold different layers
            dist.all_reduce(imbalance, op=dist.ReduceOp.MAX, group=self.pipeline.pp_group)
            dist.all_reduce(dropped, group=self.pipeline.pp_group)
        return imbalance.item(), dropped.item()

    def _nonfinite_grads(self, limit: int = 5) -> list[str]:
        """The first `limit` parameters (by name) whose gradient shard on this rank is not finite."""
        found = []
        for param in self.params:
            grad = distributed.local(param.grad) if param.grad is not None else None
            if grad is not None and not torch.isfinite(grad).all():
                found.append(self.names.get(id(param), "?"))
                if len(found) == limit:
                    break
        return found


def _batch_size(batch: dict) -> int:
    return next(iter(batch.values())).shape[0]


def _one_scored_target(batch: dict) -> dict:
    """A cp rank's part without targets (padding, a prompt) scoring one dummy target instead: its
    loss, weighted by its 0 targets, adds nothing, but is finite (a mean over no targets is NaN,
    and so would every gradient be); the part still runs, as attention's exchange over cp needs."""
    targets = batch["shift_labels"].clone()
    targets[0, 0] = 0
    return {**batch, "shift_labels": targets}
