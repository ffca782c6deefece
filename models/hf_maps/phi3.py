"""Phi-3 / Phi-4: libai_zoo names <- Hugging Face names. Llama's map, but q, k, v are one
``qkv_proj`` ([q; k; v] rows) and gate, up one ``gate_up_proj`` ([gate; up] rows); each rank reads
only its tp slice of each part."""

from __future__ import annotations

from libai_zoo.hf.rules import PackedQKV, Part, WeightMap

from .llama import indexed_layers, llama_weight_map


def phi3_weight_map(body, prefix: str, lm_head: bool = False) -> WeightMap:
    fused = {}
    for i, layer in indexed_layers(body.layers):
        z, h = f"{prefix}layers.{i}.", f"{prefix}layers.{i}."
        fused[z + "attn.qkv.weight"] = PackedQKV(z + "attn.qkv.weight", h + "self_attn.qkv_proj.weight",
                                                 layer.attn.num_heads, layer.attn.num_kv_heads)
        for index, part in enumerate(("gate", "up")):
            fused[f"{z}mlp.{part}.weight"] = Part(f"{z}mlp.{part}.weight", h + "mlp.gate_up_proj.weight", index, 2)
    weight_map = llama_weight_map(body, prefix, lm_head)
    weight_map.rules = [fused.get(rule.zoo, rule) for rule in weight_map.rules]
    return weight_map
