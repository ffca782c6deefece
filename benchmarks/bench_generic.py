"""transformers' own Llama trained through the open door against the zoo's native Llama, same shapes.

"generic": ``transformers.LlamaForCausalLM(transformers.LlamaConfig(...))``, which the engine makes
trainable itself (`parallelize` calls `libai_zoo.models.trainable`: its tp plan's linears become
the zoo's parallel Linear, its forward is transformers', the loss the contract's). "native":
``libai_zoo.models.LlamaForCausalLM(libai_zoo.models.LlamaConfig(...))`` with the same values
(fused QKV, norms and act(gate)·up recomputed in backward, rotary keeping cos/sin only). Both
must have the same parameter count (checked, printed). Each is built on the meta device, split
and wrapped by `parallelize`, allocated and drawn by `materialize`, and trained by `TrainStep`
with AdamW, as the trainer does, at each layout:

- ``one``: one process (the base);
- ``tp2``: two processes, tensor parallel (no sequence parallelism);
- ``dp2z3``: two processes, data parallel with ZeRO-3 (FSDP2; each rank its own micro-batch).

Both models live in the same forked process (gloo on CPU, nccl on CUDA: one GPU a rank) and take
turns step by step, so drift in load hits both. Figures per model and layout:

- step ms: median over ``--rounds`` rounds of one optimizer step (one micro-batch forward +
  backward + AdamW), after ``--warmup`` untimed steps each; all ranks meet in a barrier before
  each step and a step's time is its slowest rank's;
- state (bytes of this rank's shards, counted from the tensors, `libai_zoo.utils.memory`):
  parameters, gradients (read inside a step just before the optimizer zeroes them: after
  backward, the dp reduction) and AdamW state;
- saved: bytes of the distinct storages autograd saves for backward during the model's forward in
  one step, parameters left out, counted by the rule of the planner's
  `libai_zoo.plan.activations.saved_bytes` (what backward saves while it recomputes is transient
  and left out);
- peak: on CPU, parameters + optimizer state held before a step plus the peak of the bytes the
  tensors made inside that step held at once (`TensorMemoryPeak`: activations, gradients,
  gathered ZeRO-3 parameters, logits, the optimizer's temporaries; not the allocator's caching,
  not the process's RSS); on CUDA, the same state plus what ``torch.cuda.max_memory_allocated``
  rose by over the step. The largest rank's figure is shown (every rank's is in the JSON).

The table prints each figure of both models and the ratio generic / native (above 1: the generic
path is slower or holds more); for the step time also the ratio of each round's pair of steps
(median and quartiles over the rounds: the spread that load on the machine leaves).

    python benchmarks/bench_generic.py --out benchmarks/results/bench_generic_DATE_cpu2_fp32.json
    python benchmarks/bench_generic.py --device cuda --dtype bf16 --layouts one --hidden 2048 ...
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import transformers

from bench_common import run_meta, write_json
from libai_zoo import distributed, models
from libai_zoo.engine.train_step import TrainStep
from libai_zoo.optim import param_groups
from libai_zoo.parallel import DataParallel, materialize, parallelize
from libai_zoo.utils.memory import TensorMemoryPeak, gradient_bytes, optimizer_state_bytes, parameter_bytes
from support.forked import run_forked

#: layout name -> (processes, dp, tp, ZeRO stage)
LAYOUTS = {"one": (1, 1, 1, 0), "tp2": (2, 1, 2, 0), "dp2z3": (2, 2, 1, 3)}
KINDS = ("generic", "native")
MIB = 2**20


def llama_values(a) -> dict:
    return dict(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
                num_key_value_heads=a.kv_heads, intermediate_size=a.ffn, max_position_embeddings=a.seq,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def build(kind: str, a):
    """The model of `kind` (under the caller's device: the meta device here)."""
    if kind == "generic":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_values(a)))
    return models.LlamaForCausalLM(models.LlamaConfig(**llama_values(a)))


