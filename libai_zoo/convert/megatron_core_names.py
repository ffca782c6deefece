"""Megatron-Core's tensor names for a zoo decoder's parameters: the weight map both directions use.

Megatron-Core's `GPTModel` names its tensors (with the layer norms as the Transformer Engine
layers hold them; Megatron-Core's local layers map theirs to these names when saving):

    embedding.word_embeddings.weight                     [padded vocab, h]   rows split over tp
    embedding.position_embeddings.weight                 [positions, h]      learned positions only
    decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight (, _bias)  the pre-attention norm
    decoder.layers.{i}.self_attention.linear_qkv.weight (, .bias)  per query group [its q heads, k, v]
    decoder.layers.{i}.self_attention.q_layernorm.weight, k_layernorm.weight  per-head q/k norms (--qk-layernorm)
    decoder.layers.{i}.self_attention.linear_proj.weight (, .bias) columns split over tp
    decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight (, _bias)  the pre-MLP norm
    decoder.layers.{i}.mlp.linear_fc1.weight (, .bias)   [gate; up] with SwiGLU (per rank in torch files)
    decoder.layers.{i}.mlp.linear_fc2.weight (, .bias)   columns split over tp
    decoder.final_layernorm.weight (, .bias)
    output_layer.weight                                  untied head only

An MoE layer (--num-experts E; dense and MoE layers mixed by --moe-layer-freq are kept per layer
in torch_dist, all-MoE layers stacked like the others) has instead of the MLP's:

    decoder.layers.{i}.pre_mlp_layernorm.weight          the pre-MLP norm (the local layer spec files it
                                                         as mlp.linear_fc1.layer_norm_weight: both read)
    decoder.layers.{i}.mlp.router.weight                 [E, h]
    decoder.layers.{i}.mlp.experts.experts.linear_fc1.weight  [E, gate; up, h]  the same for SequentialMLP
    decoder.layers.{i}.mlp.experts.experts.linear_fc2.weight  [E, h, F]         and grouped GEMM experts
    decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight, linear_fc2.weight, gate_weight  (shared expert)

The grouped `linear_qkv` is libai_zoo's fused `qkv` row for row, so the map
(`megatron_weight_map`) pairs the zoo's parameters with these names using the rules of the
Hugging Face maps (`libai_zoo.hf.rules`); Hugging Face names and layouts are the models' own
maps' business (`save_pretrained`, `from_pretrained`), never restated here. The map is read off
the built model (its parts, biases and norms), never its family's name.
"""

from __future__ import annotations

import torch
from torch import nn

from libai_zoo.hf.rules import PaddedRows, Part, Same, WeightMap, linear
from libai_zoo.layers import MoE

from .megatron_files import LAYER_NAME

