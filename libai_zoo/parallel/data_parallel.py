"""How gradients meet over the data-parallel dimension, for each ZeRO stage, on FSDP2's engine.

    zero_stage 0  `replicate` (FSDP2's DDP) on buckets of consecutive layers of the layer stack
                  (at least 25 MiB of parameters each, DDP's bucket size: one layer of a 1B model)
                  and on the root: every rank keeps everything; a bucket's gradients are
                  all-reduced as soon as backward has made them (after the last micro-batch),
                  overlapping the rest of backward; under bf16 autocast the forward gets a bf16
                  copy of the parameters, kept through the step's micro-batches as at ZeRO 1-2
    zero_stage 1  `fully_shard`, parameters kept gathered through a step's micro-batches and
                  gradients kept whole until the last one, then reduce-scattered: optimizer state
                  (and the parameters between steps) 1/dp per rank, every tensor cut evenly
    zero_stage 2  the same, with gradients reduce-scattered after every micro-batch: gradients
                  1/dp per rank too
    zero_stage 3  the same, with parameters resharded after each forward and gathered again for
                  backward: parameters, gradients and optimizer state all 1/dp per rank

Every reduction averages over dp, or under context parallelism over "dp_cp" (dp × cp ranks: the
cp ranks of a dp rank hold the same parameters and different tokens of its samples; ZeRO shards
over them all, as torchtitan does); the train step scales each rank's loss by dp·cp / (global
number of targets), so the average is the mean over the whole global batch. The parameter groups gather
one layer ahead in forward and backward (FSDP2's prefetch), and reductions run while backward
goes on. FSDP2 composes with tensor parallelism (its shards are 2-D DTensors on the dp × tp
mesh) and with pipeline stages: the pipeline schedule drives a wrapped stage module itself, with
no gradient sync and no resharding after backward until its last micro-batch, so under pp ZeRO-2
reduces once per step like ZeRO-1, and ZeRO-3 keeps a stage's parameters gathered from its first
backward to the end of the step (they are 1/dp between steps at every stage). Modules may be
wrapped on the meta device.

Under expert parallelism an MoE layer's experts (split over the expert group, "ept") are their
own unit, wrapped before their layer's, over the "edp" mesh: the dp ranks that hold the same
experts. Their gradients already sum ep dp ranks' tokens (the all-to-all's backward, scaled by
1/ep), so the average over edp is the mean over dp too.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from libai_zoo.config import ConfigError
from libai_zoo.distributed import ParallelContext
from libai_zoo.utils import parameter_bytes

logger = logging.getLogger("libai_zoo")

#: The parameter bytes a ZeRO-0 all-reduce bucket gathers before it starts (DDP's default).
BUCKET_BYTES = 25 * 2**20


def fsdp_param_dtype(amp_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype FSDP2 hands the forward its parameters in, at every ZeRO stage (`replicate`'s
    mixed-precision policy at ZeRO-0): bf16 under bf16 autocast, so the layers compute on one bf16
    copy per step instead of autocast casting every weight again for each micro-batch, while the
    optimizer keeps float32 master weights and gradients are reduced in float32; else None (the
    parameters' own)."""
    return torch.bfloat16 if amp_dtype == torch.bfloat16 else None


def buckets(layers: list[nn.Module], min_bytes: int) -> list[list[nn.Module]]:
    """Consecutive `layers` grouped until each group holds `min_bytes` of (this rank's) parameters;
    the last group takes what is left. Fewer, larger all-reduces for small layers."""
    groups: list[list[nn.Module]] = [[]]
    size = 0
    for layer in layers:
        if size >= min_bytes:
            groups.append([])
            size = 0
        groups[-1].append(layer)
        size += parameter_bytes(layer)
    return [group for group in groups if group]


def expert_modules(layers: list[nn.Module]) -> list[nn.Module]:
    """The outermost modules inside `layers` whose own parameters are split over the expert group
    (an MoE layer's experts under expert parallelism: DTensors on a mesh with an "ept" dimension);
    their LoRA adapters, split alike, go in their unit."""
    found: list[nn.Module] = []
    for layer in layers:
        for module in layer.modules():
            inside = any(module is not outer and any(module is m for m in outer.modules()) for outer in found)
            if not inside and any(isinstance(p, DTensor) and "ept" in (p.device_mesh.mesh_dim_names or ())
                                  for p in module.parameters(recurse=False)):
                found.append(module)
    return found


def set_forward_prefetch(layers: list[FSDPModule], on: bool) -> None:
    """Whether each layer's forward gathers the next layer's parameters while it runs (training), or
    only its own (`layer_by_layer` generation: one layer gathered at a time)."""
    for previous, layer in zip(layers, layers[1:]):
        previous.set_modules_to_forward_prefetch([layer] if on else [])