def parameter_count(kind: str, a) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in build(kind, a).parameters())


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _slowest(seconds: float, device: torch.device) -> float:
    """The largest of every rank's `seconds`."""
    if not dist.is_initialized():
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Run:
    """One model at this rank's share of a layout: built, allocated, with its optimizer and step."""

    def __init__(self, kind: str, a, ctx, zero: int, amp_dtype):
        self.kind = kind
        with torch.device("meta"):
            model = build(kind, a)
        self.data_parallel = DataParallel(ctx, zero)
        self.built = parallelize(model, ctx, self.data_parallel)
        materialize(self.built.parts[0], ctx.device, seed=0, model=self.built.model)
        self.optimizer = torch.optim.AdamW(param_groups(self.built.parts), lr=1e-4)
        self.step = TrainStep(self.built.parts, self.optimizer, ctx=ctx, amp_dtype=amp_dtype,
                              data_parallel=self.data_parallel)
        # transformers' attention implementation; the zoo's layer always calls F.scaled_dot_product_attention
        self.attention = getattr(self.built.model.config, "_attn_implementation", None) or "sdpa (zoo layer)"

    def state_bytes(self) -> int:
        return sum(map(parameter_bytes, self.built.parts)) + optimizer_state_bytes(self.optimizer)

    def gradients_and_saved(self, batch) -> tuple[int, int]:
        """(gradient bytes just before the optimizer zeroes them, bytes saved for backward by the
        forward) of one step. The saved tensors are counted as `saved_bytes` counts them (each storage
        once, at its size when the step returns, parameters left out), but only those the model's
        forward saves: what backward saves while it recomputes (the native layers' norms and
        act(gate)·up) is transient, and is left out."""
        found = {}
        zero_grad = self.optimizer.zero_grad

        def measuring_zero_grad(*args, **kwargs):
            found["grads"] = sum(map(gradient_bytes, self.built.parts))
            return zero_grad(*args, **kwargs)

        root = self.built.parts[0]
        in_forward, saved = [False], []
        hooks = [root.register_forward_pre_hook(lambda *_: in_forward.__setitem__(0, True)),
                 root.register_forward_hook(lambda *_: in_forward.__setitem__(0, False))]

        def pack(tensor):
            if in_forward[0]:
                saved.append(tensor)
            return tensor

        self.optimizer.zero_grad = measuring_zero_grad
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                self.step([batch])
        finally:
            del self.optimizer.zero_grad
            for hook in hooks:
                hook.remove()
        parameters = {distributed.local(p).untyped_storage().data_ptr() for p in root.parameters()}
        storages = {}
        for tensor in saved:
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in parameters:
                storages[storage._cdata] = storage.nbytes()
        return found["grads"], sum(storages.values())

    def peak_bytes(self, batch, device: torch.device) -> int:
        before = self.state_bytes()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            allocated = torch.cuda.memory_allocated()
            self.step([batch])
            torch.cuda.synchronize()
            return before + torch.cuda.max_memory_allocated() - allocated
        with TensorMemoryPeak() as peak:
            self.step([batch])
        return before + peak.bytes


def measure(layout: str, a) -> dict:
    """This rank's figures of both models at `layout` (run inside each forked process)."""
    _, dp, tp, zero = LAYOUTS[layout]
    logging.getLogger("libai_zoo").setLevel(logging.WARNING)
    ctx = distributed.init(dp=dp, tp=tp)
    amp_dtype = torch.bfloat16 if a.dtype == "bf16" else None
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            runs = {kind: Run(kind, a, ctx, zero, amp_dtype) for kind in KINDS}
        generator = torch.Generator().manual_seed(1000 + ctx.dp_rank)  # tp ranks read the same samples
        ids = torch.randint(0, a.vocab, (a.micro_batch, a.seq), generator=generator)
        batch = {"input_ids": ids, "labels": ids.clone()}
        losses = {kind: [] for kind in KINDS}
        for _ in range(a.warmup):
            for kind, run in runs.items():
                losses[kind].append(run.step([batch]).loss)
        times = {kind: [] for kind in KINDS}
        for _ in range(a.rounds):
            for kind, run in runs.items():
                _barrier()
                _sync(ctx.device)
                start = time.perf_counter()
                losses[kind].append(run.step([batch]).loss)
                _sync(ctx.device)
                times[kind].append(_slowest(time.perf_counter() - start, ctx.device) * 1e3)
        out = {}
        for kind, run in runs.items():
            grads, saved = run.gradients_and_saved(batch)
            out[kind] = {"step_ms": statistics.median(times[kind]), "step_ms_all": times[kind],
                         "params": sum(map(parameter_bytes, run.built.parts)), "grads": grads,
                         "optim": optimizer_state_bytes(run.optimizer), "saved": saved,
                         "peak": run.peak_bytes(batch, ctx.device), "losses": losses[kind],
                         "local_parameters": sum(distributed.local(p).numel() for p in run.built.parts[0].parameters()),
                         "attention": run.attention}
        return out
    finally:
        distributed.destroy()


