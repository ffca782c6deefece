"""gpt-oss: libai_zoo names <- Hugging Face names. Llama's map (with the attention sinks), but each
MoE layer's router is ``mlp.router`` (with a bias) and its experts are fused as the checkpoints
hold them: ``mlp.experts.gate_up_proj`` [E, h, 2I] (gate in the even columns, up in the odd),
``gate_up_proj_bias`` [E, 2I] alike, ``down_proj`` [E, I, h] and ``down_proj_bias`` [E, h]. A
rank reads only its experts' rows of each."""

from __future__ import annotations

from libai_zoo.hf.rules import Rule, Same, Strided, WeightMap, linear

from .llama import indexed_layers, llama_weight_map


def gpt_oss_moe_rules(z: str, h: str) -> list[Rule]:
    """The `layers.MoE` under `z` (router, experts with biases) from the gpt-oss tensors under `h`."""
    e, x = z + "experts.", h + "experts."
    return [*linear(z + "router", h + "router"),
            Strided(e + "gate_proj", x + "gate_up_proj", 0, 2, transposed=True),
            Strided(e + "up_proj", x + "gate_up_proj", 1, 2, transposed=True),
            Strided(e + "gate_bias", x + "gate_up_proj_bias", 0, 2),
            Strided(e + "up_bias", x + "gate_up_proj_bias", 1, 2),
            Strided(e + "down_proj", x + "down_proj", transposed=True),
            Same(e + "down_bias", x + "down_proj_bias")]


def gpt_oss_weight_map(body, prefix: str, lm_head: bool = False) -> WeightMap:
    weight_map = llama_weight_map(body, prefix, lm_head)
    layers = [f"{prefix}layers.{i}." for i, _ in indexed_layers(body.layers)]
    weight_map.rules = [rule for rule in weight_map.rules if not rule.zoo.startswith(tuple(z + "mlp." for z in layers))]
    for z in layers:
        weight_map.rules += gpt_oss_moe_rules(z + "mlp.", z + "mlp.")
    return weight_map
