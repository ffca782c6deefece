"""Turn a model (usually still on the meta device) into this rank's training parts: tensor-parallel
split, pipeline stages, activation checkpointing and compile per layer, the data-parallel wrap.
The trainer then allocates them (`materialize`); the planner's dry run counts their bytes as they
are, under a fake process group of any size."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from libai_zoo import distributed
from libai_zoo.config import Float8, PipelineSettings, Recompute
from libai_zoo.models import all_layers, check_trainable, trainable

from .activation_checkpoint import apply_activation_checkpointing
from .data_parallel import DataParallel
from .float8 import convert_to_float8
from .pipeline import Pipeline
from .residual_precision import cast_residual

logger = logging.getLogger("libai_zoo")


@dataclass
class Parallelized:
    """This rank's share of a model, wrapped for training (not yet allocated when built on meta):
    what `parallelize` returns and `DefaultTrainer.build_model` completes."""

    #: The whole model, split over tp. Under pp it stays on the meta device, unsplit (no memory, no
    #: work): the names and global shapes of every stage's parameters, which a checkpoint is checked
    #: against; its stages' parts are pruned copies of it, each split over tp.
    model: nn.Module
    #: The modules this rank trains: the model, or its pipeline stages' parts (real modules with the
    #: full model's names).
    parts: list[nn.Module]
    #: The schedule that runs the parts under pipeline parallelism; None without it.
    pipeline: Pipeline | None
    #: FLOPs of one training token of the whole model (for MFU); None until known (the trainer sets
    #: it from the data's sequence length).
    flops_per_token: float | None = None


def parallelize(model: nn.Module, ctx: distributed.ParallelContext, data_parallel: DataParallel, *,
                num_micro_batches: int = 1, pipeline: PipelineSettings | None = None,
                activation_checkpoint: Recompute | None = None, compile_with: bool | str = False,
                residual: torch.dtype | None = None, float8: Float8 | None = None) -> Parallelized:
    """At pp > 1 this rank's stages (``pipeline``: `run_settings(cfg).pipeline`); `distributed.shard` of
    the model, or of each stage, over tp;
    the linear layers' GEMMs in float8 (`float8`: `run_settings(cfg).fp8`, `convert_to_float8`);
    the residual stream in `residual` under autocast (`cast_residual`), activation checkpointing
    (`run_settings(cfg).activation_checkpoint`: in each stage's stack) and
    torch.compile (True: inductor, or a backend name) per layer of the layer stack; then
    `data_parallel.wrap` of the model or of each stage."""
    model = trainable(model)
    check_trainable(model)
    stages = None
    parts = roots = [model]
    if ctx.pp > 1:
        if pipeline is None:
            raise ValueError(f"pp = {ctx.pp} needs the pipeline settings: pass pipeline=run_settings(cfg).pipeline")
        # the whole model's sizes checked on every rank alike, then each rank splits its stages only
        # (as Megatron-LM builds only its stage's layers): a 405B rank at pp16 shards 8 layers, not 126
        distributed.check_shardable(model, ctx)
        stages = Pipeline(model, ctx, schedule=pipeline.schedule, num_micro_batches=num_micro_batches,
                          virtual_stages=pipeline.virtual_stages, boundaries=pipeline.boundaries)
        logger.info("%s", stages)
        parts, roots = stages.model_parts, stages.stages
    parts = [distributed.shard(part, ctx) for part in parts]
    model = model if stages is not None else parts[0]
    if float8 is not None:
        convert_to_float8(parts, float8, gather_float8=data_parallel.zero_stage >= 1 and data_parallel.group is not None
                          and ctx.tp == 1 and not data_parallel.offload)
    stacks = [all_layers(part) for part in parts]
    layers = [layer for stack in stacks for layer in stack]
    cast_residual(layers, residual)
    if activation_checkpoint is not None:
        count = sum(apply_activation_checkpointing(stack, activation_checkpoint) for stack in stacks)
        logger.info("activation checkpointing (%s) on %d layers", activation_checkpoint.short(), count)
    if compile_with:
        for layer in layers:
            layer.compile(backend="inductor" if compile_with is True else compile_with)
    keep_gathered = stages is not None and stages.splits_backward
    if keep_gathered and data_parallel.zero_stage == 3:
        logger.info("ZeRO-3 under %s: parameters stay gathered from a step's first forward to its last "
                    "backward (the weight gradients come after FSDP's backward hooks)", stages.schedule_name)
    for root, stack in zip(roots, stacks):
        data_parallel.wrap(root, stack, keep_gathered=keep_gathered)
    return Parallelized(model, parts, stages)
