"""Forward+backward time of libai_zoo's MoE layer, grouped GEMM against its per-expert loop and
against transformers' own Qwen3-MoE block with the same weights.

Each size builds one `layers.MoE` (softmax top-k router, norm_topk_prob, SwiGLU experts) and a
`Qwen3MoeSparseMoeBlock` holding the same weights (`gate_up_proj` = [gate; up] stacked), then times
in the same process, alternating round by round so drift in clocks or load hits all four:

    grouped       libai_zoo, torch._grouped_mm over the tokens sorted by expert (the default)
    loop          libai_zoo, the same layer with `experts.grouped_mm = False` (one matmul per expert)
    hf_eager      transformers' block as it runs by default (a loop over the experts hit)
    hf_grouped    transformers' block with `config._experts_implementation = "grouped_mm"`

A step is one forward of [tokens, hidden] and a backward from a fixed random gradient (input and
parameter gradients). Prints per size the median ms of each, the ratios grouped / loop and
grouped / transformers (below 1: grouped GEMM is faster), the matmul TFLOP/s the grouped layer
reaches (3 × 2 · tokens · k · 3 · hidden · ffn) and, on CUDA, the peak memory of a step; also the
largest output difference against transformers eager (a check that the weights match, not a test).

    python benchmarks/bench_moe.py                                    # CPU, fp32, the default sizes
    python benchmarks/bench_moe.py --sizes 512x256xe64k8xt2048 --rounds 3
    python benchmarks/bench_moe.py --device cuda --dtype bf16 \\
        --sizes 2048x768xe128k8xt8192,4096x14336xe8k2xt8192 --out benchmarks/results/bench_moe_h100.json

A size is HIDDENxFFNxeEXPERTSkTOPKxtTOKENS.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from bench_common import DTYPES, alternate, peak_memory_mb, run_meta, write_json
from libai_zoo import layers

# Mixtral-shaped (few wide experts, top-2) and Qwen3-MoE-shaped (many narrow experts, top-8).
CPU_SIZES = "512x1024xe8k2xt2048,512x256xe64k8xt2048,1024x512xe32k4xt2048,512x256xe64k8xt4096"
CUDA_SIZES = "1024x2816xe8k2xt8192,2048x768xe64k8xt8192,2048x768xe128k8xt8192,4096x14336xe8k2xt8192"
RUNS = ("grouped", "loop", "hf_eager", "hf_grouped")


def parse_size(text: str) -> dict[str, int]:
    match = re.fullmatch(r"(\d+)x(\d+)xe(\d+)k(\d+)xt(\d+)", text)
    if match is None:
        raise ValueError(f"size {text!r} is not HIDDENxFFNxeEXPERTSkTOPKxtTOKENS (e.g. 512x1024xe8k2xt2048)")
    hidden, ffn, experts, top_k, tokens = map(int, match.groups())
    return {"hidden": hidden, "ffn": ffn, "experts": experts, "top_k": top_k, "tokens": tokens}


def build(size: dict[str, int], device: str, dtype: torch.dtype) -> tuple[layers.MoE, Qwen3MoeSparseMoeBlock]:
    """The libai_zoo layer and transformers' block with the same random weights."""
    h, ffn, e, k = size["hidden"], size["ffn"], size["experts"], size["top_k"]
    ours = layers.MoE(h, e, k, ffn, norm_topk_prob=True)
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=h ** -0.5)
    config = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=ffn, num_experts=e, num_experts_per_tok=k,
                            norm_topk_prob=True, hidden_act="silu")
    hf = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        hf.gate.weight.copy_(ours.router.weight)
        hf.experts.gate_up_proj.copy_(torch.cat([ours.experts.gate_proj, ours.experts.up_proj], dim=1))
        hf.experts.down_proj.copy_(ours.experts.down_proj)
    return ours.to(device=device, dtype=dtype), hf.to(device=device, dtype=dtype)


def step_flops(size: dict[str, int]) -> float:
    """Matmul FLOPs of the experts' forward+backward (router left out): 3 × forward."""
    return 3 * 2 * size["tokens"] * size["top_k"] * 3 * size["hidden"] * size["ffn"]


def fwd_bwd(module: torch.nn.Module, forward, x: torch.Tensor, grad: torch.Tensor):
    """One step as a call: gradients dropped, forward, backward from `grad`."""
    def run():
        x.grad = None
        module.zero_grad(set_to_none=True)
        forward(x).backward(grad)
    return run


