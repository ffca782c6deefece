"""What 3-D parallelism and ZeRO divide, what they communicate, and the 1F1B pipeline bubble.

A tiny GPT-2 (fp32, global batch 8, data from data/corpus/python_docs.txt, vocabulary 8192 from
data/tokenizer) is trained by `DefaultTrainer` at each layout inside forked gloo processes (the
one-process baseline runs in the parent). Per layout the script reports:

1. training state per rank, counted from the tensors (`libai_zoo.utils.memory`): parameters,
   gradients (read inside the train step just before the optimizer zeroes them: after backward,
   the dp reduction and clipping) and optimizer state, on rank 0 and the largest rank, as ratios to
   the one-process figures, next to the analytic ratios (ZeRO-1: 1/dp of the optimizer state;
   ZeRO-2 with FSDP2: 1/dp of gradients, optimizer state and, at rest, parameters; ZeRO-3: 1/dp of
   everything; tp: 1/tp of the split matrices, norms, row biases and the position table replicated;
   pp: the stage's layers, plus embeddings on the first and the head's copy of the tied embedding
   on the last stage);
2. the collectives of one steady-state step (after a warm-up step) by kind, counted by wrapping the
   `torch.distributed` functions, cross-checked against the c10d ops the dispatcher sees (which also
   catches functional collectives, `torch.ops._c10d_functional.*`); for tensor-parallel layouts the
   all-reduces on the tp group against Megatron-LM's 4 per layer per micro-batch plus the extras;
3. the 1F1B bubble at pp = 4 (4 processes) and pp = 2 (2 processes) for m micro-batches on a larger
   model: 1 - (time a rank computes its stage: forward, loss, backward) / (time of its pipeline step),
   against (p - 1) / (m + p - 1);
4. the share of the data-parallel gradient all-reduce hidden under backward at dp2 and dp4 (ZeRO-0,
   the larger model): the step with its communication against the same step with it removed,
   before (one all-reduce after backward) and after (FSDP2's replicate, per layer during backward).

    python benchmarks/bench_parallel.py                                    # everything, ~30 s on 2 cores
    python benchmarks/bench_parallel.py --layouts dp4,tp4 --bubble-pp ""   # a subset, no bubble runs
    python benchmarks/bench_parallel.py --out benchmarks/results/bench_parallel_2026-11-22_cpu2_fp32.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import io
import itertools
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from bench_common import run_meta, write_json
from libai_zoo import distributed
from libai_zoo.config import LazyConfig, instantiate
from libai_zoo.engine import DefaultTrainer
from libai_zoo.parallel.pipeline import split_layers
from libai_zoo.utils.memory import gradient_bytes, optimizer_state_bytes, parameter_bytes
from support.forked import run_forked

ROOT = Path(__file__).resolve().parents[1]
GLOBAL_BATCH, WORLD = 8, 4

CONFIG = '''
from libai_zoo.config import LazyCall, get_config
from libai_zoo.data import build_gpt_dataset
from libai_zoo.models import GPT2Config, GPT2LMHeadModel

train = get_config("common/train.py").train
dist = get_config("common/train.py").dist
optim = get_config("common/optim.py").optim
model = LazyCall(GPT2LMHeadModel)(config=LazyCall(GPT2Config)(
    vocab_size=8192, n_positions={seq}, n_embd={hidden}, n_layer={layers}, n_head={heads}, bos_token_id=0,
    eos_token_id=0, embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0))
dataloader = dict(train=LazyCall(build_gpt_dataset)(text_file="{text}", tokenizer_dir="{tokenizer}", seq_len={seq},
                                                    cache_dir="{cache}"))
'''

# name -> (dp, tp, pp, zero stage); every layout trains the global batch of 8 on 4 processes.
LAYOUTS = {
    "dp4": (4, 1, 1, 0), "dp4_zero1": (4, 1, 1, 1), "dp4_zero2": (4, 1, 1, 2), "dp4_zero3": (4, 1, 1, 3),
    "tp4": (1, 4, 1, 0), "dp2_tp2": (2, 2, 1, 0), "dp2_tp2_zero3": (2, 2, 1, 3), "pp4_1f1b": (1, 1, 4, 0),
    "tp2_pp2": (1, 2, 2, 0),
}
PP_MICRO_BATCHES = 4  # micro-batches of the pipelined layouts in sections 1-2 (1F1B needs >= pp)


def overrides_for(dp: int, tp: int, pp: int, zero: int, micro_batches: int = 1) -> list[str]:
    """Trainer overrides for a layout; `micro_batches` per step (pipelined layouts), else one per dp rank."""
    return [f"dist.dp={dp}", f"dist.tp={tp}", f"dist.pp={pp}", f"train.zero_stage={zero}",
            f"train.micro_batch_size={GLOBAL_BATCH // dp // micro_batches}"]


def balanced_boundaries(layers: int, pp: int, head_layers: float) -> list[int] | None:
    """First layer of stages 1..pp-1 that minimizes the slowest stage, counting each layer 1 and the last
    stage's LM head + loss `head_layers` more (None: the trainer's default split of equal layer counts)."""
    if head_layers <= 0:
        return None
    def cost(cut):
        edges = [0, *cut, layers]
        costs = [b - a + (head_layers if i == pp - 1 else 0) for i, (a, b) in enumerate(zip(edges, edges[1:]))]
        return max(costs), -min(costs)
    return list(min(itertools.combinations(range(1, layers), pp - 1), key=cost))


# ------------------------------------------------------------------------------ collective counting
KINDS = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather", "_all_gather_base": "all_gather",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "broadcast": "broadcast", "isend": "p2p", "irecv": "p2p", "send": "p2p", "recv": "p2p",
    "batch_isend_irecv": "p2p", "all_to_all": "all_to_all", "all_to_all_single": "all_to_all",
    "reduce": "other", "gather": "other", "scatter": "other", "barrier": "other",
    "send_object_list": "object", "recv_object_list": "object", "broadcast_object_list": "object",
    "all_gather_object": "object",
}
TABLE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p", "all_to_all", "other")
# Where in the stack a collective comes from: these torch subsystems, else the innermost file of this repo.
SUBSYSTEMS = {"/torch/distributed/fsdp/": "FSDP2", "/torch/distributed/_composable/": "FSDP2",
              "/torch/distributed/pipelining/": "pipelining",
              "/torch/distributed/tensor/": "DTensor"}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _payload(name: str, bound: dict) -> int:
    """Bytes a call moves, counted as its largest buffer: the tensor reduced, broadcast, sent or received,
    the gathered output of an all-gather, the input of a reduce-scatter or all-to-all (0 for pickled objects)."""
    if name in ("all_gather_into_tensor", "all_gather_single", "_all_gather_base"):
        return _nbytes(bound.get("output_tensor", bound.get("output")))
    if name == "all_gather":
        return _nbytes(bound.get("tensor_list"))
    if name in ("reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base", "all_to_all_single"):
        return _nbytes(bound.get("input"))
    if name in ("reduce_scatter", "all_to_all"):
        return _nbytes(bound.get("input_list"))
    for key in ("tensor", "tensors"):
        if key in bound:
            return _nbytes(bound[key])
    return 0


class CollectiveRecorder:
    """Wraps the torch.distributed collective functions (in `torch.distributed` and `distributed_c10d`,
    the same wrapper in both, so P2POp's checks still pass); while `active`, records each outermost call
    (a collective implemented by another, e.g. all_gather_into_tensor -> all_gather_single, counts once)."""

    def __init__(self):
        self.active = False
        self.records: list[dict] = []
        self.group_names: dict[tuple, str] = {}
        self._local = threading.local()
        self._ranks: dict[int, tuple] = {}
        for name in KINDS:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapper = self._wrap(name, original)
            for module in (c10d, dist):
                if getattr(module, name, None) is original:
                    setattr(module, name, wrapper)

    def _wrap(self, name: str, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if self.active and depth == 0:
                self._record(name, signature, args, kwargs)
            self._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._local.depth = depth

        wrapper.__bench_wrapped__ = name
        return wrapper

    def _group(self, group) -> str:
        if not dist.is_initialized():
            return "none"
        key = id(group)
        if key not in self._ranks:
            self._ranks[key] = tuple(dist.get_process_group_ranks(group or c10d._get_default_group()))
        ranks = self._ranks[key]
        return self.group_names.get(ranks, "ranks" + ",".join(map(str, ranks)))

    def _record(self, name: str, signature, args, kwargs) -> None:
        site = _call_site()
        if name == "batch_isend_irecv":  # one record per message
            for op in args[0] if args else kwargs["p2p_op_list"]:
                direction = "send" if "send" in getattr(op.op, "__bench_wrapped__", op.op.__name__) else "recv"
                self.records.append(dict(name=name, kind="p2p", op=direction, bytes=_nbytes(op.tensor),
                                         group=self._group(op.group), site=site))
            return
        try:
            binding = signature.bind(*args, **kwargs)
            binding.apply_defaults()
            bound = binding.arguments
        except TypeError:
            bound = {}
        op = bound.get("op")
        if name in ("isend", "send"):
            op = "send"
        elif name in ("irecv", "recv"):
            op = "recv"
        self.records.append(dict(name=name, kind=KINDS[name], op=str(op).split(".")[-1] if op is not None else "",
                                 bytes=_payload(name, bound), group=self._group(bound.get("group")), site=site))


def _call_site() -> str:
    """A short label for who called the collective: a torch subsystem, the autograd Function whose
    backward runs it, or the innermost function of this repository (outside the collective helpers)."""
    frame = sys._getframe(2)
    this_file = os.path.abspath(__file__)
    while frame is not None:
        path = frame.f_code.co_filename
        for marker, label in SUBSYSTEMS.items():
            if marker in path:
                return label
        if path.startswith(str(ROOT)) and "site-packages" not in path and os.path.abspath(path) != this_file:
            qualname = frame.f_code.co_qualname
            if not path.endswith("dist/collectives.py"):
                return f"{Path(path).relative_to(ROOT)}:{qualname}"
            if qualname.endswith(".backward"):
                return qualname
        frame = frame.f_back
    return "?"


class DispatchCounter(TorchDispatchMode):
    """Counts the c10d ops the dispatcher runs (what every torch.distributed call ends in) and the
    functional collectives (`_c10d_functional`, DTensor's redistributions), which bypass the Python API."""

    def __init__(self):
        super().__init__()
        self.c10d: Counter = Counter()
        self.functional: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace = func.namespace
        if namespace == "c10d":
            self.c10d[func.overloadpacket.__name__] += 1
        elif namespace.startswith("_c10d_functional"):
            self.functional[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


RECORDER: CollectiveRecorder | None = None


# ----------------------------------------------------------------------------------- a training run
def build_trainer(config_file: str, output_dir: str, overrides: list[str]) -> DefaultTrainer:
    cfg = LazyConfig.load(config_file)
    cfg = LazyConfig.apply_overrides(cfg, [
        f"train.output_dir={output_dir}", "train.max_iter=100", f"train.global_batch_size={GLOBAL_BATCH}",
        "train.log_period=1000", "train.checkpoint.period=0", "optim.lr=1e-3", "train.clip_grad_norm=1.0",
        *overrides])
    with contextlib.redirect_stdout(io.StringIO()):  # the trainer's console log (its handler keeps this stream)
        trainer = DefaultTrainer(cfg)
    logging.getLogger("libai_zoo").setLevel(logging.WARNING)
    return trainer


def _batches(trainer: DefaultTrainer):
    loader = iter(trainer.build_train_loader(trainer.cfg))
    return lambda: [next(loader) for _ in range(trainer.accumulation)]


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def measure_layout(config_file: str, output_dir: str, overrides: list[str], timed_steps: int) -> dict:
    """One warm-up step (optimizer state, pipeline shapes), one counted step (state bytes, collectives),
    then `timed_steps` timed ones; this rank's figures."""
    trainer = build_trainer(config_file, output_dir, overrides)
    ctx, parts, optimizer = trainer.ctx, trainer.model_parts, trainer.optimizer
    if ctx.mesh is not None:
        RECORDER.group_names = {tuple(dist.get_process_group_ranks(ctx.group(d))): d
                                for d in ("pp", "dp", "tp") if getattr(ctx, d) > 1}
    state: dict = {}
    zero_grad = optimizer.zero_grad

    def measuring_zero_grad(*args, **kwargs):  # TrainStep's last call: gradients still there, state stepped
        if state.get("capture"):
            state.update(params=sum(map(parameter_bytes, parts)), grads=sum(map(gradient_bytes, parts)),
                         optim=optimizer_state_bytes(optimizer), capture=False)
        return zero_grad(*args, **kwargs)

    optimizer.zero_grad = measuring_zero_grad
    next_batches = _batches(trainer)
    trainer.train_step(next_batches())
    _barrier()
    counter = DispatchCounter()
    RECORDER.records, RECORDER.active, state["capture"] = [], True, True
    with counter:
        trainer.train_step(next_batches())
    RECORDER.active = False
    times = []
    for _ in range(timed_steps):
        batches = next_batches()
        _barrier()
        start = time.perf_counter()
        trainer.train_step(batches)
        times.append((time.perf_counter() - start) * 1e3)
    result = dict(coords=(ctx.pp_rank, ctx.dp_rank, ctx.tp_rank), params=state["params"], grads=state["grads"],
                  optim=state["optim"], collectives=RECORDER.records, dispatch_c10d=dict(counter.c10d),
                  functional=dict(counter.functional), step_ms=statistics.median(times),
                  accumulation=trainer.accumulation, micro_batch=trainer.cfg.train.micro_batch_size)
    distributed.destroy()
    return result


def measure_overlap(config_file: str, output_dir: str, overrides: list[str], rounds: int) -> dict:
    """Forward + backward of one micro-batch at ZeRO-0, in alternating rounds, three ways: as the
    trainer runs it (replicate all-reduces each layer's gradients as backward makes them: "after"),
    with the gradient sync removed ("no comm"), and with it removed from backward and done as one
    coalesced all-reduce of every gradient afterwards, which is what ZeRO-0 did before ("before");
    plus that all-reduce alone ("comm"). Median ms of each on this rank."""
    from libai_zoo.distributed.collectives import all_reduce_coalesced_

    trainer = build_trainer(config_file, output_dir, overrides)
    model, data_parallel = trainer.model, trainer.data_parallel
    batch = {k: v.to(trainer.ctx.device) for k, v in _batches(trainer)()[0].items()}
    buffers = [torch.zeros_like(p.to_local()) for p in model.parameters()]
    group = trainer.ctx.group("dp")

    def comm():
        all_reduce_coalesced_(buffers, group)

    def step(sync: bool, serial: bool):
        with data_parallel.micro_batch(last=sync):
            model(**batch, return_logits=False).loss.backward()
        if serial:
            comm()
        model.zero_grad(set_to_none=True)

    ways = {"after": lambda: step(True, False), "no_comm": lambda: step(False, False),
            "before": lambda: step(False, True), "comm": comm}
    for way in ways.values():  # warm-up
        way()
    times = {name: [] for name in ways}
    for _ in range(rounds):
        for name, way in ways.items():
            _barrier()
            start = time.perf_counter()
            way()
            times[name].append((time.perf_counter() - start) * 1e3)
    distributed.destroy()
    return {name: statistics.median(t) for name, t in times.items()}


def analyse_overlap(runs: dict) -> dict:
    """Share of the gradient all-reduce time hidden under backward: 1 - (step - step without it) / its
    time alone, from the slowest rank's medians."""
    result = {}
    for name, ranks in runs.items():
        worst = {way: max(r[way] for r in ranks) for way in ranks[0]}
        result[name] = dict(ms=worst, hidden_before=1 - (worst["before"] - worst["no_comm"]) / worst["comm"],
                            hidden_after=1 - (worst["after"] - worst["no_comm"]) / worst["comm"])
    return result


def measure_bubble(config_file: str, output_dir: str, overrides: list[str], steps: int) -> dict:
    """Per pipeline step of this rank: its wall time inside `Pipeline.step` and the time it computed
    (the torch PipelineStage's forward_one_chunk and backward_one_chunk, and the loss on the last stage,
    timed around each call: backward is measured, not assumed 2x forward)."""
    trainer = build_trainer(config_file, output_dir, overrides)
    next_batches = _batches(trainer)
    trainer.train_step(next_batches())  # builds the schedule (and infers the shapes)
    pipeline = trainer.pipeline
    (schedule,) = pipeline._schedules.values()  # the one built for the training batches
    stage = schedule._stage
    busy = Counter()

    def timed(name, fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                busy[name] += time.perf_counter() - start
        return run

    stage.forward_one_chunk = timed("forward", stage.forward_one_chunk)
    stage.backward_one_chunk = timed("backward", stage.backward_one_chunk)
    schedule._maybe_compute_loss = timed("loss", schedule._maybe_compute_loss)
    pipeline.step = timed("step", pipeline.step)
    rows = []
    for _ in range(steps):
        batches = next_batches()
        _barrier()
        busy.clear()
        trainer.train_step(batches)
        rows.append(dict(busy))
    result = dict(pp_rank=trainer.ctx.pp_rank, micro_batches=pipeline.num_micro_batches, steps=rows)
    distributed.destroy()
    return result


def _run_all(fn, jobs: dict, *args) -> dict:
    return {name: fn(*job, *args) for name, job in jobs.items()}


# ------------------------------------------------------------------------------------------ analysis
def parameter_table(model: nn.Module) -> list[dict]:
    """Every parameter of the one-process model once: bytes, whether tp splits it (the vocabulary
    embedding, column-parallel weights and biases, row-parallel weights) and where a pipeline keeps it."""
    split: set[int] = set()
    for module in model.modules():
        kind = type(module).__name__
        if kind == "VocabEmbedding" or getattr(module, "parallel", None) == "col":
            split.update(id(p) for p in module.parameters(recurse=False))
        elif getattr(module, "parallel", None) == "row":
            split.add(id(module.weight))
    last = {id(p) for path in model.last_stage_modules for p in model.get_submodule(path).parameters()}
    table = []
    for name, param in model.named_parameters():  # a tied weight once, under its first-stage name
        if name.startswith(model.layer_stack + "."):
            where = int(name[len(model.layer_stack) + 1:].split(".")[0])
        elif name.startswith(tuple(path + "." for path in model.first_stage_modules)):
            where = "first+last" if id(param) in last else "first"
        else:
            where = "last"
        table.append(dict(name=name, bytes=param.numel() * param.element_size(), split=id(param) in split,
                          where=where))
    return table


def expected_state(table: list[dict], layers: int, dp: int, tp: int, pp: int, zero: int, coords) -> dict:
    """Analytic bytes on the rank at `coords` (pp_rank, dp_rank, tp_rank): its stage's parameters, split
    ones 1/tp, all 1/dp under FSDP (ZeRO 1-3); gradients alike (read after the step's last micro-batch);
    AdamW's two moments per parameter (1/dp under ZeRO) and a 4-byte step counter per parameter tensor."""
    pp_rank = coords[0]
    stage_layers = split_layers(layers, pp)[pp_rank]
    first, last = pp_rank == 0, pp_rank == pp - 1
    params, tensors = 0.0, 0
    for entry in table:
        where = entry["where"]
        if isinstance(where, int):
            copies = int(where in stage_layers)
        elif where == "first+last":
            copies = 1 if pp == 1 else int(first) + int(last)
        else:
            copies = int(first if where == "first" else last)
        params += copies * entry["bytes"] / (tp if entry["split"] else 1)
        tensors += copies
    fsdp = dp if zero >= 1 else 1
    return dict(params=params / fsdp, grads=params / fsdp, optim=2 * params / fsdp + 4 * tensors)


def tp_analytic(a, layers: int, tp: int, pp: int, coords, accumulation: int, micro_batch: int) -> dict:
    """All-reduces on the tp group per step for the rank at `coords`: Megatron-LM's 4 per layer per
    micro-batch of b×s×h (attention and MLP: row-parallel output forward, column-parallel input gradient
    backward), plus the first stage's vocabulary-embedding forward, the last stage's LM-head input gradient
    and vocab-parallel cross entropy (a MAX of b×s and a SUM of 2×b×s floats), and the gradient-norm scalar."""
    pp_rank = coords[0]
    local_layers = len(split_layers(layers, pp)[pp_rank])
    n, act, tokens = accumulation, micro_batch * a.seq * a.hidden * 4, micro_batch * a.seq * 4
    first, last = pp_rank == 0, pp_rank == pp - 1
    extras = {"vocab embedding fwd": (n * first, n * act * first),
              "LM-head input bwd": (n * last, n * act * last),
              "cross-entropy MAX": (n * last, n * tokens * last),
              "cross-entropy SUM": (n * last, 2 * n * tokens * last),
              "grad-norm": (1, 4)}
    megatron = (4 * local_layers * n, 4 * local_layers * n * act)
    return dict(local_layers=local_layers, megatron=megatron, extras=extras,
                total=(megatron[0] + sum(c for c, _ in extras.values()),
                       megatron[1] + sum(b for _, b in extras.values())))


def _site_label(record: dict) -> str:
    site = record["site"]
    if "cross_entropy" in site:
        return f"cross-entropy {record['op']}"
    if "embedding.py" in site:
        return "vocab embedding fwd"
    if site.endswith("_CopyToTP.backward"):
        return "copy_to_tp bwd"
    if "linear.py" in site or "transformer_layer.py" in site or "attention.py" in site or "mlp.py" in site:
        return "row-parallel fwd"
    if "clip_grad" in site:
        return "grad-norm"
    return site


def aggregate_calls(records: list[dict]) -> list[dict]:
    """The step's calls grouped by (function, kind, op, group, call site): number and bytes."""
    groups: dict[tuple, list[int]] = {}
    for r in records:
        key = (r["name"], r["kind"], r["op"], r["group"], r["site"])
        groups.setdefault(key, [0, 0])
        groups[key][0] += 1
        groups[key][1] += r["bytes"]
    return [dict(zip(("function", "kind", "op", "group", "site"), key), calls=n, bytes=b)
            for key, (n, b) in groups.items()]


def summarize_collectives(records: list[dict]) -> dict:
    kinds = {kind: [0, 0] for kind in (*TABLE_KINDS, "object")}
    for r in records:
        kinds[r["kind"]][0] += 1
        kinds[r["kind"]][1] += r["bytes"]
    return kinds


def _kib(n: float) -> str:
    return f"{n / 1024:.0f}" if n >= 10240 else f"{n / 1024:.1f}"


def _size(n: float) -> str:
    return f"{n:.0f} B" if n < 1024 else f"{_kib(n)} KiB"


def analyse(a, table, baseline: dict, layout_results: dict) -> dict:
    out = {}
    for name, ranks in layout_results.items():
        dp, tp, pp, zero = LAYOUTS[name]
        entry = dict(layout=dict(dp=dp, tp=tp, pp=pp, zero_stage=zero), per_rank=[])
        for rank, r in enumerate(ranks):
            expected = expected_state(table, a.layers, dp, tp, pp, zero, r["coords"])
            coll = summarize_collectives(r["collectives"])
            python_c10d = sum(1 for x in r["collectives"] if x["kind"] != "object")
            dispatch_total = sum(r["dispatch_c10d"].values())
            entry["per_rank"].append(dict(
                rank=rank, coords=dict(zip(("pp", "dp", "tp"), r["coords"])),
                state_bytes={k: r[k] for k in ("params", "grads", "optim")}, expected_bytes=expected,
                collectives=coll, dispatch_c10d=r["dispatch_c10d"], functional=r["functional"],
                python_calls=python_c10d, dispatch_calls=dispatch_total, step_ms=r["step_ms"],
                calls=aggregate_calls(r["collectives"])))
            if tp > 1:
                analytic = tp_analytic(a, a.layers, tp, pp, r["coords"], r["accumulation"], r["micro_batch"])
                measured = [x for x in r["collectives"] if x["group"] == "tp" and x["kind"] == "all_reduce"]
                by_site: dict[str, list[int]] = {}
                for x in measured:
                    by_site.setdefault(_site_label(x), [0, 0])
                    by_site[_site_label(x)][0] += 1
                    by_site[_site_label(x)][1] += x["bytes"]
                entry["per_rank"][-1]["tp_all_reduce"] = dict(
                    measured=(len(measured), sum(x["bytes"] for x in measured)), by_site=by_site,
                    micro_batches=r["accumulation"], micro_batch=r["micro_batch"], **analytic)
        for key in ("params", "grads", "optim"):
            base = baseline[key]
            entry[key] = dict(rank0=ranks[0][key] / base, max=max(r[key] for r in ranks) / base,
                              exp_rank0=entry["per_rank"][0]["expected_bytes"][key] / base,
                              exp_max=max(p["expected_bytes"][key] for p in entry["per_rank"]) / base)
        entry["step_ms"] = max(r["step_ms"] for r in ranks)
        out[name] = entry
    return out


def analyse_bubble(runs: dict) -> dict:
    out = {}
    for name, ranks in runs.items():
        p, m = len(ranks), ranks[0]["micro_batches"]
        per_rank = []
        for r in ranks:
            fractions = [1 - (s.get("forward", 0) + s.get("backward", 0) + s.get("loss", 0)) / s["step"]
                         for s in r["steps"]]
            compute = [s.get("forward", 0) + s.get("backward", 0) + s.get("loss", 0) for s in r["steps"]]
            per_rank.append(dict(pp_rank=r["pp_rank"], bubble=statistics.median(fractions),
                                 step_ms=statistics.median(s["step"] for s in r["steps"]) * 1e3,
                                 compute_ms=statistics.median(compute) * 1e3,
                                 forward_ms=statistics.median(s.get("forward", 0) for s in r["steps"]) * 1e3,
                                 backward_ms=statistics.median(s.get("backward", 0) for s in r["steps"]) * 1e3))
        # With unequal stages (the last one holds the LM head): step ≈ Σ t_i + (m - 1) max t_i, t_i = a
        # stage's compute per micro-batch; rank i idles 1 - m t_i / step of it.
        per_micro = [r["compute_ms"] / m for r in per_rank]
        predicted_step = sum(per_micro) + (m - 1) * max(per_micro)
        out[name] = dict(pp=p, micro_batches=m, analytic=(p - 1) / (m + p - 1),
                         measured_mean=statistics.mean(r["bubble"] for r in per_rank),
                         imbalanced_analytic_mean=statistics.mean(1 - m * t / predicted_step for t in per_micro),
                         per_rank=per_rank)
    return out


# ---------------------------------------------------------------------------------------- printing
def print_report(a, baseline: dict, layouts: dict, tp_rows: list, bubble: dict) -> None:
    print(f"1-process baseline: parameters {_kib(baseline['params'])} KiB, gradients {_kib(baseline['grads'])} KiB, "
          f"AdamW state {_kib(baseline['optim'])} KiB, step {baseline['step_ms']:.1f} ms")
    if layouts:
        print("\n1) training state per rank ÷ 1-process (measured r0 = rank 0, max = largest rank; exp = analytic)")
        head = " ".join(f"{k + ' r0':>9} {'max':>6} {'exp r0':>7} {'max':>6} |" for k in ("params", "grads", "optim"))
        print(f"{'layout':<15}|{head}")
        for name, e in layouts.items():
            cells = " ".join(f"{e[k]['rank0']:>9.3f} {e[k]['max']:>6.3f} {e[k]['exp_rank0']:>7.3f} "
                             f"{e[k]['exp_max']:>6.3f} |" for k in ("params", "grads", "optim"))
            print(f"{name:<15}|{cells}")

        print("\n2) collectives in one steady-state training step, rank 0: calls / bytes (of the reduced, "
              "gathered-into, scattered-from or sent tensors); step ms = median, slowest rank")
        print(f"{'layout':<15}{'step ms':>8} " + " ".join(f"{k:>15}" for k in TABLE_KINDS)
              + f" {'c10d py/disp':>13} {'functional':>10}")
        for name, e in layouts.items():
            r0 = e["per_rank"][0]
            cells = " ".join(f"{(str(n) + ' / ' + _size(b)) if n else '-':>15}" for n, b in
                             (r0["collectives"][k] for k in TABLE_KINDS))
            check = f"{r0['python_calls']}/{r0['dispatch_calls']}"
            print(f"{name:<15}{e['step_ms']:>8.1f} {cells} {check:>13} {sum(r0['functional'].values()):>10}")

    if tp_rows:
        print(f"\n   all-reduces on the tp group per step, rank 0 (and the last stage's first rank under pp); "
              f"b×s×h per micro-batch = mb×{a.seq}×{a.hidden} fp32")
        print(f"{'layout, rank':<19}{'micro':>6}{'mb':>4}{'layers':>7} {'measured n/KiB':>16} {'Megatron 4·L·m':>16} "
              f"{'+ extras':>14} {'= analytic':>14}")
        for name, t in tp_rows:
            cell = lambda pair: f"{pair[0]} / {_kib(pair[1])}"  # noqa: E731
            extras = (t["total"][0] - t["megatron"][0], t["total"][1] - t["megatron"][1])
            print(f"{name:<19}{t['micro_batches']:>6}{t['micro_batch']:>4}{t['local_layers']:>7} "
                  f"{cell(t['measured']):>16} {cell(t['megatron']):>16} {cell(extras):>14} {cell(t['total']):>14}")
        for name, t in tp_rows:
            parts = ", ".join(f"{site} {n}" for site, (n, _) in sorted(t["by_site"].items()))
            print(f"   {name}: {parts}")

    if bubble:
        print("\n3) 1F1B bubble = 1 - compute / step per rank (compute = timed forward_one_chunk + loss + "
              "backward_one_chunk)")
        splits = {b["pp"]: "/".join(str(len(r)) for r in split_layers(a.bubble_layers, b["pp"], b["boundaries"]))
                  for b in bubble.values()}
        print(f"   GPT-2 hidden {a.bubble_hidden}, {a.bubble_layers} layers, seq {a.bubble_seq}, global batch "
              f"{GLOBAL_BATCH}; layers per stage " + ", ".join(f"pp{p}: {v}" for p, v in splits.items())
              + f" (LM head + loss counted as {a.head_layers:g} layers)")
        print(f"{'run':<14}{'p':>3}{'m':>4} {'analytic':>9} {'measured':>9} {'pred.':>7}   "
              f"per rank: bubble (step ms, compute ms, bwd/fwd)")
        for name, b in bubble.items():
            ranks = "  ".join(f"{r['bubble']:.2f} ({r['step_ms']:.0f}, {r['compute_ms']:.0f}, "
                              f"{r['backward_ms'] / max(r['forward_ms'], 1e-9):.1f})" for r in b["per_rank"])
            print(f"{name:<14}{b['pp']:>3}{b['micro_batches']:>4} {b['analytic']:>9.3f} {b['measured_mean']:>9.3f} "
                  f"{b['imbalanced_analytic_mean']:>7.3f}   {ranks}")


NOTES = """
notes:
- State bytes are counted from the tensors (DTensor local shards), not RSS. ZeRO-0 is FSDP2's
  replicate (per-layer gradient all-reduces during backward). ZeRO-1 and ZeRO-2 are FSDP2 with
  reshard_after_forward=False: every tensor is cut evenly over dp at rest (parameters, optimizer
  state), gathered whole from forward to the end of backward; ZeRO-1 keeps gradients whole across
  a step's micro-batches and reduce-scatters them after the last, ZeRO-2 after each. ZeRO-3 also
  reshards after forward, so it all-gathers each unit twice (forward and backward). Optimizer state =
  AdamW's two moments plus a 4-byte step counter per parameter tensor (not sharded by FSDP). A
  pipeline's last stage holds its own copy of the embedding tied to the LM head, so under pp the
  largest rank is an end stage.
- Collectives are counted by wrapping torch.distributed's functions (FSDP2, pipelining,
  and libai_zoo all call them), with bytes = the full buffer each call moves
  (not the per-link traffic of the algorithm). "c10d py/disp" compares those calls with the c10d ops
  the dispatcher ran; equal numbers mean nothing went around the Python API. Functional collectives
  (torch.ops._c10d_functional, DTensor's redistribute) cannot be wrapped in Python and are counted at
  the dispatcher only; 0 means none ran (libai_zoo's tp layers use explicit collectives on local
  tensors). The dp layouts add two scalar all-reduces per step (target count, logged loss); pp adds a
  loss broadcast and the tied-embedding gradient all-reduce between the end stages.
- tp extras over Megatron's 4·L per micro-batch: the vocab-parallel embedding's forward all-reduce,
  the LM head input's gradient all-reduce (its column-parallel copy_to_tp), vocab-parallel cross
  entropy's MAX and SUM all-reduces (b×s and 2×b×s floats), and one gradient-norm all-reduce of the
  squared norm of the tp-split gradients (the norms' and biases' are replicated and counted locally).
- Bubble: on CPU, 4 processes on 2 cores (pp=4) are oversubscribed: compute slows when all stages
  are busy and speeds up in the bubbles, so the timings distort the fraction; pp=2 runs 2 processes
  (one core each). Backward is timed, not taken as 2x forward (bwd/fwd above). The last stage also
  runs the 8192-way LM head and loss, so the layers are cut with train.pipeline.boundaries to even
  out the stages (--head-layers 0: equal layer counts); "pred." is the mean bubble predicted from the
  measured per-stage compute t_i (step ≈ Σ t_i + (m-1)·max t_i). Waiting on p2p and the schedule's
  own Python time count as bubble.
- Overlap: "before" is what ZeRO-0 did until now (one coalesced all-reduce of every gradient after
  the last backward: nothing hidden by construction); "after" is FSDP2's replicate, which starts each
  layer's all-reduce as soon as backward has made its gradients. hidden = 1 - (step - step without
  the sync) / (the all-reduce alone). On 2 CPU cores gloo's communication threads compete with
  compute for the same cores, so the share hidden here understates what separate NCCL streams hide.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"subset of {','.join(LAYOUTS)} ('' for none)")
    parser.add_argument("--timed-steps", type=int, default=3, help="timed steps per layout (median step ms)")
    parser.add_argument("--micro-batches", default="4,8", help="micro-batch counts of the bubble runs")
    parser.add_argument("--bubble-pp", default="4,2", help="pipeline sizes of the bubble runs ('' for none)")
    parser.add_argument("--bubble-hidden", type=int, default=128)
    parser.add_argument("--bubble-layers", type=int, default=16)
    parser.add_argument("--bubble-seq", type=int, default=128)
    parser.add_argument("--bubble-steps", type=int, default=5, help="timed pipeline steps (median taken)")
    parser.add_argument("--head-layers", type=float, default=4.0,
                        help="cost of the LM head + loss in layers, to balance the bubble runs' stages "
                             "(0: equal layer counts, the trainer's default)")
    parser.add_argument("--overlap-dp", default="2,4", help="dp sizes of the overlap runs ('' for none)")
    parser.add_argument("--overlap-rounds", type=int, default=7, help="timed rounds of the overlap runs (median)")
    parser.add_argument("--documents", type=int, default=200, help="documents of the corpus to tokenize")
    parser.add_argument("--out", help="also write the results as JSON here")
    a = parser.parse_args()
    names = [n.strip() for n in a.layouts.split(",") if n.strip()]
    if unknown := [n for n in names if n not in LAYOUTS]:
        parser.error(f"unknown layout(s) {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    micro_batches = [int(m) for m in a.micro_batches.split(",") if m.strip()]
    bubble_pp = [int(p) for p in a.bubble_pp.split(",") if p.strip()]
    overlap_dp = [int(d) for d in a.overlap_dp.split(",") if d.strip()]
    for p in bubble_pp:
        if p not in (2, 4) or any(m < p or GLOBAL_BATCH % m for m in micro_batches):
            parser.error(f"bubble runs take pp 2 or 4 and micro-batch counts m >= pp dividing {GLOBAL_BATCH}")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(var, None)
    warnings.filterwarnings("ignore")
    global RECORDER
    RECORDER = CollectiveRecorder()
    started = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        documents = (ROOT / "data/corpus/python_docs.txt").read_text().split("\n\n")[:a.documents]
        (root / "text.txt").write_text("\n\n".join(documents))
        files = {}
        for key, (hidden, layers, seq) in {"main": (a.hidden, a.layers, a.seq),
                                           "bubble": (a.bubble_hidden, a.bubble_layers, a.bubble_seq)}.items():
            files[key] = root / f"{key}.py"
            files[key].write_text(CONFIG.format(hidden=hidden, layers=layers, heads=a.heads, seq=seq,
                                                text=root / "text.txt", tokenizer=ROOT / "data/tokenizer",
                                                cache=root / "cache"))
        # The one-process baseline, in this process (it also fills the token cache the workers read).
        base = measure_layout(str(files["main"]), str(root / "one_process"), ["train.micro_batch_size=8"],
                              a.timed_steps)
        table = parameter_table(instantiate(LazyConfig.load(str(files["main"])).model))

        jobs = {n: (str(files["main"]), str(root / n),
                    overrides_for(*LAYOUTS[n], PP_MICRO_BATCHES if LAYOUTS[n][2] > 1 else 1)) for n in names}
        raw = {}
        if jobs:
            ranks = run_forked(_run_all, WORLD, measure_layout, jobs, a.timed_steps)
            raw = {n: [r[n] for r in ranks] for n in names}
        bubble_raw, boundaries = {}, {}
        for p in bubble_pp:
            cut = balanced_boundaries(a.bubble_layers, p, a.head_layers)
            extra = [f"train.pipeline.boundaries=[{','.join(map(str, cut))}]"] if cut else []
            runs = {f"pp{p}_m{m}": (str(files["bubble"]), str(root / f"bubble_pp{p}_m{m}"),
                                    overrides_for(1, 1, p, 0, m) + extra) for m in micro_batches}
            boundaries[p] = cut
            ranks = run_forked(_run_all, p, measure_bubble, runs, a.bubble_steps)
            bubble_raw.update({n: [r[n] for r in ranks] for n in runs})
        overlap_raw = {}
        for d in overlap_dp:  # the bubble model (larger): one micro-batch of 8 / dp per rank at ZeRO-0
            runs = {f"dp{d}": (str(files["bubble"]), str(root / f"overlap_dp{d}"), overrides_for(d, 1, 1, 0))}
            ranks = run_forked(_run_all, d, measure_overlap, runs, a.overlap_rounds)
            overlap_raw.update({n: [r[n] for r in ranks] for n in runs})

    layouts = analyse(a, table, base, raw)
    tp_rows = []
    for n, e in layouts.items():
        if e["layout"]["tp"] > 1:
            last = next(r for r in e["per_rank"] if r["coords"]["pp"] == e["layout"]["pp"] - 1)
            tp_rows += [(f"{n} r{i}", e["per_rank"][i]["tp_all_reduce"]) for i in dict.fromkeys((0, last["rank"]))]
    bubble = analyse_bubble(bubble_raw)
    overlap = analyse_overlap(overlap_raw)
    for b in bubble.values():
        b["boundaries"] = boundaries[b["pp"]]
    meta = run_meta("cpu", dtype="fp32", processes=WORLD, backend="gloo", global_batch=GLOBAL_BATCH,
                    hidden=a.hidden, layers=a.layers, heads=a.heads, seq=a.seq, vocab=8192,
                    bubble=dict(hidden=a.bubble_hidden, layers=a.bubble_layers, seq=a.bubble_seq, pp=bubble_pp,
                                micro_batches=micro_batches, steps=a.bubble_steps, head_layers=a.head_layers,
                                boundaries={f"pp{p}": cut for p, cut in boundaries.items()}),
                    cpus=os.cpu_count(), worker_threads=1, wall_s=round(time.perf_counter() - started, 1))
    print(json.dumps(meta))
    print_report(a, base, layouts, tp_rows, bubble)
    if overlap:
        print("\n4) gradient all-reduce hidden under backward at ZeRO-0 (forward + backward of one micro-batch, "
              "slowest rank's median ms)")
        print(f"{'run':<6}{'no comm':>9}{'comm':>8}{'before':>9}{'after':>8}   hidden before   hidden after")
        for name, o in overlap.items():
            ms = o["ms"]
            print(f"{name:<6}{ms['no_comm']:>9.1f}{ms['comm']:>8.1f}{ms['before']:>9.1f}{ms['after']:>8.1f}   "
                  f"{o['hidden_before']:>13.0%}   {o['hidden_after']:>12.0%}")
    print(NOTES.rstrip())
    if a.out:
        baseline = {k: base[k] for k in ("params", "grads", "optim", "step_ms")}
        write_json(a.out, meta, {"baseline": baseline, "parameters": table, "layouts": layouts, "bubble": bubble,
                                 "overlap": overlap})


if __name__ == "__main__":
    main()
