"""Chat fine-tuning throughput with packed samples against padded ones, on the shipped chat data.

The data of the `projects/llama_sft` recipe (its dataset, chat template, max_length and micro-batch
size), the same Llama (fresh, the shape of `tools/make_tiny_hf_model.py llama` by default), AdamW
and number of steps for each way of making samples:

- packed: whole conversations packed per sample (block-diagonal attention, `pack=True`);
- padded: one conversation per sample, padded to max_length (`pack=False`, what the trainer feeds);
- padded to the longest: the same batches cut to their longest conversation (dynamic padding).

The modes take turns, round by round, so drift in clocks or load hits all. Throughput counts real
tokens only: input tokens that are not padding, and the assistant tokens the loss scores. Prints a
Markdown report (device, torch version, date) with the packed/padded ratios; ``--out`` writes it.

    python benchmarks/bench_packing.py --out benchmarks/results/packing_cpu.md
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch

from bench_common import run_meta
from libai_zoo.config import LazyConfig, instantiate
from libai_zoo.data import load_tokenizer
from libai_zoo.models import LlamaConfig, LlamaForCausalLM


def batches(dataset, batch_size: int, count: int, trim: bool) -> list[dict]:
    """The first `count` batches of consecutive samples; `trim` cuts padded ones to their longest sample."""
    result = []
    for start in range(0, batch_size * count, batch_size):
        batch = dataset[start:start + batch_size]
        if trim:
            longest = int(batch["attention_mask"].sum(1).max())
            batch = {key: value[:, :longest] for key, value in batch.items()}
        result.append(batch)
    return result


def counts(batch: dict, pad_id: int) -> tuple[int, int]:
    """(input tokens that are not padding, targets the loss scores) of a batch."""
    targets = batch["shift_labels"] if "shift_labels" in batch else batch["labels"][:, 1:]
    return int((batch["input_ids"] != pad_id).sum()), int((targets != -100).sum())


def cpu_name() -> str:
    """The processor's model name (Linux), else what bench_common reports."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")] if cpuinfo.is_file() else []
    return names[0] if names else run_meta("cpu")["device"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="projects/llama_sft/config.py", help="the recipe whose data is used")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="steps per mode per round")
    parser.add_argument("--out", help="also write the report (Markdown) here")
    a = parser.parse_args()

    cfg = LazyConfig.load(a.config)
    data, batch_size = cfg.dataloader.train, cfg.train.micro_batch_size
    packed = instantiate(data)
    data.pack = False
    padded = instantiate(data)
    pad_id = load_tokenizer(data.tokenizer_dir).pad_token_id
    needed = a.rounds * a.steps + 2
    modes = {"packed": batches(packed, batch_size, needed, trim=False),
             "padded": batches(padded, batch_size, needed, trim=False),
             "padded to the longest": batches(padded, batch_size, needed, trim=True)}
    config = LlamaConfig(vocab_size=8192, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                         num_hidden_layers=a.layers, num_attention_heads=a.heads,
                         num_key_value_heads=max(1, a.heads // 2), bos_token_id=0, eos_token_id=0)
    models, optimizers, streams = {}, {}, {}
    for name, mode_batches in modes.items():
        torch.manual_seed(0)
        models[name] = LlamaForCausalLM(config)
        optimizers[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-3)
        streams[name] = iter(mode_batches)

    def step(name: str) -> tuple[int, int]:
        batch = next(streams[name])
        models[name](**batch, return_logits=False).loss.backward()
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)
        return counts(batch, pad_id)

    for name in modes:  # warm-up
        for _ in range(2):
            step(name)
    totals = {name: [0.0, 0, 0] for name in modes}  # seconds, real tokens, targets
    for _, name in itertools.product(range(a.rounds), modes):
        start = time.perf_counter()
        done = [step(name) for _ in range(a.steps)]
        totals[name][0] += time.perf_counter() - start
        totals[name][1] += sum(real for real, _ in done)
        totals[name][2] += sum(targets for _, targets in done)

    meta = run_meta("cpu", max_length=data.max_length, batch=batch_size, hidden=a.hidden, layers=a.layers,
                    heads=a.heads, steps=a.rounds * a.steps)
    steps = a.rounds * a.steps
    rate = {name: (real / seconds, targets / seconds, seconds / steps * 1e3)
            for name, (seconds, real, targets) in totals.items()}
    lines = ["# Chat fine-tuning: packed vs padded samples (CPU)", "",
             "Written by `benchmarks/bench_packing.py` (its docstring says what each mode is). "
             f"{cpu_name()}, {meta['threads']} threads, torch {meta['torch']}, transformers "
             f"{meta['transformers']}, {meta['date']}.", "",
             f"Llama hidden {a.hidden}, {a.layers} layers, {a.heads} heads, vocabulary 8192, fp32, AdamW; "
             f"{steps} timed steps per mode of {batch_size} samples of {data.max_length} tokens from "
             f"`{data.path}` as `{a.config}` makes them ({len(packed)} packed samples, {len(padded)} "
             f"conversations), {a.rounds} alternating rounds.", "",
             "| samples | step ms | real tokens/s | assistant (target) tokens/s | packed speed-up |",
             "|---|---|---|---|---|"]
    for name, (real, targets, ms) in rate.items():
        lines.append(f"| {name} | {ms:.0f} | {real:,.0f} | {targets:,.0f} | "
                     f"**{rate['packed'][1] / targets:.2f}×** |")
    report = "\n".join(lines) + "\n"
    print(report)
    if a.out:
        with open(a.out, "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
