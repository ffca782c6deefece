"""What `DefaultTrainer` refuses before any process group exists: a batch that does not split into
micro-batches, a model that does not split over tp, its experts over ep × tp, into pp stages, or its
sequences over cp: on the model the trainer built once on the meta device, with the settings it
parsed once (`libai_zoo.config.run_settings`)."""

from __future__ import annotations

from omegaconf import DictConfig
from torch import nn

from libai_zoo import distributed
from libai_zoo.config import ConfigError, RunSettings
from libai_zoo.models import CausalLM, all_layers, check_trainable
from libai_zoo.parallel import check_pipeline_layout, check_stage_holdings


def accumulation_steps(train: DictConfig, dp: int) -> int:
    """The micro-batches each rank accumulates per step: global_batch_size / (micro_batch_size × dp)."""
    per_step = train.micro_batch_size * dp
    if train.global_batch_size % per_step:
        raise ConfigError(f"train.global_batch_size = {train.global_batch_size} is not a multiple of "
                          f"micro_batch_size × dp = {train.micro_batch_size} × {dp} = {per_step}: change one "
                          f"of them (the quotient is the number of accumulated micro-batches)")
    return train.global_batch_size // per_step


def check_layout(model: nn.Module, settings: RunSettings, num_micro_batches: int) -> None:
    """Refuse a `model` (built on the meta device: no memory, nothing read but a config) that cannot
    be split over the settings' tp, whose experts cannot be split over ep × tp, that cannot be cut
    into pp stages, or whose sequences cannot be split over cp."""
    tp, pp, ep, cp = settings.dist.tp, settings.dist.pp, settings.dist.ep, settings.dist.cp
    check_trainable(model)
    problems = model.layout_problems(sequence_parallel=tp > 1 and settings.dist.sequence_parallel, cp=cp, ep=ep)
    if problems:
        raise ConfigError(f"{type(model).__name__} cannot run this layout:\n  " + "\n  ".join(problems))
    if cp > 1:
        check_context_parallel(model, cp, tp, settings)
    problems = distributed.tp_problems(model, tp) if tp > 1 else []
    if problems:
        raise ConfigError(f"the model cannot be split over dist.tp = {tp}:\n  " + "\n  ".join(problems))
    problems = distributed.expert_problems(model, ep, tp) if ep * tp > 1 else []
    if problems:
        raise ConfigError(f"the model's experts cannot be split over dist.ep × dist.tp = {ep} × {tp}:\n  "
                          + "\n  ".join(problems))
    problems = model.pipeline_problems() if pp > 1 else []
    if problems:
        raise ConfigError(f"the model cannot be cut into dist.pp = {pp} pipeline stages:\n  " + "\n  ".join(problems))
    if pp > 1:
        pipe = settings.pipeline
        check_pipeline_layout(len(all_layers(model)), pp, schedule=pipe.schedule,
                              num_micro_batches=num_micro_batches, virtual_stages=pipe.virtual_stages,
                              boundaries=pipe.boundaries)
        check_stage_holdings(model, pp, schedule=pipe.schedule, virtual_stages=pipe.virtual_stages,
                             boundaries=pipe.boundaries)


def check_context_parallel(model: nn.Module, cp: int, tp: int, settings: RunSettings) -> None:
    """Refuse what context parallelism cannot split: a model that is not a causal LM (its targets
    are the next tokens, shifted over the whole sequence before the split), one whose layers cannot
    run on a split sequence (their ``cp_problems``), or a sequence length that is not a multiple of 2·cp (the
    load-balanced chunks), nor, under sequence parallelism, of cp × tp."""
    name = type(model).__name__
    if settings.fp8 is not None:
        raise ConfigError(f"train.fp8 with dist.cp = {cp}: a float8 scale is taken over the whole sequence of a "
                          f"micro-batch, and no scale is reduced over the cp ranks that hold its parts; set "
                          f"dist.cp=1 (float8 runs beside tp, sequence parallelism, pp and ZeRO), or "
                          f"train.fp8.enabled=false")
    if not isinstance(model, CausalLM):
        raise ConfigError(f"dist.cp = {cp} splits a causal language model's sequences, and {name} is not one (a "
                          f"masked LM or a classifier scores tokens against the whole sequence): set dist.cp=1")
    problems = distributed.cp_problems(model, cp)
    if problems:
        raise ConfigError(f"{name} cannot run with its sequences split over dist.cp = {cp}:\n  " + "\n  ".join(problems))
    seq_len = settings.seq_len
    if seq_len is not None and seq_len % (2 * cp):
        raise ConfigError(f"the sequence length {seq_len} does not split into 2·cp = {2 * cp} equal chunks (dist.cp "
                          f"= {cp}): make the data's sequence length a multiple of {2 * cp}, or change dist.cp")
    if seq_len is not None and settings.dist.sequence_parallel and seq_len % (cp * tp):
        raise ConfigError(f"the sequence length {seq_len} does not split over cp × tp = {cp} × {tp} ranks (context "
                          f"and sequence parallelism): make it a multiple of {cp * tp}, or set "
                          f"dist.sequence_parallel=false")