# Megatron-Core's local layers name their norms apart; their checkpoints use the fused names.
LOCAL_NORMS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
               "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def megatron_weight_map(model: nn.Module, padded_vocab: int) -> WeightMap:
    """The rules of a zoo decoder's parameters <- Megatron-Core names (per layer, global numbering),
    read off the built model: its parts' names, biases, norms, q/k norms, gated MLP, and an MoE
    layer's norm, router, experts and shared expert."""
    body, rules = model.body, []
    names, p = body.names, model.base_model_prefix + "."

    def pair(zoo: str, mcore: str, part: nn.Module) -> None:
        rules.extend(linear(zoo, mcore, bias=getattr(part, "bias", None) is not None))

    def norm(zoo: str, mcore: str, part: nn.Module) -> None:  # the fused norms: "layer_norm_weight"
        rules.append(Same(f"{zoo}.weight", f"{mcore}weight"))
        if getattr(part, "bias", None) is not None:
            rules.append(Same(f"{zoo}.bias", f"{mcore}bias"))

    def mlp_pair(zoo: str, mcore: str, mlp: nn.Module) -> None:  # linear_fc1 = [gate; up] when gated
        if mlp.gate is None:
            pair(f"{zoo}.up", f"{mcore}linear_fc1", mlp.up)
        else:
            for index, part in enumerate((mlp.gate, mlp.up)):
                for suffix in ("weight", "bias") if part.bias is not None else ("weight",):
                    rules.append(Part(f"{zoo}.{('gate', 'up')[index]}.{suffix}", f"{mcore}linear_fc1.{suffix}",
                                      index, 2))
        pair(f"{zoo}.down", f"{mcore}linear_fc2", mlp.down)

    def moe(zoo: str, mcore: str, mlp: MoE) -> None:
        """The router, the experts stacked as Megatron-Core's torch_dist holds them (the same for
        SequentialMLP and grouped GEMM experts: fc1 [E, gate; up, h], fc2 [E, h, F]) and the
        shared expert, with its sigmoid gate (Qwen2-MoE's)."""
        rules.append(Same(f"{zoo}.router.weight", f"{mcore}router.weight"))
        fc1, fc2 = f"{mcore}experts.experts.linear_fc1.weight", f"{mcore}experts.experts.linear_fc2.weight"
        rules.extend([Part(f"{zoo}.experts.gate_proj", fc1, 0, 2, dim=1), Part(f"{zoo}.experts.up_proj", fc1, 1, 2, dim=1),
                      Same(f"{zoo}.experts.down_proj", fc2)])
        if mlp.shared_expert is not None:
            mlp_pair(f"{zoo}.shared_expert", f"{mcore}shared_experts.", mlp.shared_expert)
        if mlp.shared_expert_gate is not None:
            rules.append(Same(f"{zoo}.shared_expert_gate.weight", f"{mcore}shared_experts.gate_weight"))

    rules.append(PaddedRows(f"{p}{names.embed}.weight", "embedding.word_embeddings.weight", padded_vocab))
    if names.positions:
        rules.append(Same(f"{p}{names.positions}.weight", "embedding.position_embeddings.weight"))
    for i, layer in enumerate(getattr(body, names.layers)):
        z, m = f"{p}{names.layers}.{i}.", f"decoder.layers.{i}."
        attn, mlp = layer.attn, layer.mlp
        norm(z + "attn_norm", m + "self_attention.linear_qkv.layer_norm_", layer.attn_norm)
        pair(z + "attn.qkv", m + "self_attention.linear_qkv", attn.qkv)
        if attn.qk_norm:  # --qk-layernorm: one norm over each head's channels, shared by the heads
            for part in ("q", "k"):
                rules.append(Same(f"{z}attn.{part}_norm.weight", f"{m}self_attention.{part}_layernorm.weight"))
        pair(z + "attn.out", m + "self_attention.linear_proj", attn.out)
        if isinstance(mlp, MoE):  # Transformer Engine's name: the experts are no fused norm-linear
            norm(z + "mlp_norm", m + "pre_mlp_layernorm.", layer.mlp_norm)
            moe(z + "mlp", m + "mlp.", mlp)
        else:
            norm(z + "mlp_norm", m + "mlp.linear_fc1.layer_norm_", layer.mlp_norm)
            mlp_pair(z + "mlp", m + "mlp.", mlp)
    pair(f"{p}{names.final_norm}", "decoder.final_layernorm", getattr(body, names.final_norm))
    if not model.config.tie_word_embeddings:
        rules.append(PaddedRows("lm_head.weight", "output_layer.weight", padded_vocab))
    return WeightMap(rules)


# ----------------------------------------------------------------------------- names read


def canonical_name(name: str) -> str:
    """A Megatron-Core tensor name with the local layers' norm names as the checkpoint's."""
    layer = LAYER_NAME.match(name.removeprefix("decoder."))
    if name.startswith("decoder.layers.") and layer:
        rest = layer[2]
        for local, fused in LOCAL_NORMS.items():
            if rest.startswith(local):
                return f"decoder.layers.{layer[1]}.{fused}{rest[len(local):]}"
    return name


def moe_norm_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An MoE layer's pre-MLP norm under Transformer Engine's name (`pre_mlp_layernorm.`): the
    local layer spec files it under `mlp.linear_fc1.layer_norm_` as a dense layer's."""
    moe_layers = {name.removesuffix("mlp.router.weight") for name in tensors if name.endswith(".mlp.router.weight")}
    renamed = {}
    for name, tensor in tensors.items():
        layer, _, rest = name.rpartition("mlp.linear_fc1.layer_norm_")
        renamed[f"{layer}pre_mlp_layernorm.{rest}" if layer in moe_layers else name] = tensor
    return renamed


def check_covered(model: nn.Module, rules: list) -> None:
    """Every parameter has a rule, so none is left as initialised (Megatron-LM issue 5845: a
    Mixtral conversion that left every expert random)."""
    covered = {rule.zoo for rule in rules}
    missed = [name for name, _ in model.named_parameters() if name not in covered]
    if missed:
        raise ValueError(f"{len(missed)} parameter(s) of {type(model).__name__} have no Megatron-Core name and would "
                         f"not be converted: {', '.join(missed[:6])}")