FIGURES = (("step_ms", "step ms"), ("params", "params MiB"), ("grads", "grads MiB"), ("optim", "AdamW MiB"),
           ("saved", "saved MiB"), ("peak", "peak MiB"))


def summarize(ranks: list[dict]) -> dict:
    """Per model: the largest rank's figures (a step's time is already its slowest rank's), and every rank's."""
    out = {}
    for kind in KINDS:
        per_rank = [r[kind] for r in ranks]
        out[kind] = {key: max(r[key] for r in per_rank) for key, _ in FIGURES}
        out[kind]["per_rank"] = per_rank
    out["ratio"] = {key: out["generic"][key] / out["native"][key] for key, _ in FIGURES if out["native"][key]}
    # the two models take turns: round i's generic step against round i's native step
    paired = [g / n for g, n in zip(ranks[0]["generic"]["step_ms_all"], ranks[0]["native"]["step_ms_all"])]
    q1, median, q3 = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
    out["step_ratio_per_round"] = {"median": statistics.median(paired), "q1": q1, "q3": q3, "all": paired}
    return out


def print_table(results: dict) -> None:
    print("\n| layout | figure | generic | native | generic / native | per round: median [q1, q3] |")
    print("|---|---|---|---|---|---|")
    for layout, r in results.items():
        for key, label in FIGURES:
            scale = 1 if key == "step_ms" else MIB
            g, n = r["generic"][key] / scale, r["native"][key] / scale
            ratio = f"**{g / n:.3f}**" if n else "-"
            paired = r["step_ratio_per_round"]
            rounds = f"{paired['median']:.3f} [{paired['q1']:.3f}, {paired['q3']:.3f}]" if key == "step_ms" else ""
            print(f"| {layout} | {label} | {g:.1f} | {n:.1f} | {ratio} | {rounds} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=688, help="intermediate size")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4, help="samples per rank per step")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"subset of {','.join(LAYOUTS)}")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per model")
    parser.add_argument("--rounds", type=int, default=25, help="timed steps per model (median), taking turns")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (CPU)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: one GPU a rank, nccl (the parent process never initializes CUDA)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: autocast over fp32 parameters, as train.amp does")
    parser.add_argument("--out", help="also write the results as JSON here")
    a = parser.parse_args()
    names = [n.strip() for n in a.layouts.split(",") if n.strip()]
    if unknown := [n for n in names if n not in LAYOUTS]:
        parser.error(f"unknown layout(s) {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the workers' device is the CPU
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(var, None)
    warnings.filterwarnings("ignore")

    counts = {kind: parameter_count(kind, a) for kind in KINDS}
    print(f"parameters: generic {counts['generic']:,}  native {counts['native']:,}", flush=True)
    if counts["generic"] != counts["native"]:
        raise SystemExit("the two models differ in shape: their parameter counts must match")
    started, load_before = time.perf_counter(), os.getloadavg()
    results = {}
    for name in names:
        world = LAYOUTS[name][0]
        t0 = time.perf_counter()
        results[name] = summarize(run_forked(measure, world, name, a, threads=a.threads))
        r = results[name]
        print(f"{name}: {time.perf_counter() - t0:.0f} s; step ms generic {r['generic']['step_ms']:.1f} native "
              f"{r['native']['step_ms']:.1f}; attention {r['generic']['per_rank'][0]['attention']} / "
              f"{r['native']['per_rank'][0]['attention']}; local parameters per rank "
              f"{[p['local_parameters'] for p in r['generic']['per_rank']]} / "
              f"{[p['local_parameters'] for p in r['native']['per_rank']]}", flush=True)
    print_table(results)
    meta = run_meta(a.device, dtype=a.dtype, hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads,
                    ffn=a.ffn, vocab=a.vocab, seq=a.seq, micro_batch=a.micro_batch, warmup=a.warmup,
                    rounds=a.rounds, worker_threads=a.threads, cpus=os.cpu_count(), parameters=counts,
                    layouts={n: dict(zip(("processes", "dp", "tp", "zero"), LAYOUTS[n])) for n in names},
                    wall_s=round(time.perf_counter() - started, 1),
                    load_average_1_5_15min={"before": load_before, "after": os.getloadavg()})
    if a.out:
        write_json(a.out, meta, results)


if __name__ == "__main__":
    main()
