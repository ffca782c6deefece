"""The contract every parallel layer follows, shared by all of `libai_zoo.layers`.

A parallel layer is built at full size and behaves exactly like its `torch.nn` twin until
`libai_zoo.distributed.shard` calls its ``shard_(tp)``: it then keeps its own slice of each parameter as
a DTensor on the tp mesh and communicates in forward/backward. Which sizes must divide by tp is
the layer's own knowledge (`tp_problems`): `distributed.shard` asks every layer before splitting any,
and a layout can be checked on a model built on the meta device, without a process group.
"""

from __future__ import annotations

from libai_zoo.distributed import ContextParallel, TensorParallel


class ParallelLayer:
    """Mixin for modules that split themselves over tensor parallelism.

    ``sequence_parallel`` says whether the layer takes part in sequence parallelism when the
    context turns it on: its activations are then split over the sequence inside the tp group.
    Pass False for a layer that runs on the whole sequence (outside the region between
    `SequenceScatter` and `SequenceGather`).

    ``cp`` is the context-parallel group the sequence is split over (set by `distributed.shard`
    on every parallel layer when cp > 1): a per-token layer ignores it; attention, which mixes
    tokens, exchanges keys and values over it.
    """

    tp: TensorParallel | None = None
    cp: ContextParallel | None = None
    sequence_parallel: bool = True

    @property
    def sp(self) -> bool:
        """True when sharded with sequence parallelism on and this layer taking part."""
        return self.tp is not None and self.tp.sequence_parallel and self.sequence_parallel

    def tp_problems(self, tp_size: int) -> list[str]:
        """Why this layer cannot be split over `tp_size` ranks ([] when it can)."""
        return []

    def cp_problems(self, cp_size: int) -> list[str]:
        """Why this layer cannot run on a sequence split over `cp_size` ranks ([] when it can)."""
        return []

    def shard_(self, tp: TensorParallel) -> None:
        """Keep this rank's slice of the parameters; subclasses split, this replicates the rest."""
        for name, _ in list(self.named_parameters(recurse=False)):
            tp.replicate_parameter(self, name)
        self.tp = tp

    def parallel_repr(self) -> str:
        """Text for extra_repr: the split, and the tp size once sharded."""
        return "" if self.tp is None else f", tp={self.tp.size}" + (", sequence_parallel" if self.sp else "")


def indivisible(value: int, tp_size: int, what: str, fix: str) -> list[str]:
    """[the problem] when `value` does not split evenly over `tp_size` ranks, else []."""
    return [f"{what} = {value} is not divisible by tp = {tp_size}: {fix}"] if value % tp_size else []
