"""Training-step time of libai_zoo's models against their `transformers` twins: forward + backward + AdamW step.

Both models of a pair are built from the same `transformers` config object (dropout 0, no KV cache,
transformers on SDPA attention), cast to the same device and dtype, put in train() mode and given their
own `torch.optim.AdamW(lr=1e-4, foreach=True)`; they take the same batch and alternate round by round
so drift in clocks or load hits both. Weights differ (timing only). Prints per model the median step
time of each, their ratio (libai_zoo / transformers: below 1 is faster), the tokens/s libai_zoo reaches
and, on CUDA, its TFLOP/s (see `step_flops`) and the peak memory of a step (see `peak_mb`).

    python benchmarks/bench_models.py                       # CPU, fp32, small sizes, all models
    python benchmarks/bench_models.py --models gpt2,llama --steps 5
    python benchmarks/bench_models.py --models gpt2 --elementwise-recompute always   # norms recomputed
    python benchmarks/bench_models.py --device cuda --dtype bf16 --hidden 1024 --heads 16 --layers 12 \\
        --seq 1024 --batch 8 --vocab 32768 --image 224 --patch 16 --out benchmarks/results/bench_models_h100.json
"""

from __future__ import annotations

import argparse
import json

import torch
import transformers

from bench_common import DTYPES, alternate, peak_memory_mb, run_meta, write_json
from libai_zoo import models as zoo
from libai_zoo.config.settings import ELEMENTWISE_RECOMPUTE
from libai_zoo.layers.recomputed import set_elementwise_recompute

# name -> (libai_zoo.models class, transformers class); both take the same transformers config.
MODELS = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "bert": "BertForMaskedLM",
          "bert_cls": "BertForSequenceClassification", "vit": "ViTForImageClassification"}
CAUSAL = {"gpt2", "llama"}


def make_config(a, name: str) -> transformers.PretrainedConfig:
    """The one config both models of `name` are built from: dropout 0, no KV cache, SDPA attention."""
    common = {"attn_implementation": "sdpa", "use_cache": False}
    if name == "gpt2":
        return transformers.GPT2Config(vocab_size=a.vocab, n_positions=a.seq, n_embd=a.hidden, n_layer=a.layers,
                                       n_head=a.heads, n_inner=a.ffn, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **common)
    if name == "llama":
        return transformers.LlamaConfig(vocab_size=a.vocab, max_position_embeddings=a.seq, hidden_size=a.hidden,
                                        num_hidden_layers=a.layers, num_attention_heads=a.heads,
                                        num_key_value_heads=a.kv_heads, intermediate_size=a.ffn,
                                        attention_dropout=0.0, **common)
    if name in ("bert", "bert_cls"):
        return transformers.BertConfig(vocab_size=a.vocab, max_position_embeddings=a.seq, hidden_size=a.hidden,
                                       num_hidden_layers=a.layers, num_attention_heads=a.heads,
                                       intermediate_size=a.ffn, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0, num_labels=2, **common)
    return transformers.ViTConfig(image_size=a.image, patch_size=a.patch, hidden_size=a.hidden,
                                  num_hidden_layers=a.layers, num_attention_heads=a.heads, intermediate_size=a.ffn,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=10,
                                  attn_implementation="sdpa")


def make_batch(a, name: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Model inputs with labels: LM labels = input_ids (shifted inside the model); MLM keeps ~15% of them."""
    b, dev = a.batch, a.device
    if name == "vit":
        return {"pixel_values": torch.randn(b, 3, a.image, a.image, device=dev, dtype=dtype),
                "labels": torch.randint(10, (b,), device=dev)}
    ids = torch.randint(a.vocab, (b, a.seq), device=dev)
    if name == "bert":
        return {"input_ids": ids, "labels": ids.masked_fill(torch.rand(ids.shape, device=dev) > 0.15, -100)}
    if name == "bert_cls":
        return {"input_ids": ids, "labels": torch.randint(2, (b,), device=dev)}
    return {"input_ids": ids, "labels": ids}


def tokens_per_seq(a, name: str) -> int:
    """Sequence length: text tokens, or ViT's patches plus its CLS token."""
    return (a.image // a.patch) ** 2 + 1 if name == "vit" else a.seq


def step_flops(a, name: str) -> float:
    """Matmul FLOPs of one training step, analytically: 6 × N × tokens + attention.

    N counts the weights of the matmuls every token goes through (biases, norms and embedding lookups
    left out): per layer q/k/v and output projections (k/v narrower with Llama's KV heads) and the MLP
    (3 matrices when gated, Llama; else 2), plus the vocabulary projection of LM heads (and BERT's MLM
    transform) or ViT's patch embedding (counted on every token, CLS included, and with an input gradient
    the pixels do not need: a slight overcount); pooler and classifiers, which see one token per sequence,
    are left out. 6 = 2 FLOPs per multiply-add × (forward + 2 × backward). Attention scores and their use
    on the values: 12 × layers × seq × hidden per token (forward 4, ×3), halved when causal. The AdamW
    update (elementwise) is not counted. The matmul part equals torch.utils.flop_counter's count for the
    transformers text models.
    """
    h, d = a.hidden, a.hidden // a.heads
    kv = a.kv_heads if name == "llama" else a.heads
    layer = h * (a.heads + 2 * kv) * d + h * h + (3 if name == "llama" else 2) * h * a.ffn
    head = {"gpt2": a.vocab * h, "llama": a.vocab * h, "bert": h * h + a.vocab * h, "bert_cls": 0,
            "vit": 3 * a.patch * a.patch * h}[name]
    s = tokens_per_seq(a, name)
    tokens = a.batch * s
    attention = 12 * a.layers * s * h * tokens * (0.5 if name in CAUSAL else 1.0)
    return 6 * (a.layers * layer + head) * tokens + attention


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]):
    """One timed step: drop the gradients (set_to_none), forward to the loss, backward, AdamW step."""
    def run():
        opt.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        opt.step()
    return run


