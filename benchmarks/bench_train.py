"""The whole trainer's throughput against a plain transformers loop, on one device.

Runs `DefaultTrainer` itself (its data loader, train step, hooks; not a hand loop) on a Llama, and
in the same process the same model as `transformers.LlamaForCausalLM` (SDPA attention) trained by
a plain loop with `torch.optim.AdamW` (fused on CUDA), each with and without `torch.compile`
(the trainer compiles each layer; the loop compiles the model). Both train on the same random
tokens with fp32 master weights under bf16 autocast (fp32 on CPU), global batch = micro batch
(no accumulation), the same AdamW settings (fused on CUDA in both). Per run it prints tokens/s
(median of the timed steps, each synchronised), MFU and peak memory.

MFU = tokens/s × FLOPs per token / peak FLOP/s, with the FLOPs of the model contract (PaLM's
convention, attention counted, recomputation not): 6 × (parameters every token multiplies: all
but the embedding table) + 12 × layers × hidden × sequence length. The peak is the device's dense
bf16 figure (H100/H200 SXM: 989 TFLOP/s); none on CPU. Float8 runs are measured against the same
bf16 peak (their FLOPs are the same; a float8 peak would halve their MFU).

Float8 runs (`train.fp8`, torchao): `trainer_fp8_RECIPE` and `trainer_fp8_RECIPE_compiled`, RECIPE
one of tensorwise, rowwise, rowwise_with_gw_hp: the trainer with `train.fp8.enabled=true` and that
recipe, on the same data from the same seed as `trainer` / `trainer_compiled` (each run's loss after
every step is recorded). Against its high-precision run (bf16 autocast; fp32 on CPU) it prints the
tokens/s ratio (target: ≥ 1.25× compiled) and the relative difference of the last step's loss
(target: within 2%). On random tokens the loss stays near ln(vocab): the loss check is one of
numerics (no divergence, no NaN), not of convergence (benchmarks/bench_float8_loss.py trains the
recipes). Where torchao cannot be imported the float8 runs are skipped with the reason, and the
others still run; a run that raises is reported and the others still run (exit code 1).

    python benchmarks/bench_train.py                                   # CPU: a small Llama, quickly
    python benchmarks/bench_train.py --preset 1b --vocab 32000         # GPU: hidden 2048, 16 layers, GQA
    python benchmarks/bench_train.py --preset 1b --vocab 128256 --out benchmarks/results/bench_train_....json
    python benchmarks/bench_train.py --preset 1b --runs trainer_compiled,trainer_fp8_tensorwise_compiled
    python benchmarks/bench_train.py --preset cpu --steps 2 --warmup 1 --runs trainer,trainer_fp8_tensorwise
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import logging
import os
import statistics
import sys
import tempfile
import time
import traceback

import torch
import transformers
from omegaconf import OmegaConf
from torch.utils.data import Dataset

from bench_common import run_meta, sync, write_json
from libai_zoo.config import LazyCall, LazyConfig, get_config
from libai_zoo.engine import DefaultTrainer, HookBase
from libai_zoo.models import LlamaConfig, LlamaForCausalLM
from libai_zoo.utils import peak_flops

PRESETS = {  # hidden, layers, heads, kv heads, ffn, sequence, micro batch
    "cpu": dict(hidden=256, layers=4, heads=8, kv_heads=4, ffn=688, seq=256, batch=4),
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=5632, seq=2048, batch=4),
}
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's float8 recipes (train.fp8.recipe)
SPEEDUP_TARGET = 1.25  # float8 compiled against bf16 compiled, tokens/s
LOSS_TARGET = 0.02  # float8's last loss against bf16's, relative


class RandomTokens(Dataset):
    """`num_samples` sequences of uniform random token ids, as causal-LM samples."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab_size, (num_samples, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class StepClock(HookBase):
    """Wall time of each step, synchronised with the device, and the step's loss."""

    def __init__(self, device: str):
        self.device, self.times, self.losses, self._start = device, [], [], 0.0

    def before_step(self) -> None:
        sync(self.device)
        self._start = time.perf_counter()

    def after_step(self) -> None:
        sync(self.device)
        self.times.append(time.perf_counter() - self._start)
        self.losses.append(self.trainer.storage.latest()["loss"][0])


def parse_run(name: str) -> tuple[str, bool, str | None]:
    """A run's name as (trainer or transformers, compiled, float8 recipe or None); ValueError if unknown."""
    base, compiled = (name[:-len("_compiled")], True) if name.endswith("_compiled") else (name, False)
    if base in ("trainer", "transformers"):
        return base, compiled, None
    if base.startswith("trainer_fp8_") and base[len("trainer_fp8_"):] in RECIPES:
        return "trainer", compiled, base[len("trainer_fp8_"):]
    raise ValueError(f"unknown run {name!r}: trainer, transformers, trainer_fp8_RECIPE (RECIPE: "
                     f"{', '.join(RECIPES)}), each optionally with _compiled")


