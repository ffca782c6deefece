"""What `DefaultTrainer` refuses before any process group exists: a batch that does not split into
micro-batches, a model that does not split over tp, its experts over ep × tp, or into pp stages. (The parsed settings, AMP
dtype and sequence length included, are `libai_zoo.config.run_settings`.)"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from libai_zoo import distributed
from libai_zoo.config import instantiate, run_settings
from libai_zoo.models import get_layer_stack
from libai_zoo.parallel import check_pipeline_layout


def accumulation_steps(train: DictConfig, dp: int) -> int:
    """The micro-batches each rank accumulates per step: global_batch_size / (micro_batch_size × dp)."""
    per_step = train.micro_batch_size * dp
    if train.global_batch_size % per_step:
        raise ValueError(f"train.global_batch_size = {train.global_batch_size} is not a multiple of "
                         f"micro_batch_size × dp = {train.micro_batch_size} × {dp} = {per_step}: change one "
                         f"of them (the quotient is the number of accumulated micro-batches)")
    return train.global_batch_size // per_step


def check_layout(cfg: DictConfig, tp: int, pp: int, num_micro_batches: int, ep: int = 1) -> None:
    """Refuse a model that cannot be split over tp, whose experts cannot be split over ep × tp, or
    that cannot be cut into pp stages (it is built on the meta device: no memory, nothing read but
    a config)."""
    with torch.device("meta"):
        model = instantiate(cfg.model)
    problems = distributed.tp_problems(model, tp) if tp > 1 else []
    if problems:
        raise ValueError(f"the model cannot be split over dist.tp = {tp}:\n  " + "\n  ".join(problems))
    problems = distributed.expert_problems(model, ep, tp) if ep * tp > 1 else []
    if problems:
        raise ValueError(f"the model's experts cannot be split over dist.ep × dist.tp = {ep} × {tp}:\n  "
                         + "\n  ".join(problems))
    if pp > 1:
        pipe = run_settings(cfg).pipeline
        check_pipeline_layout(len(get_layer_stack(model)), pp, schedule=pipe.schedule,
                              num_micro_batches=num_micro_batches, virtual_stages=pipe.virtual_stages,
                              boundaries=pipe.boundaries)
