"""Float8 against high precision over the recipes' first 200 steps: the GPT-2 pretraining and the
Llama fine-tune (on a stand-in Llama directory), each trained twice from the same seed, once with
``train.fp8`` (torchao, tensorwise unless --recipe), as the recipes run: tools/train.py with
overrides. The reference is bf16 autocast with --amp (on a GPU), else the recipe's float32: a CPU
without bf16 matrix units runs bf16 autocast about 20 times slower than float32. Prints the final
losses (the mean of the last 20 steps' logged losses, each run's own noise averaged) and the
float8 / reference ratio (the issue's bar: within 2%), and plots each pair side by side (tools/plot.py).

    python benchmarks/bench_float8_loss.py --out benchmarks/results/float8_loss_DATE_cpu2
    python benchmarks/bench_float8_loss.py --amp --out benchmarks/results/float8_loss_DATE_h200
    python benchmarks/bench_float8_loss.py --steps 20 --out /tmp/fp8_check    # a quick look

On CPU torch's float8 GEMM runs (slowly): the figures are numerics, not speed (gpu_suite.sh train_fp8).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from bench_common import run_meta

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {
    "gpt2_pretrain": ["projects/gpt2_pretrain/config.py"],
    "llama_finetune": ["projects/llama_finetune/config.py", "model.path={tiny_llama}"],
}
LAST = 20  # logged steps averaged into the final loss


def train(out: Path, recipe: list[str], steps: int, fp8: str | None, amp: bool) -> list[dict]:
    """Run a recipe for `steps` steps (under bf16 autocast with `amp`; with float8 `fp8`); its
    metrics.json lines."""
    command = [sys.executable, "tools/train.py", *recipe, f"train.output_dir={out}", f"train.max_iter={steps}",
               "train.log_period=1", "train.checkpoint.period=0", "train.eval.period=0", f"train.amp.enabled={amp}",
               "train.amp.dtype=bf16", "hooks=[]", "--no-resume"]
    if fp8:
        command += ["train.fp8.enabled=true", f"train.fp8.recipe={fp8}"]
    subprocess.run(command, cwd=ROOT, check=True)
    return [json.loads(line) for line in (out / "metrics.json").read_text().splitlines()]


def final_loss(records: list[dict]) -> float:
    losses = [r["loss"] for r in records if "loss" in r]
    return sum(losses[-LAST:]) / len(losses[-LAST:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder of the runs, the plots and float8_loss.json")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--recipe", default="tensorwise", help="torchao's float8 recipe (train.fp8.recipe)")
    parser.add_argument("--amp", action="store_true", help="both runs under bf16 autocast (the reference: bf16)")
    parser.add_argument("--only", choices=sorted(RECIPES), nargs="*", default=sorted(RECIPES))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tiny_llama = args.out / "tiny_llama"
    if "llama_finetune" in args.only and not tiny_llama.exists():
        subprocess.run([sys.executable, "tools/make_tiny_hf_model.py", "llama", str(tiny_llama)], cwd=ROOT, check=True)
    results = {}
    for name in args.only:
        recipe = [item.format(tiny_llama=tiny_llama) for item in RECIPES[name]]
        high = "bf16" if args.amp else "fp32"
        reference = final_loss(train(args.out / f"{name}_{high}", recipe, args.steps, None, args.amp))
        fp8 = final_loss(train(args.out / f"{name}_fp8", recipe, args.steps, args.recipe, args.amp))
        results[name] = {high: reference, "fp8": fp8, "ratio": fp8 / reference}
        print(f"{name}: final loss (mean of the last {LAST} steps of {args.steps}) {high} {reference:.4f}, "
              f"float8 ({args.recipe}) {fp8:.4f}: {fp8 / reference:.4f}x ({100 * (fp8 / reference - 1):+.2f}%)")
        subprocess.run([sys.executable, "tools/plot.py", str(args.out / f"{name}_{high}"),
                        str(args.out / f"{name}_fp8"), "--out", str(args.out / f"{name}.png")], cwd=ROOT, check=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    (args.out / "float8_loss.json").write_text(json.dumps(
        {"meta": run_meta(device, steps=args.steps, recipe=args.recipe, amp=args.amp), "results": results},
        indent=1) + "\n")


if __name__ == "__main__":
    main()