def measure(size: dict[str, int], a, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    ours, hf = build(size, a.device, dtype)
    x = torch.randn(1, size["tokens"], size["hidden"], device=a.device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)

    def ours_with(grouped: bool):
        def forward(inputs):
            ours.experts.grouped_mm = grouped
            return ours(inputs)[0]
        return forward

    def hf_with(implementation: str):
        def forward(inputs):
            hf.experts.config._experts_implementation = implementation
            return hf(inputs)
        return forward

    forwards = {"grouped": (ours, ours_with(True)), "loop": (ours, ours_with(False)),
                "hf_eager": (hf, hf_with("eager")), "hf_grouped": (hf, hf_with("grouped_mm"))}
    with torch.no_grad():
        reference = forwards["hf_eager"][1](x).float()
        diff = max((forwards[run][1](x).float() - reference).abs().max().item() for run in RUNS)
    steps = {run: fwd_bwd(module, forward, x, grad) for run, (module, forward) in forwards.items()}
    ms = alternate(steps, a.rounds, a.iters, warmup=a.warmup, device=a.device)
    peak = {run: peak_memory_mb(step, a.device) for run, step in steps.items()}
    return {**size, **{f"{run}_ms": ms[run] for run in RUNS},
            "grouped_over_loop": ms["grouped"] / ms["loop"], "grouped_over_hf_eager": ms["grouped"] / ms["hf_eager"],
            "grouped_over_hf_grouped": ms["grouped"] / ms["hf_grouped"],
            "grouped_tflops": step_flops(size) / ms["grouped"] / 1e9, "max_abs_diff_vs_hf": diff,
            **{f"{run}_peak_mb": peak[run] for run in RUNS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--sizes", default=None,
                        help=f"comma-separated HIDDENxFFNxeEXPERTSkTOPKxtTOKENS (default on CPU {CPU_SIZES}; "
                             f"on CUDA {CUDA_SIZES})")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=2, help="steps per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps of each run first")
    parser.add_argument("--out", help="also write the results as JSON here")
    a = parser.parse_args()
    cuda = a.device.startswith("cuda")
    a.dtype = a.dtype or ("bf16" if cuda else "fp32")
    sizes = [parse_size(s) for s in (a.sizes or (CUDA_SIZES if cuda else CPU_SIZES)).split(",")]

    meta = run_meta(a.device, dtype=a.dtype, rounds=a.rounds, iters=a.iters, warmup=a.warmup)
    print(json.dumps(meta))
    print(f"{'hidden':>6} {'ffn':>5} {'E':>3} {'k':>2} {'tokens':>6} {'grouped ms':>10} {'loop ms':>9} "
          f"{'HF eager':>9} {'HF grouped':>10} {'g/loop':>6} {'g/HF':>6} {'g/HFg':>6} {'TFLOP/s':>7} {'diff':>8} "
          f"{'peak MB g/loop/HF':>18}", flush=True)
    results = []
    for index, size in enumerate(sizes, 1):
        print(f"# size {index}/{len(sizes)}: {size} ({a.rounds} rounds of {a.iters} steps of each run)...",
              file=sys.stderr, flush=True)  # a size takes a minute or more on a CPU
        r = measure(size, a, DTYPES[a.dtype])
        results.append(r)
        mem = "" if r["grouped_peak_mb"] is None else \
            f"{r['grouped_peak_mb']:.0f}/{r['loop_peak_mb']:.0f}/{r['hf_eager_peak_mb']:.0f}"
        print(f"{r['hidden']:>6} {r['ffn']:>5} {r['experts']:>3} {r['top_k']:>2} {r['tokens']:>6} "
              f"{r['grouped_ms']:>10.2f} {r['loop_ms']:>9.2f} {r['hf_eager_ms']:>9.2f} {r['hf_grouped_ms']:>10.2f} "
              f"{r['grouped_over_loop']:>6.3f} {r['grouped_over_hf_eager']:>6.3f} "
              f"{r['grouped_over_hf_grouped']:>6.3f} {r['grouped_tflops']:>7.3f} {r['max_abs_diff_vs_hf']:>8.1e} "
              f"{mem:>18}", flush=True)
    if a.out:
        write_json(a.out, meta, {"sizes": results})


if __name__ == "__main__":
    main()
