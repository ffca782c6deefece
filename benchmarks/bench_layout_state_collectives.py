"""What 3-D parallelism and ZeRO divide and what they communicate: training state and collectives per rank.

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
   all-reduces on the tp group against Megatron-LM's 4 per layer per micro-batch plus the extras.

The 1F1B bubble is bench_pipeline_bubble.py's, the gradient all-reduce hidden under backward
bench_gradient_overlap.py's.

    python benchmarks/bench_layout_state_collectives.py                    # every layout
    python benchmarks/bench_layout_state_collectives.py --layouts dp4,tp4  # a subset
    python benchmarks/bench_layout_state_collectives.py --out layouts.json   # also as JSON
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from bench_common import (
    GLOBAL_BATCH,
    ROOT,
    barrier,
    build_trainer,
    forked_gloo_setup,
    overrides_for,
    run_all,
    run_meta,
    train_batches,
    write_gpt2_configs,
    write_json,
)
from libai_zoo import distributed
from libai_zoo.config import LazyConfig, instantiate
from libai_zoo.parallel.pipeline import split_layers
from libai_zoo.utils.memory import gradient_bytes, optimizer_state_bytes, parameter_bytes
from support.forked import run_forked

WORLD = 4
COMMON_FILE = str(Path(__file__).resolve().with_name("bench_common.py"))

# name -> (dp, tp, pp, zero stage); every layout trains the global batch of 8 on 4 processes.
LAYOUTS = {
    "dp4": (4, 1, 1, 0), "dp4_zero1": (4, 1, 1, 1), "dp4_zero2": (4, 1, 1, 2), "dp4_zero3": (4, 1, 1, 3),
    "tp4": (1, 4, 1, 0), "dp2_tp2": (2, 2, 1, 0), "dp2_tp2_zero3": (2, 2, 1, 3), "pp4_1f1b": (1, 1, 4, 0),
    "tp2_pp2": (1, 2, 2, 0),
}
PP_MICRO_BATCHES = 4  # micro-batches of the pipelined layouts in sections 1-2 (1F1B needs >= pp)


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
        if (path.startswith(str(ROOT)) and "site-packages" not in path
                and os.path.abspath(path) not in (this_file, COMMON_FILE)):
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
    next_batches = train_batches(trainer)
    trainer.train_step(next_batches())
    barrier()
    counter = DispatchCounter()
    RECORDER.records, RECORDER.active, state["capture"] = [], True, True
    with counter:
        trainer.train_step(next_batches())
    RECORDER.active = False
    times = []
    for _ in range(timed_steps):
        batches = next_batches()
        barrier()
        start = time.perf_counter()
        trainer.train_step(batches)
        times.append((time.perf_counter() - start) * 1e3)
    result = dict(coords=(ctx.pp_rank, ctx.dp_rank, ctx.tp_rank), params=state["params"], grads=state["grads"],
                  optim=state["optim"], collectives=RECORDER.records, dispatch_c10d=dict(counter.c10d),
                  functional=dict(counter.functional), step_ms=statistics.median(times),
                  accumulation=trainer.accumulation, micro_batch=trainer.cfg.train.micro_batch_size)
    distributed.destroy()
    return result


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



def print_report(a, baseline: dict, layouts: dict, tp_rows: list) -> None:
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
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"subset of {','.join(LAYOUTS)} ('' for none)")
    parser.add_argument("--timed-steps", type=int, default=3, help="timed steps per layout (median step ms)")
    parser.add_argument("--documents", type=int, default=200, help="documents of the corpus to tokenize")
    parser.add_argument("--out", help="also write the results as JSON here")
    a = parser.parse_args()
    names = [n.strip() for n in a.layouts.split(",") if n.strip()]
    if unknown := [n for n in names if n not in LAYOUTS]:
        parser.error(f"unknown layout(s) {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    forked_gloo_setup()
    global RECORDER
    RECORDER = CollectiveRecorder()
    started = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        files = write_gpt2_configs(root, a.documents, a.heads, {"main": (a.hidden, a.layers, a.seq)})
        # The one-process baseline, in this process (it also fills the token cache the workers read).
        base = measure_layout(str(files["main"]), str(root / "one_process"), ["train.micro_batch_size=8"],
                              a.timed_steps)
        table = parameter_table(instantiate(LazyConfig.load(str(files["main"])).model))

        jobs = {n: (str(files["main"]), str(root / n),
                    overrides_for(*LAYOUTS[n], PP_MICRO_BATCHES if LAYOUTS[n][2] > 1 else 1)) for n in names}
        raw = {}
        if jobs:
            ranks = run_forked(run_all, WORLD, measure_layout, jobs, a.timed_steps)
            raw = {n: [r[n] for r in ranks] for n in names}

    layouts = analyse(a, table, base, raw)
    tp_rows = []
    for n, e in layouts.items():
        if e["layout"]["tp"] > 1:
            last = next(r for r in e["per_rank"] if r["coords"]["pp"] == e["layout"]["pp"] - 1)
            tp_rows += [(f"{n} r{i}", e["per_rank"][i]["tp_all_reduce"]) for i in dict.fromkeys((0, last["rank"]))]
    meta = run_meta("cpu", dtype="fp32", processes=WORLD, backend="gloo", global_batch=GLOBAL_BATCH,
                    hidden=a.hidden, layers=a.layers, heads=a.heads, seq=a.seq, vocab=8192,
                    cpus=os.cpu_count(), worker_threads=1, wall_s=round(time.perf_counter() - started, 1))
    print(json.dumps(meta))
    print_report(a, base, layouts, tp_rows)
    print(NOTES.rstrip())
    if a.out:
        baseline = {k: base[k] for k in ("params", "grads", "optim", "step_ms")}
        write_json(a.out, meta, {"baseline": baseline, "parameters": table, "layouts": layouts})


if __name__ == "__main__":
    main()
