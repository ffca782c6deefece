"""What a parallel layer needs to split itself over the tensor-parallel dimension.

A sharded parameter is a DTensor on the tp mesh (global shape + placement), so checkpoints can
reshard and FSDP2 can compose with it. Layers compute on its local tensor (`local`) with the
explicit collectives of `libai_zoo.distributed.collectives`, which is cheaper than DTensor dispatch.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from .rng import ParallelRNG, tensor_parallel_rng


class MeshGroup:
    """A 1-D mesh of one parallel dimension, with its process group, size and this rank's index."""

    def __init__(self, mesh: DeviceMesh, what: str):
        if mesh.ndim != 1:
            raise ValueError(f"the {what} mesh must be 1-D, got {mesh.ndim}-D")
        self.mesh = mesh
        self.group = mesh.get_group()
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()


class TensorParallel(MeshGroup):
    """The tp mesh a layer is split over, with its group, size and this rank's index."""

    def __init__(self, mesh: DeviceMesh, *, sequence_parallel: bool = False):
        super().__init__(mesh, "tensor-parallel")
        self.sequence_parallel = sequence_parallel
        self._rng: ParallelRNG | None = None

    @property
    def rng(self) -> ParallelRNG:
        """This rank's own random stream, for dropout on split activations (created on first use,
        from the seed the default generator was given)."""
        if self._rng is None:
            self._rng = tensor_parallel_rng(self.rank, self.mesh.device_type)
        return self._rng

    def local_range(self, total: int) -> tuple[int, int]:
        """[start, end) of this rank's equal slice of `total` items."""
        return local_range(total, self.rank, self.size)

    def shard_parameter(self, module: nn.Module, name: str, dim: int) -> None:
        """Replace ``module.<name>`` by a DTensor parameter split along `dim` over tp."""
        self._distribute(module, name, Shard(dim))

    def replicate_parameter(self, module: nn.Module, name: str) -> None:
        """Replace ``module.<name>`` by a DTensor parameter replicated over tp."""
        self._distribute(module, name, Replicate())

    def _distribute(self, module: nn.Module, name: str, placement) -> None:
        distribute_parameter(module, name, self.mesh, placement)

    def __repr__(self) -> str:
        return f"TensorParallel(size={self.size}, rank={self.rank}, sequence_parallel={self.sequence_parallel})"


def distribute_parameter(module: nn.Module, name: str, mesh: DeviceMesh, placement) -> None:
    """Replace ``module.<name>`` (unless None or already a DTensor) by a DTensor parameter placed
    `placement` on the 1-D `mesh`."""
    param = getattr(module, name)
    if param is None or isinstance(param, DTensor):
        return
    # distribute_tensor takes rank 0's values, so every rank ends up with one consistent model.
    sharded = distribute_tensor(param.detach(), mesh, [placement])
    setattr(module, name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def local_range(total: int, index: int, count: int) -> tuple[int, int]:
    """[start, end) of slice `index` when `total` items are cut into `count` equal slices."""
    per_slice = total // count
    return index * per_slice, (index + 1) * per_slice


def local(param: torch.Tensor | None, *, partial_grad: bool = False) -> torch.Tensor | None:
    """The local tensor of a (possibly DTensor) parameter, differentiable.

    ``partial_grad=True`` is for a replicated parameter used on a shard of the data (a norm under
    sequence parallelism): its gradient is then a Partial DTensor, each rank holding a summand,
    which `finalize_grads` (or DTensor itself, lazily) sums over the tp group.
    """
    if not isinstance(param, DTensor):
        return param
    if partial_grad:
        return param.to_local(grad_placements=[Partial()])
    return param.to_local()


def local_rows(param: torch.Tensor, rows: list[tuple[int, int]]) -> torch.Tensor:
    """Rows `rows` ([start, end) ranges of dim 0, joined) of a parameter replicated over tp of which
    this rank computes only those rows, differentiable. Its gradient is partial: each rank fills its
    rows (rows several ranks share get a part from each), summed over tp by `finalize_grads`."""
    whole = local(param, partial_grad=True)
    parts = [whole[start:end] for start, end in rows]
    return parts[0] if len(parts) == 1 else torch.cat(parts)
