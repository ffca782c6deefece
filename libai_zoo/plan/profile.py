"""Measure on this machine what the time model needs, once, and cache it: the compute of one
transformer layer, of the embedding and of the head at a layout's local shapes (one rank of a
fake tp group: real kernels at the shapes a rank runs, no communication), the optimizer's step
per parameter element, and for CPU runs the alpha-beta cost of gloo collectives (a short sweep on
processes of this machine).

The cache is a JSON file (``$LIBAI_ZOO_CACHE`` or ~/.cache/libai_zoo/planner.json) keyed by the
device, the model recipe and the shapes, so a second plan of the same model measures nothing."""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import DictConfig, OmegaConf
from torch.distributed.fsdp import fully_shard

from libai_zoo import distributed
from libai_zoo.models import instantiate_model
from libai_zoo.optim import build_optimizer

from .activations import example_batch, one_of_each_kind, run_stacks
from .fake_world import fake_world


@dataclass(frozen=True)
class ComputeTimes:
    """Seconds of one micro-batch on one rank (measured, or a roofline for an absent device)."""

    layer_forward: float  # one layer of the stacks (on average over their layers, when they differ)
    layer_backward: float
    first: float  # the first stage's own work: embedding forward and backward
    last: float  # the last stage's: final norm, head and loss, forward and backward


def cache_path() -> Path:
    return Path(os.environ.get("LIBAI_ZOO_CACHE", Path.home() / ".cache" / "libai_zoo" / "planner.json"))


def _cached(key: dict, measure) -> dict:
    """The cached value of `key`, or `measure()` stored under it."""
    path = cache_path()
    entries = json.loads(path.read_text()) if path.exists() else {}
    text = json.dumps(key, sort_keys=True)
    if text not in entries:
        entries[text] = measure()
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_suffix(f".{os.getpid()}.tmp")  # processes planning at once do not share one
        staged.write_text(json.dumps(entries, indent=1))
        staged.replace(path)
    return entries[text]