def float8_missing() -> str | None:
    """Why the float8 runs cannot run here (torchao not importable, or no recipe config), or None."""
    try:
        from libai_zoo.parallel.float8 import float8_config
        for recipe in RECIPES[:2]:
            float8_config(recipe)
    except Exception as error:  # whatever stops the import is the answer
        try:
            from importlib.metadata import version
            installed = f"torchao {version('torchao')} is installed"
        except Exception:
            installed = "torchao is not installed"
        return (f"{type(error).__name__}: {error} (torch {torch.__version__}; {installed}; the float8 runs need "
                f"torchao 0.18, whose oldest torch is 2.11: pip install --no-deps torchao==0.18.0, or carry its "
                f"wheel in .whl/ for benchmarks/gpu_suite.sh)")
    return None


def llama_kwargs(a) -> dict:
    return dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=a.seq,
                bos_token_id=0, eos_token_id=0)


def run_trainer(a, compiled: bool, output_dir: str, fp8: str | None = None) -> tuple[list[float], list[float]]:
    """Step times and losses of `DefaultTrainer` on the Llama (the first `--warmup` steps included),
    with float8 linear layers of recipe `fp8` where given."""
    common = get_config("common/train.py")
    cfg = LazyConfig.apply_overrides(
        OmegaConf.create({
            "train": common.train, "dist": common.dist, "optim": get_config("common/optim.py").optim,
            "model": LazyCall(LlamaForCausalLM)(config=LazyCall(LlamaConfig)(**llama_kwargs(a))),
            "dataloader": {"train": LazyCall(RandomTokens)(num_samples=a.batch * (a.steps + 1), seq_len=a.seq,
                                                          vocab_size=a.vocab)}}, flags={"allow_objects": True}),
        [f"train.output_dir={output_dir}", f"train.max_iter={a.steps}", f"train.micro_batch_size={a.batch}",
         f"train.global_batch_size={a.batch}", "train.checkpoint.period=0", f"train.log_period={a.steps}",
         f"train.amp.enabled={a.device != 'cpu'}", "train.amp.dtype=bf16", f"train.compile={compiled}",
         "optim.lr=1e-4", *(["+optim.fused=true"] if a.device == "cuda" else []),
         *(["train.fp8.enabled=true", f"train.fp8.recipe={fp8}"] if fp8 else [])])
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = DefaultTrainer(cfg)
    logging.getLogger("libai_zoo").setLevel(logging.WARNING)
    clock = StepClock(a.device)
    trainer.register_hooks([clock])
    trainer.resume_or_load(resume=False)
    trainer.train()
    return clock.times, clock.losses


def run_transformers(a, compiled: bool) -> tuple[list[float], list[float]]:
    """Step times and losses of the same model as transformers' Llama with SDPA, trained by a plain AdamW loop."""
    device = torch.device(a.device)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_kwargs(a), attn_implementation="sdpa"))
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=device.type == "cuda")
    step_model = torch.compile(model) if compiled else model
    data = RandomTokens(a.batch * (a.steps + 1), a.seq, a.vocab)
    times, losses = [], []
    for step in range(a.steps):
        ids = data.ids[step * a.batch:(step + 1) * a.batch].to(device, non_blocking=True)
        sync(a.device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type != "cpu"):
            loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        sync(a.device)
        times.append(time.perf_counter() - start)
    return times, losses


def figures(times: list[float], losses: list[float], a, flops_per_token: float, peak: float | None) -> dict:
    step = statistics.median(times[a.warmup:] or times)
    tokens_per_s = a.batch * a.seq / step
    memory = torch.cuda.max_memory_allocated() / 2**30 if a.device.startswith("cuda") else None
    return dict(step_s=step, tokens_per_s=tokens_per_s,
                mfu=tokens_per_s * flops_per_token / peak if peak else None, peak_gib=memory,
                loss=losses[-1] if losses else None, losses=losses)


