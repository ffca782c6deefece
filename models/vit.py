"""ViT (Dosovitskiy et al., 2021): an image is a sequence of patches fed to a pre-norm encoder.

    image [B, C, H, W] -> P×P patches -> linear projection -> [CLS] + patches + positions
        -> L × [x + attn(LN(x)); x + mlp(LN(x))] -> LayerNorm -> classifier on [CLS]

The patch projection is the paper's linear map of each flattened patch (Hugging Face stores it
as a stride-P convolution; the map reshapes its kernel). Hugging Face's `ViTConfig` describes
the model; weights load from and save to Hugging Face ViT checkpoints (`hf_maps/vit.py`).
"""

from __future__ import annotations

import torch
import transformers
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling, ImageClassifierOutput

from libai_zoo.layers import (
    AttentionSpec,
    LayerNorm,
    LayerSpec,
    Linear,
    MLPSpec,
    SequenceGather,
    SequenceScatter,
    TransformerLayer,
)
from libai_zoo.layers.mlp import ACTIVATIONS

from .classifier import Classifier
from .hf_maps.vit import vit_weight_map
from .pretrained import PreTrainedModel


class ViTConfig(transformers.ViTConfig):
    """Hugging Face's ViTConfig: reads a ViT config.json unchanged and writes it back."""


class ViTEmbeddings(nn.Module):
    """Patches -> linear projection, a learned [CLS] token in front, learned positions added."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        hidden, patch, channels = config.hidden_size, config.patch_size, config.num_channels
        self.image_size, self.patch_size, self.num_channels = config.image_size, patch, channels
        num_patches = (config.image_size // patch) ** 2
        self.patch_projection = Linear(channels * patch * patch, hidden, parallel="data", sequence_parallel=False)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, hidden))
        self.position_embeddings = nn.Parameter(torch.zeros(1, num_patches + 1, hidden))
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = pixel_values.shape
        if (channels, height, width) != (self.num_channels, self.image_size, self.image_size):
            raise ValueError(f"pixel_values of shape {tuple(pixel_values.shape)} do not match the config: "
                             f"expected [B, {self.num_channels}, {self.image_size}, {self.image_size}]")
        p = self.patch_size
        # [B, C, H, W] -> [B, H/p, W/p, C, p, p] -> [B, patches, C·p·p], patches in row-major order
        patches = pixel_values.unflatten(2, (-1, p)).unflatten(4, (-1, p)).permute(0, 2, 4, 1, 3, 5)
        x = self.patch_projection(patches.flatten(3).flatten(1, 2).to(self.patch_projection.weight.dtype))
        x = torch.cat([self.cls_token.expand(batch, -1, -1), x], dim=1)
        return self.dropout(x + self.position_embeddings)


class ViTModel(PreTrainedModel):
    """The ViT encoder with the final LayerNorm, and the pooler unless ``add_pooling_layer=False``."""

    config_class = ViTConfig
    base_model_prefix = "vit"

    def __init__(self, config: ViTConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        hidden = config.hidden_size
        self.embeddings = ViTEmbeddings(config)
        self.scatter = SequenceScatter()
        attention = AttentionSpec(config.num_attention_heads, bias=config.qkv_bias, out_bias=True,
                                  dropout=config.attention_probs_dropout_prob)
        layer = LayerSpec(hidden, attention, MLPSpec(config.intermediate_size, activation=config.hidden_act),
                          norm_eps=config.layer_norm_eps, hidden_dropout=config.hidden_dropout_prob)
        self.layer = nn.ModuleList(TransformerLayer(layer) for _ in range(config.num_hidden_layers))
        self.gather = SequenceGather()
        self.layernorm = LayerNorm(hidden, config.layer_norm_eps, sequence_parallel=False)
        self.pooler = None
        if add_pooling_layer:
            self.pooler = Linear(hidden, getattr(config, "pooler_output_size", None) or hidden, parallel="data",
                                 sequence_parallel=False)
            self.pooler_act = ACTIVATIONS[getattr(config, "pooler_act", "tanh")]
        self.post_init()

    def init_parameter(self, name: str, module: nn.Module, tensor: torch.Tensor,
                       generator: torch.Generator | None) -> None:
        """The class token and position embeddings from a truncated normal, as transformers' ViT."""
        if isinstance(module, ViTEmbeddings) and not name.endswith("bias"):
            nn.init.trunc_normal_(tensor, std=self.config.initializer_range, generator=generator)
        else:
            super().init_parameter(name, module, tensor, generator)

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Patch embeddings; this rank's part of the sequence under SP."""
        return self.scatter(self.embeddings(pixel_values))

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The whole sequence again under SP, then the final LayerNorm."""
        return self.layernorm(self.gather(x))

    def forward(self, pixel_values: torch.Tensor) -> BaseModelOutputWithPooling:
        x = self.embed(pixel_values)
        for layer in self.layer:
            x = layer(x)
        x = self.final_norm(x)
        pooled = self.pooler_act(self.pooler(x[:, 0])) if self.pooler is not None else None
        return BaseModelOutputWithPooling(last_hidden_state=x, pooler_output=pooled)

    def hf_weight_map(self):
        return vit_weight_map(self.config, prefix="", pooler=self.pooler is not None)


class ViTForImageClassification(PreTrainedModel, Classifier):
    """ViT with a linear classifier on the final [CLS] state; config.num_labels classes."""

    config_class = ViTConfig
    base_model_prefix = "vit"
    main_input_name = "pixel_values"
    layer_stack = "vit.layer"
    first_stage_modules = ("vit.embeddings",)
    last_stage_modules = ("vit.layernorm", "classifier")

    def __init__(self, config: ViTConfig):
        super().__init__(config)
        self.vit = ViTModel(config, add_pooling_layer=False)
        self.classifier = Linear(config.hidden_size, config.num_labels, parallel="data", sequence_parallel=False)
        self.post_init()

    def embed(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.vit.embed(inputs["pixel_values"])

    def layer_inputs(self, inputs: dict[str, torch.Tensor], hidden: torch.Tensor | None = None) -> dict:
        return {}

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.vit.final_norm(hidden)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(hidden[:, 0])

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None,
                return_logits: bool = True) -> ImageClassifierOutput:
        """``return_logits`` is accepted for the engine's sake; the logits are small and always returned."""
        logits = self.head(self.vit(pixel_values).last_hidden_state)
        return ImageClassifierOutput(loss=None if labels is None else self.loss(logits, labels), logits=logits)

    def hf_weight_map(self):
        return vit_weight_map(self.config, prefix="vit.", pooler=False, classifier=True)