def _shared_between_layers(layers: list[nn.Module]) -> bool:
    """Whether a parameter belongs to several of `layers` (FSDP2 keeps each in one unit)."""
    seen: set[int] = set()
    for layer in layers:
        own = {id(p) for p in layer.parameters()}
        if own & seen:
            return True
        seen |= own
    return False


class DataParallel:
    """The data-parallel side of a run: wraps the model (or each pipeline stage) so that its
    gradients are averaged over dp, and its state sharded for ZeRO 1-3. With dp = 1 every method
    is a no-op."""

    def __init__(self, ctx: ParallelContext, zero_stage: int = 0, *, offload: bool = False,
                 param_dtype: torch.dtype | None = None):
        if zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"train.zero_stage = {zero_stage} must be 0, 1, 2 or 3")
        if zero_stage and ctx.data_parallel_size == 1:
            raise ConfigError(f"train.zero_stage = {zero_stage} shards over data parallelism, but dist.dp = 1: "
                              f"use train.zero_stage=0, or more processes with dist.dp > 1 (or dist.cp > 1)")
        if offload and zero_stage < 2:
            raise ConfigError("train.zero_offload=True offloads FSDP's shards to CPU: it needs train.zero_stage 2 or 3")
        if offload and ctx.device.type == "cpu":
            raise ConfigError("train.zero_offload=True keeps FSDP's shards in CPU memory while an accelerator "
                              "computes; this run is already on the CPU: set train.zero_offload=false")
        self.ctx, self.zero_stage, self.offload, self.param_dtype = ctx, zero_stage, offload, param_dtype
        #: The dense parameters' data-parallel group, dp × cp ranks ("dp_cp"); None when it is one rank.
        self.group = ctx.group("dp_cp") if ctx.data_parallel_size > 1 else None
        self._fsdp_modules: list[FSDPModule] = []

    def wrap(self, module: nn.Module, layers: list[nn.Module], *, keep_gathered: bool = False) -> nn.Module:
        """Wrap each of `layers` (the layer stack inside `module`), then `module` itself (embeddings,
        head), for this ZeRO stage: `replicate` at 0, `fully_shard` at 1-3 (an MoE layer's experts
        under expert parallelism first, over "edp"). A no-op at dp = 1.
        `keep_gathered`: ZeRO-3 keeps the parameters gathered from a step's first forward to its
        last backward (a zero-bubble pipeline computes weight gradients after FSDP's backward hooks
        have run); they are still 1/dp between steps."""
        if self.group is None:
            return module
        if _shared_between_layers(layers):
            logger.info("a parameter is shared between layers of the stack (a block applied at several depths): "
                        "the stack is one data-parallel unit with the root")
            layers = []
        mesh, expert_mesh = self.ctx.submesh("dp_cp"), self.ctx.submesh("edp")
        mp_policy = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32) \
            if self.param_dtype is not None else MixedPrecisionPolicy()
        if self.zero_stage == 0:
            for experts in expert_modules(layers):
                replicate(experts, mesh=expert_mesh, mp_policy=mp_policy)
            for bucket in buckets(layers, BUCKET_BYTES):
                replicate(bucket if len(bucket) > 1 else bucket[0], mesh=mesh, mp_policy=mp_policy)
            replicate(module, mesh=mesh, mp_policy=mp_policy)
        else:
            offload = CPUOffloadPolicy() if self.offload else OffloadPolicy()
            reshard = self.zero_stage == 3 and not keep_gathered
            for experts in expert_modules(layers):
                fully_shard(experts, mesh=expert_mesh, reshard_after_forward=reshard, mp_policy=mp_policy,
                            offload_policy=offload)
            for target in [*layers, module]:
                fully_shard(target, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy,
                            offload_policy=offload)
            set_forward_prefetch(layers, True)
            for previous, layer in zip(layers, layers[1:]):  # gather one layer ahead in backward too
                layer.set_modules_to_backward_prefetch([previous])
        self._fsdp_modules += [m for m in module.modules() if isinstance(m, FSDPModule)]
        return module

    @contextmanager
    def micro_batch(self, last: bool):
        """Around one micro-batch's forward and backward (without pipeline stages): ZeRO 0/1 reduce
        the gradients after the last one only, ZeRO 2/3 after each; ZeRO 0-2 keep the parameters
        gathered until the last one."""
        for module in self._fsdp_modules:
            module.set_requires_gradient_sync(last or self.zero_stage >= 2, recurse=False)
            module.set_reshard_after_backward(last or self.zero_stage == 3, recurse=False)
        yield

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over dp × cp (in place), e.g. the logged loss: each of those ranks holds its
        own tokens."""
        if self.group is not None:
            dist.all_reduce(value, group=self.group)
        return value