def peak_mb(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor],
            device: str) -> float | None:
    """Peak CUDA memory of a step as if the model were alone on the device, in MiB: its parameters, buffers
    and AdamW state plus the most the step adds over them (activations, gradients, optimizer temporaries).
    Both models of a pair stay resident, so this one's share is counted tensor by tensor rather than read."""
    if not device.startswith("cuda"):
        return None
    opt.zero_grad(set_to_none=True)
    resident = [*model.parameters(), *model.buffers(),
                *(t for state in opt.state.values() for t in state.values() if torch.is_tensor(t))]
    resident_mb = sum(t.numel() * t.element_size() for t in resident if t.is_cuda) / 2**20
    return resident_mb + peak_memory_mb(train_step(model, opt, batch), device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=None, help="Llama KV heads (default heads / 2)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=None, help="MLP size (default 4 × hidden)")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--image", type=int, default=64, help="ViT image side")
    parser.add_argument("--patch", type=int, default=8, help="ViT patch side")
    parser.add_argument("--steps", type=int, default=10, help="timed rounds (median taken over them)")
    parser.add_argument("--iters", type=int, default=1, help="steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each model first")
    parser.add_argument("--elementwise-recompute", choices=sorted(ELEMENTWISE_RECOMPUTE), default="auto",
                        help="libai_zoo's train.elementwise_recompute: when norms and act(gate)*up recompute in backward")
    parser.add_argument("--out", help="also write the results as JSON here")
    a = parser.parse_args()
    names = [n.strip() for n in a.models.split(",") if n.strip()]
    if unknown := [n for n in names if n not in MODELS]:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    a.dtype = a.dtype or ("bf16" if a.device.startswith("cuda") else "fp32")
    a.kv_heads = a.kv_heads or max(1, a.heads // 2)
    a.ffn = a.ffn or 4 * a.hidden
    dtype = DTYPES[a.dtype]
    torch.manual_seed(0)

    results = {}
    for name in names:
        cls = MODELS[name]
        config = make_config(a, name)
        with torch.device(a.device):  # initialize on the device: quicker for large sizes on CUDA
            pair = {"libai_zoo": getattr(zoo, cls)(config),
                    "transformers": getattr(transformers, cls)(config)}
        set_elementwise_recompute(pair["libai_zoo"], a.elementwise_recompute)
        opts = {}
        for side, model in pair.items():
            model.to(a.device, dtype).train()
            opts[side] = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        batch = make_batch(a, name, dtype)
        ms = alternate({side: train_step(pair[side], opts[side], batch) for side in pair},
                       a.steps, a.iters, a.warmup, a.device)
        tokens = a.batch * tokens_per_seq(a, name)
        results[name] = {"libai_zoo_ms": ms["libai_zoo"], "transformers_ms": ms["transformers"],
                         "ratio": ms["libai_zoo"] / ms["transformers"],
                         "libai_zoo_tokens_per_s": tokens / ms["libai_zoo"] * 1e3,
                         "libai_zoo_tflops": step_flops(a, name) / ms["libai_zoo"] / 1e9,
                         "transformers_tflops": step_flops(a, name) / ms["transformers"] / 1e9,
                         **{f"{side}_params": sum(p.numel() for p in m.parameters()) for side, m in pair.items()},
                         **{f"{side}_peak_mb": peak_mb(pair[side], opts[side], batch, a.device) for side in pair}}
        del pair, opts, batch
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()

    meta = run_meta(a.device, dtype=a.dtype, batch=a.batch, seq=a.seq, hidden=a.hidden, heads=a.heads,
                    kv_heads=a.kv_heads, layers=a.layers, ffn=a.ffn, vocab=a.vocab, image=a.image, patch=a.patch,
                    steps=a.steps, iters=a.iters, warmup=a.warmup, elementwise_recompute=a.elementwise_recompute)
    cuda = a.device.startswith("cuda")
    print(json.dumps(meta))
    print(f"{'model':<9} {'params M ours/HF':>17} {'libai_zoo ms':>13} {'transformers ms':>16} {'ratio':>7} "
          f"{'tokens/s ours':>14}" + (f" {'TFLOP/s ours':>13} {'peak MB ours/HF':>17}" if cuda else ""))
    for name, r in results.items():
        params = f"{r['libai_zoo_params'] / 1e6:.2f}/{r['transformers_params'] / 1e6:.2f}"
        line = (f"{name:<9} {params:>17} {r['libai_zoo_ms']:>13.2f} {r['transformers_ms']:>16.2f} "
                f"{r['ratio']:>7.3f} {r['libai_zoo_tokens_per_s']:>14.0f}")
        if cuda:
            mem = f"{r['libai_zoo_peak_mb']:.0f}/{r['transformers_peak_mb']:.0f}"
            line += f" {r['libai_zoo_tflops']:>13.1f} {mem:>17}"
        print(line)
    if a.out:
        write_json(a.out, meta, results)


if __name__ == "__main__":
    main()
