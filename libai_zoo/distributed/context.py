"""The parallel context: one object that owns the process layout of a run.

`init(dp, tp, pp, ep=..., cp=...)` reads torchrun's environment, checks the degrees against the
world size (dp × cp × tp × pp), and builds one named DeviceMesh ``("pp", "edp", "ep", "cp", "tp")``
with tensor parallelism innermost and context parallelism next to it, so a tp group, and then a
cp × tp block, is made of neighbouring ranks (the same node on a GPU cluster). Expert parallelism
splits data parallelism: "dp" = (edp, ep) flattened gives each rank its samples, "ept" = (ep, tp)
flattened is the group an MoE layer's experts are split over, "edp" the data-parallel dimension of
the experts. Context parallelism splits each sample's sequence over "cp": the cp ranks of a dp rank
read the same samples and hold the same parameters, so the dense parameters' gradients meet over
"dp_cp" = (edp, ep, cp) flattened (ZeRO shards over it too, as torchtitan does; it is "dp" itself
at cp = 1). Launched without torchrun it is one process and needs no process group at all.
"""

from __future__ import annotations

import datetime
import gc
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, _redistribute
from torch.distributed.tensor._collective_utils import MeshTopoInfo
from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache

from libai_zoo.config import ConfigError

from .context_parallel import ContextParallel
from .expert_parallel import ExpertParallel
from .rendezvous import attempt_store, forget, shares_agent_store
from .tensor_parallel import TensorParallel

MESH_DIMS = ("pp", "edp", "ep", "cp", "tp")
#: The flattened dimensions: name -> the mesh dimensions it joins.
FLAT_DIMS = {"dp": ("edp", "ep"), "ept": ("ep", "tp")}
#: The dense parameters' data-parallel dimension under context parallelism ("dp" itself at cp = 1).
DP_CP_DIMS = ("edp", "ep", "cp")

_current: ParallelContext | None = None
_connected = False  # the default process group was formed by `connect`: this module tears it down


