"""gpt-oss (OpenAI, 2025): a pre-norm decoder whose MLPs are Mixtures of Experts, with attention
sinks and sliding windows on every other layer.

    x = x + attn(rmsnorm(x))      q, k, v, o with biases; YaRN rotary; softmax over the keys and
                                  a learned sink logit per head (dropped after it); a window of
                                  sliding_window positions on the "sliding_attention" layers
    x = x + Σ_{e in top-k} w_e · expert_e(rmsnorm(x))     w = softmax of the k largest router
                                  logits (the router has a bias)
    expert(h) = down((clamp(up, ±limit) + 1) · g · sigmoid(alpha · g)),  g = min(gate, limit)
                                  (gate, up, down with biases: the clamped SwiGLU)

The checkpoints hold each layer's experts fused (`hf_maps/gpt_oss.py`). The released ones store
them quantized to MXFP4, which libai_zoo does not read: such a directory is refused, naming how to
dequantize it. The loss adds router_aux_loss_coef × the load-balancing loss when
``output_router_logits``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import transformers
from torch import nn

from libai_zoo.layers import LayerSpec, MoESpec

from .config_reading import refuse_quantized
from .decoder import DecoderForCausalLM, DecoderModel, DecoderSpec
from .hf_maps.gpt_oss import gpt_oss_weight_map
from .llama import llama_layer, moe_spec


class GptOssConfig(transformers.GptOssConfig):
    """Hugging Face's GptOssConfig: reads a gpt-oss config.json unchanged and writes it back."""


def gpt_oss_layer(config: GptOssConfig, index: int) -> LayerSpec:
    moe = MoESpec(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                  ffn_hidden_size=config.intermediate_size, router="topk_softmax", router_bias=True, bias=True,
                  activation=config.hidden_act, swiglu_limit=config.swiglu_limit, swiglu_alpha=config.swiglu_alpha)
    return replace(llama_layer(config, index), mlp=moe).with_attention(sinks=True)


def gpt_oss_spec(config: GptOssConfig) -> DecoderSpec:
    refuse_quantized(config, "dequantize the checkpoint first (transformers' GptOssForCausalLM.from_pretrained("
                             "path, quantization_config=Mxfp4Config(dequantize=True)), then save_pretrained) and drop "
                             "quantization_config from its config.json if it remains")
    return moe_spec(config, gpt_oss_layer)


class GptOssModel(DecoderModel):
    config_class = GptOssConfig
    base_model_prefix = "model"
    describe = staticmethod(gpt_oss_spec)
    weight_map = gpt_oss_weight_map

    def init_parameter(self, name: str, module: nn.Module, tensor: torch.Tensor,
                       generator: torch.Generator | None) -> None:
        """transformers' rules, and its router bias drawn as the weights are."""
        if name.endswith("router.bias"):
            tensor.normal_(0.0, self.config.initializer_range, generator=generator)
        else:
            super().init_parameter(name, module, tensor, generator)


class GptOssForCausalLM(DecoderForCausalLM):
    body_class = GptOssModel
