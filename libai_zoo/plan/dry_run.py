"""Build a layout at any world size in one process, with no memory: the model on the meta device,
torch's fake process group at the layout's world size, and the trainer's own path (`parallelize`:
tp split, pipeline stages, activation checkpointing, FSDP2 wrap), then the configured optimizer
over the parts and one step on meta gradients. What each rank holds is counted from the tensors
(`libai_zoo.utils`' byte counters): the planner's static memory must equal it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from torch import nn

from libai_zoo.config import PipelineSettings, run_settings
from libai_zoo.hf import apply_lora_config
from libai_zoo.models import instantiate_model
from libai_zoo.optim import build_optimizer, local_shards, unique_parameters
from libai_zoo.parallel import DataParallel, fsdp_param_dtype, parallelize, residual_dtype
from libai_zoo.utils import local_bytes, optimizer_state_bytes

from .fake_world import fake_world
from .layouts import Layout


@dataclass(frozen=True)
class RankBytes:
    """What one rank of a dry run holds between steps."""

    rank: int
    pp_rank: int
    dp_rank: int  # in the dp × cp group ZeRO shards over (dp rank × cp + cp rank)
    tp_rank: int
    params: int
    grads: int
    optimizer: int


def meta_model(cfg: DictConfig) -> nn.Module:
    """The config's model on the meta device, with its LoRA adapters (`train.lora`)."""
    with torch.device("meta"):
        model = instantiate_model(cfg.model)
        apply_lora_config(model, run_settings(cfg).lora)
    return model


def dry_run_rank(cfg: DictConfig, layout: Layout, rank: int, model: nn.Module | None = None) -> RankBytes:
    """Build `rank` of `layout` under a fake process group and count its parameters, gradients
    and optimizer state (the config's AMP dtype, global batch, LoRA and float8: `run_settings`).
    `model`: the config's `meta_model` to build from, shared by the ranks of a pipeline (at pp > 1
    `parallelize` copies a rank's stages and leaves the whole model as it was; at pp = 1 it splits the
    model itself); None: built here."""
    run = run_settings(cfg)
    with fake_world(layout.world_size, rank, dp=layout.dp, tp=layout.tp, pp=layout.pp, ep=layout.ep, cp=layout.cp,
                    sequence_parallel=layout.sequence_parallel) as ctx:
        model = model if model is not None else meta_model(cfg)
        data_parallel = DataParallel(ctx, layout.zero_stage,
                                     param_dtype=fsdp_param_dtype(run.amp_dtype))
        # the layout's schedule, its layers split evenly (as the planner's overrides run it)
        pipeline = PipelineSettings(layout.schedule, layout.virtual_stages) if layout.pp > 1 else None
        built = parallelize(model, ctx, data_parallel, num_micro_batches=layout.num_micro_batches(run.train.global_batch_size),
                            pipeline=pipeline, activation_checkpoint=layout.activation_checkpoint,
                            residual=residual_dtype(run.amp_dtype, run.train.amp.fp32_residual), float8=run.fp8)
        params = unique_parameters(built.parts)
        for param in params:
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
        optimizer = build_optimizer(cfg.optim, built.parts)
        with local_shards(optimizer):
            optimizer.step()
        return RankBytes(rank, ctx.pp_rank, ctx.rank_in("dp_cp"), ctx.tp_rank,
                         sum(local_bytes(p) for p in params),
                         sum(local_bytes(p.grad) for p in params if p.grad is not None),
                         optimizer_state_bytes(optimizer))


def dry_run(cfg: DictConfig, layout: Layout) -> list[RankBytes]:
    """One rank per pipeline stage: rank 0 of the dp × cp group and tp rank 0 of each pp rank
    (FSDP2 gives rank 0 of its group the most rows; the tp ranks hold equal slices), plus the last
    rank of the first stage's dp × cp group (the fewest rows)."""
    ranks = [pp_rank * layout.dp_cp * layout.tp for pp_rank in range(layout.pp)]
    if layout.dp_cp > 1:
        ranks.append((layout.dp_cp - 1) * layout.tp)
    model = meta_model(cfg) if layout.pp > 1 else None
    return [dry_run_rank(cfg, layout, rank, model) for rank in ranks]