def _here() -> torch.device:
    """This machine's device: the GPU when there is one."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _recipe(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg) if OmegaConf.is_config(cfg) else repr(cfg)


def _measured(what: str, threads: int | None, measure: Callable[[], Any], **key) -> Any:
    """`measure()` on this machine's device (on `threads` CPU threads), cached under `what`, the
    device, the torch version and `key`."""
    device = _here()
    full = {"what": what, "device": device_name(device), "torch": torch.__version__, "threads": threads, **key}
    with _measuring(threads if device.type == "cpu" else None):
        return _cached(full, measure)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu×{torch.get_num_threads()}"


@contextmanager
def _measuring(threads: int | None):
    """Flush denormals (a fake group's outputs are uninitialised memory) and, on CPU, run on
    `threads` threads (a process of a multi-process CPU run has one: torchrun's OMP_NUM_THREADS)."""
    previous = torch.get_num_threads()
    torch.set_flush_denormal(True)
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
        torch.set_flush_denormal(False)


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn()` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _one_of_each_kind(model_cfg, ctx: distributed.ParallelContext, micro_batch: int, seq_len: int):
    """(model, inputs, targets, the share of the model's layers each of its layers stands for): the
    model with one layer of each kind in each stack (`one_of_each_kind`), split over the context's
    tp group, allocated on the device with random weights, in train mode, and a random batch
    (`example_batch`)."""
    with torch.device("meta"):
        model, probe_kinds, kinds = one_of_each_kind(instantiate_model(model_cfg))
    model = distributed.shard(model, ctx)
    distributed.to_empty(model, ctx.device)
    with torch.no_grad():
        for param in model.parameters():
            (param.to_local() if hasattr(param, "to_local") else param).normal_(0.0, 0.02)
    model.init_buffers()
    model.train()
    inputs, targets = model.split_batch(example_batch(model, micro_batch, seq_len, ctx.device, random=True))
    shares = [kinds.count(kind) / len(kinds) for stack in probe_kinds for kind in stack]
    return model, inputs, targets, shares


def _layer_calls(model, inputs, autocast) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.nn.Module, torch.Tensor, dict]]]:
    """(the embedding's output, the last layer's, each layer of `model` with the hidden states and keyword arguments it
    takes), run once without gradients through the stacks."""
    calls = []

    def call(k, i, layer, hidden, layer_inputs):
        calls.append((layer, hidden.detach(), layer_inputs))
        return layer(hidden, **layer_inputs)

    with torch.no_grad(), autocast:
        hidden = model.embed(inputs).detach()
        last, _ = run_stacks(model, inputs, hidden, call=call)
    return hidden, last.detach(), calls


def _measure_compute(model_cfg, tp: int, sequence_parallel: bool, micro_batch: int, seq_len: int,
                     amp_dtype: torch.dtype | None, repeats: int) -> dict:
    with fake_world(tp, 0, tp=tp, sequence_parallel=sequence_parallel) as ctx:
        model, inputs, targets, shares = _one_of_each_kind(model_cfg, ctx, micro_batch, seq_len)
        autocast = torch.autocast(ctx.device.type, dtype=amp_dtype, enabled=amp_dtype is not None)

        def embed():
            with autocast:
                model.embed(inputs).float().sum().backward()

        _, last, calls = _layer_calls(model, inputs, autocast)
        forward = backward = 0.0
        for share, (layer, hidden, layer_inputs) in zip(shares, calls):  # a layer of the model on average
            def layer_forward():
                with autocast:
                    return layer(hidden.requires_grad_(), **layer_inputs)

            def layer_step():
                layer_forward().float().sum().backward()

            once = _timed(lambda: layer_forward(), ctx.device, repeats)
            with torch.no_grad():
                once = min(once, _timed(lambda: layer_forward(), ctx.device, repeats))
            forward += share * once
            backward += share * max(_timed(layer_step, ctx.device, repeats) - once, 0.0)

        def head():
            with autocast:
                model.head_loss(model.final_norm(last.requires_grad_()), targets, "sum").backward()

        return asdict(ComputeTimes(forward, backward, _timed(embed, ctx.device, repeats),
                                   _timed(head, ctx.device, repeats)))


def measure_compute(model_cfg: DictConfig, *, tp: int, sequence_parallel: bool, micro_batch: int, seq_len: int,
                    amp_dtype: torch.dtype | None = None, threads: int | None = None,
                    repeats: int = 3) -> ComputeTimes:
    """The compute of one rank's layer, embedding and head at these shapes, on this machine's
    device (cached). Needs a process without a process group (it forms a fake one)."""
    times = _measured("compute", threads, lambda: _measure_compute(model_cfg, tp, sequence_parallel, micro_batch,
                                                                   seq_len, amp_dtype, repeats),
                      model=_recipe(model_cfg), tp=tp, sp=sequence_parallel, mb=micro_batch, seq=seq_len,
                      amp=str(amp_dtype))
    return ComputeTimes(**times)


def _measure_fsdp_op(model_cfg, tp: int, micro_batch: int, seq_len: int, repeats: int) -> float:
    with fake_world(2 * tp, 0, dp=2, tp=tp) as ctx:
        model, inputs, _, _ = _one_of_each_kind(model_cfg, ctx, micro_batch, seq_len)
        _, _, calls = _layer_calls(model, inputs, torch.autocast(ctx.device.type, enabled=False))
        layer, hidden, layer_inputs = calls[0]

        def step():
            layer(hidden.requires_grad_(), **layer_inputs).float().sum().backward()

        plain = _timed(step, ctx.device, repeats)
        fully_shard(layer, mesh=ctx.submesh("dp"))
        wrapped = _timed(step, ctx.device, repeats)
        return max(wrapped - plain, 0.0) / 2  # an all-gather before forward, a reduce-scatter after backward


def measure_fsdp_op(model_cfg: DictConfig, *, tp: int, micro_batch: int, seq_len: int, threads: int | None = None,
                    repeats: int = 5) -> float:
    """Seconds FSDP2 spends on this rank around one collective of one layer's unit (copying the
    shards into and out of the flat buffer, hooks), apart from the network: a layer's step wrapped by
    `fully_shard` in a fake dp group of 2, less the same step unwrapped, per collective (cached)."""
    return _measured("fsdp", threads, lambda: _measure_fsdp_op(model_cfg, tp, micro_batch, seq_len, repeats),
                     model=_recipe(model_cfg), tp=tp, mb=micro_batch, seq=seq_len)


def measure_optimizer_step(optim_cfg: DictConfig, *, threads: int | None = None, elements: int = 1 << 22) -> float:
    """Seconds the configured optimizer's step takes per parameter element on this device (cached)."""
    def measure() -> float:
        param = torch.nn.Parameter(torch.randn(elements, device=_here()))
        param.grad = torch.randn_like(param)
        optimizer = build_optimizer(optim_cfg, [torch.nn.ParameterList([param])])
        return _timed(optimizer.step, param.device, 3) / elements

    return _measured("optimizer", threads, measure, optim=_recipe(optim_cfg))


# ---------------------------------------------------------------------------- gloo collectives
SWEEP_BYTES = [2**12, 2**16, 2**20, 2**22, 2**24]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _sweep_worker(rank: int, world_size: int, port: int, results) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        for size in SWEEP_BYTES:
            tensor = torch.ones(size // 4)
            seconds = _timed(lambda: dist.all_reduce(tensor), torch.device("cpu"), 5)
            if rank == 0:
                results[size] = seconds
    finally:
        dist.destroy_process_group()


def fit_gloo_link(world_size: int) -> tuple[float, float]:
    """(alpha seconds, beta seconds per byte) of a ring all-reduce among `world_size` gloo processes
    on this machine, fitted by least squares to t = 2(n−1)·alpha + 2(n−1)/n·bytes·beta (cached)."""
    key = {"what": "gloo", "host_cpus": os.cpu_count(), "torch": torch.__version__, "world_size": world_size}

    def measure() -> list[float]:
        with mp.Manager() as manager:
            results = manager.dict()
            # forked on Linux: a CPU plan runs without CUDA or a process group, and a spawned process
            # would spend seconds importing torch for a sweep of a second
            mp.start_processes(_sweep_worker, args=(world_size, _free_port(), results), nprocs=world_size,
                               start_method="fork" if sys.platform == "linux" else "spawn")
            points = [(size, results[size]) for size in SWEEP_BYTES]
        n = world_size
        xs = [2 * (n - 1) / n * size for size, _ in points]
        ys = [seconds for _, seconds in points]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        beta = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
        alpha = max(mean_y - beta * mean_x, 0.0) / (2 * (n - 1))
        return [alpha, max(beta, 0.0)]

    alpha, beta = _cached(key, measure)
    return alpha, beta