def comparisons(results: dict, high: str) -> list[str]:
    """The lines comparing runs: the trainer against the transformers loop, float8 against `high` precision."""
    lines = []
    for ours, theirs in (("trainer", "transformers"), ("trainer_compiled", "transformers_compiled"),
                         ("trainer_compiled", "transformers")):
        if ours in results and theirs in results:
            lines.append(f"{ours} / {theirs}: {results[ours]['tokens_per_s'] / results[theirs]['tokens_per_s']:.2f}x")
    for name, r in results.items():
        _, compiled, recipe = parse_run(name)
        reference = results.get("trainer_compiled" if compiled else "trainer")
        if recipe is None or reference is None:
            continue
        speedup = r["tokens_per_s"] / reference["tokens_per_s"]
        target = (f" (target >= {SPEEDUP_TARGET:.2f}x: {'met' if speedup >= SPEEDUP_TARGET else 'MISSED'})"
                  if compiled else "")
        lines.append(f"{name} / {'trainer_compiled' if compiled else 'trainer'} ({high}): {speedup:.2f}x "
                     f"tokens/s{target}")
        if r["loss"] is not None and reference["loss"] is not None:
            difference = r["loss"] / reference["loss"] - 1
            lines.append(f"{name} loss after {len(r['losses'])} steps {r['loss']:.4f} vs {high} "
                         f"{reference['loss']:.4f}: {difference:+.2%} (target within {LOSS_TARGET:.0%}: "
                         f"{'met' if abs(difference) <= LOSS_TARGET else 'MISSED'})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=list(PRESETS), default=None, help="cpu (default off CUDA) or 1b")
    for key in ("hidden", "layers", "heads", "kv_heads", "ffn", "seq", "batch"):
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, help=f"override the preset's {key}")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 20 on CUDA, 6 on CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 5 on CUDA, 2 on CPU)")
    parser.add_argument("--runs", default="trainer,transformers,trainer_compiled,transformers_compiled",
                        help="comma-separated: trainer, transformers, trainer_fp8_RECIPE (RECIPE: "
                             f"{', '.join(RECIPES)}), each optionally with _compiled")
    parser.add_argument("--out", help="also write the figures to this JSON file (after each run)")
    a = parser.parse_args()
    runs = a.runs.split(",")
    for name in runs:
        try:
            parse_run(name)
        except ValueError as error:
            parser.error(str(error))
    a.device = "cuda" if torch.cuda.is_available() else "cpu"
    preset = PRESETS[a.preset or ("1b" if a.device == "cuda" else "cpu")]
    for key, value in preset.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    a.steps = a.steps or (20 if a.device == "cuda" else 6)
    a.warmup = a.warmup if a.warmup is not None else (5 if a.device == "cuda" else 2)
    if a.device == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    with torch.device("meta"):
        probe = LlamaForCausalLM(LlamaConfig(**llama_kwargs(a)))
    flops_per_token = probe.flops_per_token(a.seq)
    params = sum(p.numel() for p in probe.parameters())
    peak = peak_flops(torch.device(a.device), torch.bfloat16)
    high = "bf16" if a.device == "cuda" else "fp32"  # the trainer's precision without float8
    print(f"Llama {params / 1e9:.3f}B parameters: hidden {a.hidden}, {a.layers} layers, {a.heads}/{a.kv_heads} "
          f"heads, ffn {a.ffn}, vocab {a.vocab}, seq {a.seq}, batch {a.batch}; {flops_per_token / 1e9:.2f} GFLOP "
          f"per token; {a.device}{' ' + torch.cuda.get_device_name() if a.device == 'cuda' else ''}; "
          f"{a.steps} steps, {a.warmup} untimed", flush=True)
    print("MFU against the dense bf16 peak " + (f"({peak / 1e12:.0f} TFLOP/s), float8 runs too" if peak
                                                else "(unknown here: no MFU)"), flush=True)
    float8_runs = [name for name in runs if parse_run(name)[2] is not None]
    missing = float8_missing() if float8_runs else None
    if missing:
        print(f"float8 runs skipped ({', '.join(float8_runs)}): {missing}", flush=True)
        runs = [name for name in runs if name not in float8_runs]
    meta = run_meta(a.device, dtype="bf16 autocast" if a.device == "cuda" else "fp32", parameters=params,
                    flops_per_token=flops_per_token, mfu_peak="dense bf16", float8_skipped=missing,
                    **{k: getattr(a, k) for k in ("hidden", "layers", "heads", "kv_heads", "ffn", "seq", "batch",
                                                  "vocab", "steps", "warmup")})
    results, failed = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in runs:
            torch._dynamo.reset()  # each run compiles afresh (no recompile limit across runs, no old modules held)
            if a.device.startswith("cuda"):
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            kind, compiled, recipe = parse_run(name)
            try:
                times, losses = (run_trainer(a, compiled, f"{tmp}/{name}", recipe) if kind == "trainer"
                                 else run_transformers(a, compiled))
            except Exception as error:  # the other runs still measure
                failed[name] = f"{type(error).__name__}: {error}"
                print(f"{name:<36} FAILED: {failed[name]}", flush=True)
                traceback.print_exc()
                continue
            finally:
                gc.collect()
            results[name] = r = figures(times, losses, a, flops_per_token, peak)
            print(f"{name:<36} {r['tokens_per_s']:>10.0f} tokens/s  step {r['step_s'] * 1e3:8.1f} ms  "
                  + (f"MFU {r['mfu']:.1%}  " if r["mfu"] is not None else "")
                  + (f"peak {r['peak_gib']:.1f} GiB  " if r["peak_gib"] is not None else "")
                  + f"loss {r['loss']:.4f}", flush=True)
            if a.out:
                write_json(a.out, {**meta, "failed": failed}, results)
    for line in comparisons(results, high):
        print(line)
    if a.out:
        write_json(a.out, {**meta, "failed": failed}, results)
    if failed:
        print(f"failed runs: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
