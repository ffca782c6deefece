"""How gradients meet over the data-parallel dimension, for each ZeRO stage.

    zero_stage 0  replicate: every rank keeps everything; one coalesced all-reduce of the
                  gradients per step (after the last micro-batch), then a plain optimizer step
    zero_stage 1  the same all-reduce, and `ZeroRedundancyOptimizer` keeps each rank's share of
                  the optimizer state and broadcasts the parameters it updated
    zero_stage 2  FSDP2 `fully_shard` per layer of the layer stack and on the root, parameters kept
                  gathered from forward to backward (reshard_after_forward=False): gradients
                  are reduce-scattered, optimizer state is sharded
    zero_stage 3  the same with parameters resharded after forward: parameters, gradients and
                  optimizer state are all 1/dp per rank

Every reduction averages over dp; the train step scales each rank's loss by dp / (global number
of targets), so the average is the mean over the whole global batch. FSDP2 composes with tensor
parallelism (its shards are 2-D DTensors on the dp × tp mesh).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from libai_zoo.dist import ParallelContext
from libai_zoo.dist.collectives import all_reduce_coalesced_
from libai_zoo.models import get_layer_stack


class DataParallel:
    """The data-parallel side of a run: wraps the model (ZeRO 2/3), the optimizer (ZeRO 1) and
    reduces gradients (ZeRO 0/1). With dp = 1 every method is a no-op."""

    def __init__(self, ctx: ParallelContext, zero_stage: int = 0, *, offload: bool = False,
                 param_dtype: torch.dtype | None = None):
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"train.zero_stage = {zero_stage} must be 0, 1, 2 or 3")
        if zero_stage and ctx.dp == 1:
            raise ValueError(f"train.zero_stage = {zero_stage} shards over data parallelism, but dist.dp = 1: "
                             f"use train.zero_stage=0, or more processes with dist.dp > 1")
        if offload and zero_stage < 2:
            raise ValueError("train.zero_offload=True offloads FSDP's shards to CPU: it needs train.zero_stage 2 or 3")
        if offload and ctx.device.type == "cpu":
            raise ValueError("train.zero_offload=True keeps FSDP's shards in CPU memory while an accelerator "
                             "computes; this run is already on the CPU: set train.zero_offload=false")
        self.ctx, self.zero_stage, self.offload, self.param_dtype = ctx, zero_stage, offload, param_dtype
        self.group = ctx.group("dp") if ctx.dp > 1 else None
        self._fsdp_modules: list[FSDPModule] = []

    @property
    def shards_parameters(self) -> bool:
        return self.zero_stage >= 2

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """ZeRO 2/3: `fully_shard` each layer of the model's layer stack, then the root (embeddings,
        head). `model` implements the model contract."""
        if not self.shards_parameters:
            return model
        mesh = self.ctx.submesh("dp")
        kwargs = dict(mesh=mesh, reshard_after_forward=self.zero_stage == 3,
                      mp_policy=MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32)
                      if self.param_dtype is not None else MixedPrecisionPolicy(),
                      offload_policy=CPUOffloadPolicy() if self.offload else OffloadPolicy())
        for layer in get_layer_stack(model):
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        self._fsdp_modules += [m for m in model.modules() if isinstance(m, FSDPModule)]
        return model

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """ZeRO 1: the same optimizer, its state sharded over dp by `ZeroRedundancyOptimizer`."""
        if self.zero_stage != 1:
            return optimizer
        # Imported here: torch.distributed.optim scripts its functional optimizers on import (slow, noisy).
        from torch.distributed.optim import ZeroRedundancyOptimizer

        accepted = inspect.signature(type(optimizer).__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        groups = [{k: v for k, v in group.items()} for group in optimizer.param_groups]
        if any(isinstance(p, DTensor) for g in groups for p in g["params"]):
            raise ValueError("train.zero_stage=1 (ZeroRedundancyOptimizer) takes plain tensors: with tensor "
                             "parallelism use train.zero_stage=2 or 3 (FSDP2 composes with tp)")
        return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), process_group=self.group, **defaults)

    @contextmanager
    def micro_batch(self, last: bool):
        """Around one micro-batch's backward: FSDP reduces gradients only after the last one."""
        for module in self._fsdp_modules:
            module.set_requires_gradient_sync(last, recurse=False)
        yield

    @torch.no_grad()
    def reduce_gradients(self, params: list[nn.Parameter]) -> None:
        """ZeRO 0/1: average the gradients over dp in one all-reduce per dtype (FSDP did its own)."""
        if self.group is None or self.shards_parameters:
            return
        buckets: dict[tuple, list[torch.Tensor]] = {}
        for param in params:
            if param.grad is not None:
                grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                buckets.setdefault((grad.dtype, grad.device), []).append(grad)
        for grads in buckets.values():
            all_reduce_coalesced_(grads, self.group, scale=1.0 / self.ctx.dp)

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over dp (in place), e.g. target counts and the logged loss."""
        if self.group is not None:
            torch_dist.all_reduce(value, group=self.group)
        return value
