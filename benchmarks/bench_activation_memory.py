"""One transformer layer's saved activations against Korthikanti et al. 2022's accounting.

A GPT layer (LayerNorm, GELU 4h, biases) and a Llama layer (RMSNorm, SwiGLU, grouped-query
attention, rotary), bf16 weights and a bf16 input, s 512, b 2, h 256, run one training forward
at tp1 and at tp2/4/8 with sequence parallelism, split over a fake tp group in this one process
(`libai_zoo.plan.fake_world`: collectives return right-shaped garbage, which is all a count
needs). The bytes are every distinct storage autograd saves, parameters left out
(`libai_zoo.plan.activations.first_layer_saved_bytes`), printed as a ratio to the accounting
(`reference_layer_bytes`: 16-bit activations, fused attention, no dropout):

    GPT:   32·sbh/t
    Llama: sbh(12 + 4/g + 6f/h)/t   (g = heads / KV heads, f the SwiGLU width; 30.125 here)

beside the planner's figure for the same layer (`SavedActivations`, fake tensors), which must
equal the real count.

    python benchmarks/bench_activation_memory.py [--out results.json]
"""

from __future__ import annotations

import argparse

import torch
import transformers

from bench_common import run_meta, write_json
from libai_zoo import models
from libai_zoo.plan.activations import SavedActivations, Shapes, first_layer_saved_bytes, reference_layer_bytes

SEQ, BATCH, HIDDEN, HEADS, KV_HEADS, LLAMA_FFN = 512, 2, 256, 16, 8, 688
TPS = (1, 2, 4, 8)


def gpt(layers: int = 1) -> models.GPT2LMHeadModel:
    return models.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=512, n_embd=HIDDEN, n_layer=layers, n_head=HEADS, n_inner=4 * HIDDEN, n_positions=SEQ,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2))


def llama(layers: int = 1) -> models.LlamaForCausalLM:
    return models.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=512, hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, intermediate_size=LLAMA_FFN, max_position_embeddings=SEQ, bos_token_id=1,
        eos_token_id=2))


#: per family: the model, its MLP's width, heads per KV head, whether the MLP is gated
FAMILIES = {"gpt": (gpt, 4 * HIDDEN, 1, False), "llama": (llama, LLAMA_FFN, HEADS // KV_HEADS, True)}


def planned(build, tp: int) -> int:
    """The planner's figure for the same layer (fake tensors)."""
    with torch.device("meta"):
        model = build().to(torch.bfloat16)
    return SavedActivations(model).layer(0, Shapes(BATCH, SEQ, tp, tp > 1, None, "cpu"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    results = {}
    print("| layer | tp | saved bytes | planner bytes | accounting bytes | ratio |")
    print("|---|---|---|---|---|---|")
    for name, (build, ffn, groups, gated) in FAMILIES.items():
        for tp in TPS:
            torch.manual_seed(0)
            real = first_layer_saved_bytes(build().to(torch.bfloat16).train(), BATCH, SEQ, tp)
            planner = planned(build, tp)
            expected = reference_layer_bytes(SEQ * BATCH, HIDDEN, ffn, kv_groups=groups, gated=gated, tp=tp)
            results[f"{name} tp{tp}"] = {"saved": real, "planner": planner, "accounting": expected,
                                         "ratio": real / expected}
            print(f"| {name} | {tp}{' + SP' if tp > 1 else ''} | {real} | {planner} | {expected:.0f} | "
                  f"{real / expected:.2f} |")
    if args.out:
        meta = run_meta("cpu", dtype="bf16", seq=SEQ, batch=BATCH, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS,
                        llama_ffn=LLAMA_FFN, sequence_parallel=True)
        write_json(args.out, meta, results)


if __name__ == "__main__":
    main()