class ParallelContext:
    """Sizes, ranks, device and meshes of this process; build it with `init`."""

    def __init__(self, dp: int, tp: int, pp: int, *, ep: int = 1, cp: int = 1, rank: int, local_rank: int,
                 device: torch.device, mesh: DeviceMesh | None, sequence_parallel: bool,
                 owns_process_group: bool):
        self.dp, self.tp, self.pp, self.ep, self.cp = dp, tp, pp, ep, cp
        self.world_size = dp * cp * tp * pp
        self.rank = rank
        self.local_rank = local_rank
        self.device = device
        #: The ("pp", "edp", "ep", "cp", "tp") mesh; its flattened "dp", "ept" and "dp_cp" are `submesh`'s.
        self.mesh = mesh
        self._submeshes: dict[str, DeviceMesh] = {} if mesh is None else {
            **{dim: mesh[dim] for dim in MESH_DIMS},
            **{name: mesh[dims]._flatten(name) for name, dims in FLAT_DIMS.items()}}
        if mesh is not None:
            self._submeshes["dp_cp"] = mesh[DP_CP_DIMS]._flatten("dp_cp") if cp > 1 else self._submeshes["dp"]
        self.owns_process_group = owns_process_group
        self.tensor_parallel = (TensorParallel(mesh["tp"], sequence_parallel=sequence_parallel)
                                if tp > 1 else None)
        #: The group each sample's sequence is split over; None at cp = 1.
        self.context_parallel = ContextParallel(mesh["cp"]) if cp > 1 else None
        #: The group an MoE layer's experts are split over (ep × tp ranks); None when ep·tp = 1.
        self.expert_parallel = (ExpertParallel(self._submeshes["ept"], ep=ep, tensor_parallel=self.tensor_parallel)
                                if ep * tp > 1 else None)
        #: Every rank of the run, for collectives outside the mesh's dimensions (rank 0 writes, the
        #: others wait): the process group `init` built the mesh on; None in a one-process run.
        self.world_group: dist.ProcessGroup | None = None if mesh is None else dist.group.WORLD
        self._made_groups: list[dist.ProcessGroup] = []  # by `new_group`

    def new_group(self, ranks: list[int], *, backend: str | None = None,
                  timeout: float | None = None) -> dist.ProcessGroup:
        """A process group of `ranks` that this context owns: `destroy` tears it down with the mesh's.
        Every rank of the run calls it, in the same order (``torch.distributed.new_group``)."""
        limit = datetime.timedelta(seconds=timeout) if timeout is not None else None
        group = dist.new_group(ranks, backend=backend, timeout=limit)
        self._made_groups.append(group)
        return group

    def close_groups(self) -> None:
        """Tear down the groups this context made (the mesh's and `new_group`'s), not the default
        group it was built on: each gloo group holds threads and sockets until it is destroyed, so a
        process that builds context after context (a test harness) would otherwise pile them up."""
        if self.mesh is None:
            return
        groups = [*self.mesh.get_all_groups(), *(sub.get_group() for sub in self._submeshes.values()),
                  *self._made_groups]
        registered = dist.distributed_c10d._world.pg_map
        for group in {id(g): g for g in groups}.values():
            if group is not dist.group.WORLD and group in registered:
                dist.destroy_process_group(group)
        self._made_groups = []

    @property
    def sequence_parallel(self) -> bool:
        return self.tensor_parallel is not None and self.tensor_parallel.sequence_parallel

    def submesh(self, dim: str) -> DeviceMesh | None:
        """The 1-D mesh of one dimension ("dp", "tp", "pp", "ep", "edp", "ept", "cp" or "dp_cp"); None in
        a one-process run."""
        return self._submeshes.get(dim)

    def group(self, dim: str) -> dist.ProcessGroup | None:
        """The process group of one dimension; None in a one-process run."""
        sub = self.submesh(dim)
        return None if sub is None else sub.get_group()

    def rank_in(self, dim: str) -> int:
        """This process's coordinate along one dimension."""
        return 0 if self.mesh is None else self._submeshes[dim].get_local_rank()

    @property
    def dp_rank(self) -> int:
        """Which share of a step's samples this rank reads (its cp ranks read the same)."""
        return self.rank_in("dp")

    @property
    def data_parallel_size(self) -> int:
        """The ranks a dense parameter's gradient is averaged over: dp × cp ("dp_cp")."""
        return self.dp * self.cp

    @property
    def tp_rank(self) -> int:
        return self.rank_in("tp")

    @property
    def pp_rank(self) -> int:
        return self.rank_in("pp")

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    def set_timeout(self, seconds: float) -> None:
        """Bound every later collective of this run's process groups by `seconds` (a collective
        that waits longer raises on gloo, aborts the process on NCCL). Every rank calls it."""
        if self.mesh is None:
            return
        self.barrier()  # no collective is in flight while the timeout changes
        _bound(self._submeshes.values(), seconds)

    def barrier(self) -> None:
        """Every rank of the run waits for the others (rank 0 prepared a directory they write into); a
        no-op in a one-process run."""
        if self.mesh is not None:
            dist.barrier(self.world_group, device_ids=[self.local_rank] if self.device.type == "cuda" else None)

    def __repr__(self) -> str:
        return (f"ParallelContext(world_size={self.world_size}, dp={self.dp}, tp={self.tp}, "
                f"pp={self.pp}, rank={self.rank}, device={self.device}, "
                f"sequence_parallel={self.sequence_parallel}, ep={self.ep}, cp={self.cp})")


def launched_world_size() -> int:
    """The number of processes this run was launched with: the process group's, else torchrun's
    ``WORLD_SIZE`` (1 without it); read before any process group is built."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    """This process's rank: the process group's, else torchrun's ``RANK`` (0 without it)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _processes(count: int) -> str:
    """How to launch `count` processes of tools/train.py."""
    return "one process (python tools/train.py ...)" if count == 1 else \
        f"{count} processes (torchrun --nproc_per_node={count} ...)"


