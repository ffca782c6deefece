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
bf16 figure (H100/H200 SXM: 989 TFLOP/s); none on CPU.

    python benchmarks/bench_train.py                                   # CPU: a small Llama, quickly
    python benchmarks/bench_train.py --preset 1b --vocab 32000         # GPU: hidden 2048, 16 layers, GQA
    python benchmarks/bench_train.py --preset 1b --vocab 128256 --out benchmarks/results/bench_train_....json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import logging
import os
import statistics
import tempfile
import time

import torch
import transformers
from bench_common import run_meta, sync, write_json
from omegaconf import OmegaConf
from torch.utils.data import Dataset

from libai_zoo.config import LazyCall, LazyConfig, get_config
from libai_zoo.engine import DefaultTrainer, HookBase
from libai_zoo.models import LlamaConfig, LlamaForCausalLM
from libai_zoo.utils import peak_flops

PRESETS = {  # hidden, layers, heads, kv heads, ffn, sequence, micro batch
    "cpu": dict(hidden=256, layers=4, heads=8, kv_heads=4, ffn=688, seq=256, batch=4),
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=5632, seq=2048, batch=4),
}


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
    """Wall time of each step, synchronised with the device."""

    def __init__(self, device: str):
        self.device, self.times, self._start = device, [], 0.0

    def before_step(self) -> None:
        sync(self.device)
        self._start = time.perf_counter()

    def after_step(self) -> None:
        sync(self.device)
        self.times.append(time.perf_counter() - self._start)


def llama_kwargs(a) -> dict:
    return dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=a.seq,
                bos_token_id=0, eos_token_id=0)


def run_trainer(a, compiled: bool, output_dir: str) -> list[float]:
    """Step times of `DefaultTrainer` on the Llama (the first `--warmup` steps included)."""
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
         "optim.lr=1e-4", *(["+optim.fused=true"] if a.device == "cuda" else [])])
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = DefaultTrainer(cfg)
    logging.getLogger("libai_zoo").setLevel(logging.WARNING)
    clock = StepClock(a.device)
    trainer.register_hooks([clock])
    trainer.resume_or_load(resume=False)
    trainer.train()
    return clock.times


def run_transformers(a, compiled: bool) -> list[float]:
    """Step times of the same model as transformers' Llama with SDPA, trained by a plain AdamW loop."""
    device = torch.device(a.device)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_kwargs(a), attn_implementation="sdpa"))
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=device.type == "cuda")
    step_model = torch.compile(model) if compiled else model
    data = RandomTokens(a.batch * (a.steps + 1), a.seq, a.vocab)
    times = []
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
        loss.item()
        sync(a.device)
        times.append(time.perf_counter() - start)
    return times


def figures(times: list[float], a, flops_per_token: float, peak: float | None) -> dict:
    step = statistics.median(times[a.warmup:])
    tokens_per_s = a.batch * a.seq / step
    memory = torch.cuda.max_memory_allocated() / 2**30 if a.device.startswith("cuda") else None
    return dict(step_s=step, tokens_per_s=tokens_per_s,
                mfu=tokens_per_s * flops_per_token / peak if peak else None, peak_gib=memory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=list(PRESETS), default=None, help="cpu (default off CUDA) or 1b")
    for key in ("hidden", "layers", "heads", "kv_heads", "ffn", "seq", "batch"):
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, help=f"override the preset's {key}")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 20 on CUDA, 6 on CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 5 on CUDA, 2 on CPU)")
    parser.add_argument("--runs", default="trainer,transformers,trainer_compiled,transformers_compiled")
    parser.add_argument("--out", help="also write the figures to this JSON file")
    a = parser.parse_args()
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
    print(f"Llama {params / 1e9:.3f}B parameters: hidden {a.hidden}, {a.layers} layers, {a.heads}/{a.kv_heads} "
          f"heads, ffn {a.ffn}, vocab {a.vocab}, seq {a.seq}, batch {a.batch}; {flops_per_token / 1e9:.2f} GFLOP "
          f"per token; {a.device}{' ' + torch.cuda.get_device_name() if a.device == 'cuda' else ''}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.runs.split(","):
            if a.device.startswith("cuda"):
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            compiled = name.endswith("_compiled")
            times = (run_trainer(a, compiled, f"{tmp}/{name}") if name.startswith("trainer")
                     else run_transformers(a, compiled))
            results[name] = figures(times, a, flops_per_token, peak)
            gc.collect()
            r = results[name]
            print(f"{name:<24} {r['tokens_per_s']:>10.0f} tokens/s  step {r['step_s'] * 1e3:8.1f} ms  "
                  + (f"MFU {r['mfu']:.1%}  " if r["mfu"] is not None else "")
                  + (f"peak {r['peak_gib']:.1f} GiB" if r["peak_gib"] is not None else ""))
    for ours, theirs in (("trainer", "transformers"), ("trainer_compiled", "transformers_compiled"),
                         ("trainer_compiled", "transformers")):
        if ours in results and theirs in results:
            print(f"{ours} / {theirs}: {results[ours]['tokens_per_s'] / results[theirs]['tokens_per_s']:.2f}x")
    if a.out:
        meta = run_meta(a.device, dtype="bf16 autocast" if a.device == "cuda" else "fp32", parameters=params,
                        flops_per_token=flops_per_token, **{k: getattr(a, k) for k in (
                            "hidden", "layers", "heads", "kv_heads", "ffn", "seq", "batch", "vocab", "steps",
                            "warmup")})
        write_json(a.out, meta, results)


if __name__ == "__main__":
    main()
