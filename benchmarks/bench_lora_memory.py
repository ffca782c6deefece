"""Per-rank training state of LoRA against full fine-tuning, for Llama 2 7B and Llama 3 8B shapes.

Each figure is a dry run (`libai_zoo.plan.dry_run_rank`): the rank is built through the trainer's
own steps (LoRA adapters, tp split, pipeline stage, FSDP2) under a fake process group of the
layout's world size, its optimizer stepped on meta gradients, and its tensors counted; nothing is
allocated, so it runs on a laptop. tests/test_planner_memory.py holds the dry run equal to the
planner to the byte and tests/test_lora_parallel.py to real gloo runs.

    python benchmarks/bench_lora_memory.py [--rank 16] [--out results.json]
"""

from __future__ import annotations

import argparse

from omegaconf import OmegaConf

from bench_common import run_meta, write_json
from libai_zoo.config import LazyCall, get_config
from libai_zoo.models import LlamaConfig, LlamaForCausalLM
from libai_zoo.plan import Layout
from libai_zoo.plan.dry_run import dry_run_rank

MODELS = {
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      vocab_size=32000),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256),
}
LAYOUTS = {  # (dp, tp, pp, ZeRO stage) on 8 GPUs
    "dp8 ZeRO-0": Layout(8, 1, 1, 0),
    "dp8 ZeRO-1": Layout(8, 1, 1, 1),
    "dp8 ZeRO-3": Layout(8, 1, 1, 3),
    "dp2 tp4 ZeRO-1": Layout(2, 4, 1, 1),
    "dp2 tp2 pp2 ZeRO-1": Layout(2, 2, 2, 1, schedule="1f1b"),
}
GiB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 × rank)")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    optim = get_config("common/optim.py").optim
    results = {}
    print("| model | layout | run | parameters GiB | gradients GiB | optimizer GiB | total GiB |")
    print("|---|---|---|---|---|---|---|")
    for model_name, shape in MODELS.items():
        model = LazyCall(LlamaForCausalLM)(config=LazyCall(LlamaConfig)(**shape))
        for layout_name, layout in LAYOUTS.items():
            for run, lora in (("full", None), (f"LoRA r{args.rank}", {"rank": args.rank, "alpha": 2 * args.rank})):
                cfg = OmegaConf.create({"model": model, "optim": optim,
                                        "train": {"global_batch_size": layout.dp * layout.pp, "lora": lora}})
                rank = dry_run_rank(cfg, layout, 0)  # dp rank 0 of the first stage: FSDP gives it the most rows
                total = rank.params + rank.grads + rank.optimizer
                results[f"{model_name} {layout_name} {run}"] = {"params": rank.params, "grads": rank.grads,
                                                                "optimizer": rank.optimizer}
                print(f"| {model_name} | {layout_name} | {run} | {rank.params / GiB:.2f} | {rank.grads / GiB:.3f} | "
                      f"{rank.optimizer / GiB:.3f} | {total / GiB:.2f} |")
    if args.out:
        write_json(args.out, run_meta("cpu", dtype="fp32", lora_rank=args.rank, optimizer="AdamW fp32"), results)


if __name__ == "__main__":
    main()
