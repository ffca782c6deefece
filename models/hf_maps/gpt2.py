"""GPT-2: libai_zoo names <- Hugging Face names. GPT-2 stores its linear layers as Conv1D
([in, out]) and packs q, k, v side by side in `c_attn`."""

from __future__ import annotations

from libai_zoo.hf.rules import PackedQKV, Same, WeightMap, linear


def gpt2_weight_map(body, prefix: str, lm_head: bool = False) -> WeightMap:
    config, p = body.config, prefix
    rules = [Same(f"{p}wte.weight", f"{p}wte.weight"), Same(f"{p}wpe.weight", f"{p}wpe.weight")]
    for i in range(config.n_layer):
        z, h = f"{p}h.{i}.", f"{p}h.{i}."
        rules += [
            *linear(z + "attn_norm", h + "ln_1"),
            PackedQKV(z + "attn.qkv.weight", h + "attn.c_attn.weight", config.n_head, transposed=True),
            PackedQKV(z + "attn.qkv.bias", h + "attn.c_attn.bias", config.n_head, transposed=True),
            *linear(z + "attn.out", h + "attn.c_proj", transposed=True),
            *linear(z + "mlp_norm", h + "ln_2"),
            *linear(z + "mlp.up", h + "mlp.c_fc", transposed=True),
            *linear(z + "mlp.down", h + "mlp.c_proj", transposed=True),
        ]
    rules += linear(f"{p}ln_f", f"{p}ln_f")
    if lm_head:
        rules.append(Same("lm_head.weight", "lm_head.weight"))
    # Old checkpoints hold the causal-mask buffers; tied ones may repeat the embedding as lm_head.
    return WeightMap(rules, ignore=(r".*\.attn\.(masked_)?bias", "lm_head.weight"))
