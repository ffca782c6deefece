"""libai_zoo.distributed: the parallel context, tensor-parallel sharding, expert parallelism and
their collectives.

    ctx = distributed.init(dp=2, tp=2, pp=1)   # reads torchrun's env; distributed.init() alone = one process
    ctx = distributed.init(dp=4, ep=2)         # experts split over pairs of the 4 dp ranks: ctx.expert_parallel
    ctx = distributed.init(dp=2, cp=2)         # each sequence split over 2 ranks: ctx.context_parallel
    model = distributed.shard(model)           # every parallel layer keeps its own slice
"""

from .context import (
    ParallelContext,
    connect,
    destroy,
    get_context,
    init,
    launched_rank,
    launched_world_size,
    new_group,
    resolve_sizes,
    run_group,
)
from .context_parallel import ContextParallel, cp_problems, merge_sequence, split_sequence
from .expert_parallel import ExpertParallel
from .rendezvous import progress_store
from .shard import (
    check_shardable,
    dp_rows_of,
    expert_problems,
    fill_shard_,
    finalize_grads,
    parameter_uses,
    retie,
    shard,
    to_empty,
    tp_problems,
    tp_slice_of,
    whole_sequences,
)
from .tensor_parallel import TensorParallel, local, local_range, local_rows

__all__ = ["ParallelContext", "TensorParallel", "ExpertParallel", "ContextParallel", "split_sequence",
           "merge_sequence", "cp_problems", "init", "connect", "get_context", "destroy", "new_group",
           "resolve_sizes", "launched_world_size", "launched_rank", "run_group",
           "progress_store",
           "shard", "check_shardable", "whole_sequences", "tp_problems", "expert_problems", "tp_slice_of", "fill_shard_",
           "dp_rows_of",
           "finalize_grads",
           "parameter_uses", "retie", "to_empty", "local", "local_range", "local_rows"]
