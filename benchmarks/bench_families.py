"""Every causal-LM family of the zoo against transformers on one device (the GPU check of the
families: on CUDA, SDPA, flex attention and bf16 autocast take other kernels than the CPU tests).

For each causal case of tests/model_cases.py (tiny configs with every distinguishing feature on)
it prints the max abs difference of the logits in fp32 and under bf16 autocast, of the loss and of
the gradients (fp32), and a forward+backward time of both; then flex attention's soft-capped
kernel (Gemma 2) against the explicit form at a real size, forward and backward.

    python benchmarks/bench_families.py --device cuda --out benchmarks/results/bench_families_....json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_common import run_meta, sync, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from model_cases import CASES, hf_checkpoint_grads, hf_named_grads, make_hf_model, make_inputs  # noqa: E402

from libai_zoo.layers.attention import flex_softcapped_attention  # noqa: E402


def _to(inputs: dict, device: str) -> dict:
    return {k: v.to(device) for k, v in inputs.items()}


def _timed(fn, device: str, iters: int = 5) -> float:
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - start) / iters * 1e3


def family(name: str, device: str) -> dict:
    case = CASES[name]
    hf = make_hf_model(case).to(device)
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


def flex(device: str, seq: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    """Gemma 2's soft-capped attention: flex (compiled, fused) against the explicit form, bf16."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(2, heads, seq, head_dim, device=device, dtype=torch.bfloat16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, seq, head_dim, device=device, dtype=torch.bfloat16, generator=g,
                        requires_grad=True) for _ in range(2))
    args = (q, k, v, None, 50.0, head_dim ** -0.5)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    ours = flex_softcapped_attention(*args, causal=True)
    # the explicit form in float32 is the reference (what the CPU tests compare transformers against)
    qf, kf, vf = (t.detach().float() for t in (q, k, v))
    kf, vf = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (kf, vf))
    scores = 50.0 * torch.tanh(qf @ kf.transpose(-2, -1) * head_dim ** -0.5 / 50.0)
    scores = scores.masked_fill(~causal, float("-inf"))
    expected = torch.softmax(scores, -1) @ vf
    result = {"max_abs_diff_vs_fp32": (ours.float() - expected).abs().max().item()}

    def flex_step():
        flex_softcapped_attention(*args, causal=True).sum().backward()

    def explicit_step():
        _explicit(q, k, v, causal, head_dim).sum().backward()

    result["ms_flex"] = _timed(flex_step, device)
    result["ms_explicit"] = _timed(explicit_step, device)
    return result


def _explicit(q, k, v, mask, head_dim):
    """The explicit soft-capped attention (what runs where flex does not)."""
    heads = q.shape[1]
    k, v = (t.repeat_interleave(heads // k.shape[1], dim=1) for t in (k, v))
    scores = 50.0 * torch.tanh(q @ k.transpose(-2, -1) * head_dim ** -0.5 / 50.0)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1, dtype=torch.float32).to(q.dtype)
    return probs @ v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--families", default=",".join(n for n, c in CASES.items() if c.generates))
    parser.add_argument("--flex-seq", type=int, default=2048)
    parser.add_argument("--out", help="also write the figures to this JSON file")
    args = parser.parse_args()
    results = {}
    for name in args.families.split(","):
        try:
            results[name] = family(name, args.device)
        except Exception as error:  # a family transformers of this machine lacks: say so, go on
            results[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
        print(name, {k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in results[name].items()}, flush=True)
    if args.device == "cuda":
        try:
            results["flex_softcap"] = flex(args.device, args.flex_seq, 16, 8, 256)
        except Exception as error:
            results["flex_softcap"] = {"error": f"{type(error).__name__}: {error}"[:500]}
        print("flex_softcap", results["flex_softcap"], flush=True)
    if args.out:
        write_json(args.out, run_meta(args.device, families=args.families.split(",")), results)


if __name__ == "__main__":
    main()
