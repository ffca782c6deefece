"""Every causal-LM family of the zoo against transformers on one device (the GPU check of the
families: on CUDA, SDPA and bf16 autocast take other kernels than the CPU tests).

For each causal case of tests/model_cases.py (tiny configs with every distinguishing feature on)
it prints the max abs difference of the logits in fp32 and under bf16 autocast, of the loss and of
the gradients (fp32), and a forward+backward time of both.

    python benchmarks/bench_families.py --device cuda --out benchmarks/results/bench_families_....json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from bench_common import run_meta, time_steps, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from model_cases import CASES, hf_checkpoint_grads, hf_named_grads, make_hf_model, make_inputs  # noqa: E402


def _to(inputs: dict, device: str) -> dict:
    return {k: v.to(device) for k, v in inputs.items()}


def _timed(step, device: str, iters: int = 5) -> float:
    """ms per call after one warm-up call."""
    step()
    return time_steps(step, iters, device)


def family(name: str, device: str) -> dict:
    case = CASES[name]
    hf = make_hf_model(case)
    if getattr(hf.config, "attn_logit_softcapping", None):  # transformers' SDPA path drops the cap (5.17)
        hf.config._attn_implementation = "eager"
    hf = hf.to(device)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        zoo = case.zoo_class.from_pretrained(tmp).to(device).eval()
        inputs, mask = make_inputs(case)
        inputs, mask = _to(inputs, device), mask.to(device)
        ours, theirs = zoo(**inputs), hf(**inputs)
        result = {"logits_fp32": (ours.logits[mask] - theirs.logits[mask]).abs().max().item(),
                  "loss_fp32": abs(ours.loss.item() - theirs.loss.item())}
        ours.loss.backward()
        theirs.loss.backward()
        grads, hf_grads = hf_named_grads(zoo), hf_checkpoint_grads(hf.cpu(), Path(tmp) / "grads")
        result["grads_fp32"] = max((grads[n].cpu() - hf_grads[n]).abs().max().item() for n in grads)
        hf.to(device)
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
            ours, theirs = zoo(**inputs), hf(**inputs)
        result["logits_bf16"] = (ours.logits[mask].float() - theirs.logits[mask].float()).abs().max().item()
        result["loss_bf16"] = abs(ours.loss.item() - theirs.loss.item())
        result["ms_zoo"] = _timed(lambda: zoo(**inputs).loss.backward(), device)
        result["ms_transformers"] = _timed(lambda: hf(**inputs).loss.backward(), device)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--families", default=",".join(n for n, c in CASES.items() if c.generates))
    parser.add_argument("--out", help="also write the figures to this JSON file")
    args = parser.parse_args()
    results = {}
    for name in args.families.split(","):
        try:
            results[name] = family(name, args.device)
        except Exception as error:  # a family transformers of this machine lacks: say so, go on
            results[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
        print(name, {k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in results[name].items()}, flush=True)
    if args.out:
        write_json(args.out, run_meta(args.device, families=args.families.split(",")), results)


if __name__ == "__main__":
    main()
