"""Forward+backward time of libai_zoo's TransformerLayer against the Hugging Face block it replaces.

Same sizes, same batch, same dtype, same process; the two alternate round by round so drift in
clocks or load hits both. Prints per block the median step time of each, their ratio
(libai_zoo / transformers: below 1 is faster), the matmul TFLOP/s libai_zoo reaches and, on
CUDA, the peak memory of a step.

    python benchmarks/bench_layers.py                       # CPU, fp32, small sizes
    python benchmarks/bench_layers.py --device cuda --dtype bf16 --hidden 2048 --heads 16 --seq 2048
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import BertConfig, GPT2Config, LlamaConfig
from transformers.models.bert.modeling_bert import BertLayer
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from bench_common import DTYPES, alternate, peak_memory_mb, run_meta, write_json
from libai_zoo import layers


def build_pairs(a) -> dict[str, tuple]:
    """name -> (libai_zoo step input -> output, transformers step input -> output, modules)."""
    h, nh, kv, ffn = a.hidden, a.heads, a.kv_heads, a.ffn
    gpt2 = GPT2Block(GPT2Config(n_embd=h, n_head=nh, n_inner=ffn, activation_function="gelu_new",
                                attn_implementation="sdpa", resid_pdrop=0.0, attn_pdrop=0.0), layer_idx=0)
    ours_gpt2 = layers.TransformerLayer(layers.LayerSpec(h, layers.AttentionSpec(nh, causal=True),
                                                         layers.MLPSpec(ffn, activation="gelu_new")))
    bert = BertLayer(BertConfig(hidden_size=h, num_attention_heads=nh, intermediate_size=ffn,
                                attn_implementation="sdpa", hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0))
    ours_bert = layers.TransformerLayer(layers.LayerSpec(h, layers.AttentionSpec(nh), layers.MLPSpec(ffn),
                                                         norm_position="post", norm_eps=1e-12))
    llama_config = LlamaConfig(hidden_size=h, num_attention_heads=nh, num_key_value_heads=kv, intermediate_size=ffn,
                               rope_theta=10000.0, attn_implementation="sdpa")
    llama, rotary = LlamaDecoderLayer(llama_config, layer_idx=0), LlamaRotaryEmbedding(llama_config)
    attention = layers.AttentionSpec(nh, num_kv_heads=kv, causal=True, bias=False, rope_theta=10000.0)
    mlp = layers.MLPSpec(ffn, activation="silu", gated=True, bias=False)
    ours_llama = layers.TransformerLayer(layers.LayerSpec(h, attention, mlp, norm="rmsnorm"))
    positions = torch.arange(a.seq, device=a.device)[None].expand(a.batch, -1)

    def hf_llama(x):
        return llama(x, position_ids=positions, position_embeddings=rotary(x, positions))

    return {"gpt2_block": (ours_gpt2, gpt2, (ours_gpt2, gpt2)),
            "bert_layer": (ours_bert, bert, (ours_bert, bert)),
            "llama_layer": (lambda x: ours_llama(x, position_ids=positions), hf_llama, (ours_llama, llama, rotary))}


def step_flops(a, name: str) -> float:
    """Matmul FLOPs of one forward+backward (3 × forward), attention scores included; causal halves them."""
    d = a.hidden // a.heads
    kv = a.kv_heads if name == "llama_layer" else a.heads
    mlp_mats = 3 if name == "llama_layer" else 2
    per_token = 2 * (a.hidden * (a.heads + 2 * kv) * d + a.hidden * a.hidden + mlp_mats * a.hidden * a.ffn)
    attention = 4 * a.batch * a.seq * a.seq * a.hidden * (0.5 if name != "bert_layer" else 1.0)
    return 3 * (per_token * a.batch * a.seq + attention)


def fwd_bwd(step, x, grad, drop_grad: bool = True):
    """One step as a call: forward, then backward from `grad`, dropping the input's gradient first if asked."""
    def run():
        if drop_grad:
            x.grad = None
        step(x).backward(grad)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None, help="Llama KV heads (default heads / 4)")
    parser.add_argument("--ffn", type=int, default=None, help="MLP size (default 4 × hidden)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=10, help="steps per round")
    parser.add_argument("--out", help="also write the results as JSON here")
    a = parser.parse_args()
    a.dtype = a.dtype or ("bf16" if a.device.startswith("cuda") else "fp32")
    a.kv_heads = a.kv_heads or max(1, a.heads // 4)
    a.ffn = a.ffn or 4 * a.hidden
    dtype = DTYPES[a.dtype]
    torch.manual_seed(0)

    pairs = build_pairs(a)
    results = {}
    for name, (ours, hf, modules) in pairs.items():
        for m in modules:
            m.to(device=a.device, dtype=dtype if not isinstance(m, LlamaRotaryEmbedding) else None)
        x = torch.randn(a.batch, a.seq, a.hidden, device=a.device, dtype=dtype, requires_grad=True)
        grad = torch.randn_like(x)
        ms = alternate({"libai_zoo": fwd_bwd(ours, x, grad), "transformers": fwd_bwd(hf, x, grad)},
                       a.rounds, a.iters, warmup=2, device=a.device)
        results[name] = {"libai_zoo_ms": ms["libai_zoo"], "transformers_ms": ms["transformers"],
                         "ratio": ms["libai_zoo"] / ms["transformers"],
                         "libai_zoo_tflops": step_flops(a, name) / ms["libai_zoo"] / 1e9,
                         "libai_zoo_peak_mb": peak_memory_mb(fwd_bwd(ours, x, grad, drop_grad=False), a.device),
                         "transformers_peak_mb": peak_memory_mb(fwd_bwd(hf, x, grad, drop_grad=False), a.device)}

    meta = run_meta(a.device, dtype=a.dtype, batch=a.batch, seq=a.seq, hidden=a.hidden, heads=a.heads,
                    kv_heads=a.kv_heads, ffn=a.ffn)
    print(json.dumps(meta))
    print(f"{'block':<12} {'libai_zoo ms':>13} {'transformers ms':>16} {'ratio':>7} {'TFLOP/s ours':>13} "
          f"{'peak MB ours/HF':>17}")
    for name, r in results.items():
        mem = "" if r["libai_zoo_peak_mb"] is None else f"{r['libai_zoo_peak_mb']:.0f}/{r['transformers_peak_mb']:.0f}"
        print(f"{name:<12} {r['libai_zoo_ms']:>13.3f} {r['transformers_ms']:>16.3f} {r['ratio']:>7.3f} "
              f"{r['libai_zoo_tflops']:>13.1f} {mem:>17}")
    if a.out:
        write_json(a.out, meta, results)


if __name__ == "__main__":
    main()