def resolve_sizes(world_size: int, dp: int, tp: int, pp: int, ep: int = 1, cp: int = 1) -> tuple[int, int, int]:
    """Check the degrees against the world size (dp × cp × tp × pp) and infer dp=-1 (ep splits
    dp: it must divide it; ep > 1 with cp > 1 is refused for now); raise a ConfigError that says the fix."""
    for name, value in (("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp)):
        if value < 1:
            raise ConfigError(f"{name}={value} is invalid: parallel sizes are positive integers")
    # cp named only where it is used, so that the messages of runs without it stay as they were
    rest = cp * tp * pp
    names, values = ("cp×tp×pp", f"{cp}×{tp}×{pp}") if cp > 1 else ("tp×pp", f"{tp}×{pp}")
    if dp == -1:
        if world_size % rest:
            raise ConfigError(
                f"world size {world_size} is not divisible by {names} = {values} = {rest}, so dp "
                f"cannot be inferred: launch a multiple of {rest} processes "
                f"(torchrun --nproc_per_node={rest} ...) or change {names.replace('×', '/')}")
        dp = world_size // rest
    elif dp < 1:
        raise ConfigError(f"dp={dp} is invalid: use a positive integer, or -1 to infer it from the world size")
    if dp * rest != world_size:
        raise ConfigError(
            f"world size {world_size} does not match dp×{names} = {dp}×{values} = {dp * rest}: "
            f"launch {_processes(dp * rest)} or "
            f"choose dp, {names.replace('×', ', ')} whose product is {world_size} (dp=-1 infers dp)")
    if dp % ep:
        raise ConfigError(
            f"dp = {dp} is not a multiple of ep = {ep}: expert parallelism splits the data-parallel ranks "
            f"into groups of ep, so choose an ep that divides {dp}, or launch ep × tp × pp × k processes "
            f"so that dp is a multiple of {ep}")
    if ep > 1 and cp > 1:
        raise ConfigError(f"ep = {ep} with cp = {cp}: experts split over ep under context parallelism are not "
                          f"supported yet: set dist.ep=1 (the experts then split over tp alone) or dist.cp=1")
    return dp, tp, pp


def _default_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init(dp: int = -1, tp: int = 1, pp: int = 1, *, ep: int = 1, cp: int = 1, sequence_parallel: bool = False,
         backend: str | None = None, timeout: float | None = None) -> ParallelContext:
    """Set up the process layout of this run and make it the current context.

    Reads torchrun's ``WORLD_SIZE``/``RANK``/``LOCAL_RANK``; without them this is a single
    process and no process group is created. An already initialized default process group (from
    ``accelerate`` or a test harness) is reused. The backend is nccl on CUDA and gloo on CPU.
    ``ep`` splits an MoE model's experts over ep × tp ranks (ep of the dp ranks, which it must
    divide, and the tp ranks: `ParallelContext.expert_parallel`).
    ``cp`` splits each sample's sequence over cp ranks (`ParallelContext.context_parallel`); it
    adds ranks: the world is dp × cp × tp × pp. Experts over ep with cp > 1 are refused for now.
    ``sequence_parallel`` splits norms and dropout over the sequence inside the tp group.
    ``timeout`` (seconds; None: the backend's default) bounds forming the group and every
    collective until `ParallelContext.set_timeout` changes it. Under a torchrun restart the new
    workers form their group from a store of their own attempt (`rendezvous.attempt_store`).
    """
    global _current
    world_size = launched_world_size()
    rank = launched_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    dp, tp, pp = resolve_sizes(world_size, dp, tp, pp, ep, cp)
    if sequence_parallel and tp == 1:
        raise ConfigError("sequence_parallel=True needs tp > 1: it splits the sequence over the tp group")

    device = _default_device(local_rank)
    mesh = None
    owns_process_group = _connected
    if world_size > 1:
        if not dist.is_initialized():
            connect(backend=backend, timeout=timeout)
            owns_process_group = True
        mesh = init_device_mesh(device.type, (pp, dp // ep, ep, cp, tp), mesh_dim_names=MESH_DIMS)
    _current = ParallelContext(dp, tp, pp, ep=ep, cp=cp, rank=rank, local_rank=local_rank, device=device,
                               mesh=mesh, sequence_parallel=sequence_parallel,
                               owns_process_group=owns_process_group)
    if mesh is not None and timeout is not None:  # its groups take the backend's default, not the default group's
        _bound(_current._submeshes.values(), timeout)
    return _current


def connect(*, backend: str | None = None, timeout: float | None = None) -> dist.ProcessGroup | None:
    """Form the default process group of torchrun's processes, before the layout is known (`init`
    then builds its mesh on it and tears it down in `destroy`), and return it (None in one process):
    e.g. to agree on a planned layout. Under a torchrun restart the group starts from a store of its
    own attempt (`attempt_store`)."""
    global _connected
    world_size = launched_world_size()
    if world_size == 1:
        return None
    if dist.is_initialized():
        return dist.group.WORLD
    rank = int(os.environ.get("RANK", "0"))
    device = _default_device(int(os.environ.get("LOCAL_RANK", str(rank))))
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    limit = datetime.timedelta(seconds=timeout) if timeout is not None else None
    if shares_agent_store():
        store = attempt_store(rank, world_size, limit or datetime.timedelta(minutes=10))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=limit)
    else:
        dist.init_process_group(backend, timeout=limit)
    _connected = True
    return dist.group.WORLD


def _bound(meshes, seconds: float) -> None:
    """Set the timeout of the default process group and of the group of every 1-D mesh of `meshes`."""
    for group in [None, *(mesh.get_group() for mesh in meshes)]:
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), group)


def get_context() -> ParallelContext:
    """The context made by the last `init`."""
    if _current is None:
        raise RuntimeError("no parallel context: call libai_zoo.distributed.init(dp=..., tp=..., pp=...) first")
    return _current


def run_group() -> dist.ProcessGroup | None:
    """The group of every rank of this run: the current context's `world_group`; with no context, a
    process group formed outside the zoo (the default one), if any; None in one process."""
    if _current is not None:
        return _current.world_group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def new_group(ranks: list[int], *, backend: str | None = None, timeout: float | None = None) -> dist.ProcessGroup:
    """A process group of `ranks` (every rank calls it, in the same order): the current context's
    (`ParallelContext.new_group`, torn down by `destroy`); with no context, the caller's to destroy."""
    if _current is not None:
        return _current.new_group(ranks, backend=backend, timeout=timeout)
    return dist.new_group(ranks, backend=backend,
                          timeout=datetime.timedelta(seconds=timeout) if timeout is not None else None)


def destroy() -> None:
    """Forget the current context and tear down its groups: the default process group too (and so
    every group) if `init` or `connect` created it, else the groups the context made on it."""
    global _current, _connected
    owned = _connected or (_current is not None and _current.owns_process_group)
    closing = _current is not None and _current.mesh is not None and dist.is_initialized()
    if owned and dist.is_initialized():
        dist.destroy_process_group()  # every group with it
    elif closing:
        _current.close_groups()
    forget()
    _current, _connected = None, False
    _forget_meshes(collect=closing)


def _forget_meshes(collect: bool) -> None:
    """Drop DTensor's caches keyed by mesh; `collect`: then collect the cycles that keep the groups of
    a destroyed mesh alive (0.3 s).

    Meshes compare equal by shape and ranks, not by their process groups: a later context of the same
    shape (a real run after a fake-world plan) would be handed specs whose meshes name destroyed
    groups. And while a cache holds a mesh its gloo groups keep their threads: a process that builds
    context after context (a test harness) would run with hundreds of them.
    """
    # imported here: torch.distributed.tensor.debug imports dynamo and inductor (1.6 s at every start)
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()
    type(DTensor._op_dispatcher.sharding_propagator)._propagate_tensor_meta_cached.cache_clear()
    if collect:
        gc.collect()
