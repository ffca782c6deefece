"""libai_zoo.parallel: how a model is wrapped for training: activation checkpointing, data
parallelism with ZeRO 0-3 (FSDP2), pipeline stages (torch.distributed.pipelining), and the
allocation of a meta-built model's shards (`materialize`), a cp rank's part of a micro-batch
(`context_parallel_part`), float8 linear layers (`convert_to_float8`)."""

from .activation_checkpoint import apply_activation_checkpointing
from .context_parallel_data import context_parallel_part
from .data_parallel import DataParallel, fsdp_param_dtype
from .float8 import convert_to_float8, gathered_in_float8, kept_reason, precompute_float8_scales
from .materialize import init_parameters, materialize, parameter_seed
from .parallelize import Parallelized, parallelize
from .pipeline import (
    SCHEDULES,
    Pipeline,
    check_pipeline_layout,
    check_stage_holdings,
    optional_modules,
    schedule_evaluates,
    split_layers,
    splits_backward,
    stage_modules,
    stage_ranks,
)
from .residual_precision import cast_residual, residual_dtype, to_residual
from .sharded_generation import layer_by_layer

__all__ = ["apply_activation_checkpointing", "context_parallel_part", "DataParallel", "fsdp_param_dtype", "Pipeline", "SCHEDULES",
           "split_layers", "stage_ranks", "splits_backward", "schedule_evaluates", "check_pipeline_layout",
           "check_stage_holdings", "stage_modules", "optional_modules",
           "materialize", "parallelize", "Parallelized", "init_parameters", "parameter_seed", "layer_by_layer",
           "cast_residual", "residual_dtype", "to_residual", "convert_to_float8", "gathered_in_float8",
           "kept_reason", "precompute_float8_scales"]
