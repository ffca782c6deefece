"""Swin (Liu et al., 2021) and Swin V2 (Liu et al., 2022): attention within shifted windows of a
feature map that halves its resolution and doubles its width from stage to stage.

    image [B, 3, H, W] -> P×P patches -> linear projection -> LayerNorm (+ positions)     [B, r², C]
      -> stage 1: blocks at r × r                -> patch merging                     [B, ⌈r/2⌉², 2C]
      -> stage 2: blocks at ⌈r/2⌉ × ⌈r/2⌉        -> patch merging                     [B, ⌈r/4⌉², 4C]
      -> ... -> last stage: blocks -> LayerNorm -> mean over the tokens -> classifier

    a block (the 2nd, 4th, ... of a stage with shifted windows):
      Swin     x = x + drop_path(W-MSA(LN(x)));   x = x + MLP(LN(x))
      Swin V2  x = x + drop_path(LN(W-MSA(x)));   x = x + drop_path(LN(MLP(x)))
    (transformers' Swin drops only the attention branch per sample; the paper's code drops both)

W-MSA is `layers.WindowAttention`: the map padded to multiples of the window w, rolled by w/2 in
shifted blocks, attention within each w × w window with a relative position bias (and a mask for
the pairs the roll made neighbours). A stage whose resolution is at most w uses one window of its
whole map and no shift. Patch merging concatenates each 2×2 group of tokens and reduces 4C -> 2C
(after a LayerNorm; Swin V2: before one). Swin V2 also scores by scaled cosine (a learned
temperature per head), computes the bias with a small MLP over log-spaced offsets (16·sigmoid) and
has no key bias. Both are one set of classes here: `Variant` is what tells them apart.

The blocks of all stages are one flat stack (``layers``, the contract's `layer_stack`); a stage's
patch merging is its last block's ``downsample``, so each block takes the hidden states of its own
resolution and returns the next block's input, and the stack can be cut anywhere. The image size
is the config's (each block knows its resolution); Hugging Face's `SwinConfig`/`Swinv2Config`
describe the models, whose weights load from and save to transformers' checkpoints
(`hf_maps/swin.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling, ImageClassifierOutput

from libai_zoo.layers import MLP, DropPath, LayerNorm, Linear, WindowAttention, WindowPositionBias

from .classifier import Classifier
from .hf_maps.swin import swin_weight_map
from .pretrained import PreTrainedModel

PATCH_NORM_EPS = 1e-5  # the patch embeddings' and patch merging's LayerNorms: nn.LayerNorm's default in transformers


class SwinConfig(transformers.SwinConfig):
    """Hugging Face's SwinConfig: reads a Swin config.json unchanged and writes it back."""


class Swinv2Config(transformers.Swinv2Config):
    """Hugging Face's Swinv2Config: reads a Swin V2 config.json unchanged and writes it back."""


@dataclass(frozen=True)
class Variant:
    """What tells Swin V2 from Swin, as transformers computes them."""

    #: res-post-norm: a block's norms on its branches' outputs, x + LN(branch(x)), not their inputs
    post_norm: bool = False
    #: scaled cosine attention with a learned temperature per head (`Attention(cosine=True)`)
    cosine_attention: bool = False
    #: the position bias from an MLP over log-spaced offsets, not a table (`WindowPositionBias`)
    continuous_position_bias: bool = False
    #: a k bias beside the q and v ones (qkv_bias)
    key_bias: bool = True
    #: patch merging reduces 4C -> 2C and then normalises, instead of normalising the 4C channels first
    merge_norm_after: bool = False
    #: stochastic depth on the MLP branch too (transformers' Swin drops the attention branch only)
    drop_path_mlp: bool = False
    #: the shift mask's value (transformers' Swin V2 adds its -100 mask twice)
    shift_mask_value: float = -100.0
    #: Swin V2 fits the window to a stage when it is built, by the stage's nominal resolution
    #: grid // 2^stage (not the ⌈grid / 2^stage⌉ it runs at: they differ after an odd side), and
    #: builds its bias for that window; transformers' Swin fits it in forward, by the resolution it
    #: runs at, to a bias table built for the config's window: a stage smaller than it cannot run
    window_fitted_at_build: bool = False
    #: the config's dropout on the attention branch's output
    attention_output_dropout: str = "hidden_dropout_prob"
    #: learned absolute positions can be added (use_absolute_embeddings); transformers' Swin V2 gives
    #: its table one row more than it has patches and cannot add it
    absolute_positions: bool = True


SWIN = Variant()
SWIN_V2 = Variant(post_norm=True, cosine_attention=True, continuous_position_bias=True, key_bias=False,
                  merge_norm_after=True, drop_path_mlp=True, shift_mask_value=-200.0, window_fitted_at_build=True,
                  attention_output_dropout="attention_probs_dropout_prob", absolute_positions=False)


def _side(value, name: str) -> int:
    """A square image's or patch's side from the config (an int, or a pair of equal ints)."""
    if isinstance(value, int):
        return value
    if len(value) == 2 and value[0] == value[1]:
        return int(value[0])
    raise ValueError(f"{name} = {value}: libai_zoo's Swin takes square images and patches; give one side")


@dataclass(frozen=True)
class BlockPlan:
    """Where one block sits: its stage, width, heads, resolution, window, shift, drop-path rate."""

    stage: int
    dim: int
    heads: int
    resolution: int
    window: int
    shift: int
    drop_path: float
    pretrained_window: int  # Swin V2: the window its position bias was trained at (0: its own)
    merges: bool  # ends a stage that patch merging follows


def block_plans(config: SwinConfig, variant: Variant) -> list[BlockPlan]:
    """Every block of every stage in order, from the config; refuses what transformers cannot run."""
    image, patch = _side(config.image_size, "image_size"), _side(config.patch_size, "patch_size")
    if image % patch:
        raise ValueError(f"image_size = {image} is not a multiple of patch_size = {patch}: choose sizes that tile")
    if len(config.depths) != len(config.num_heads):
        raise ValueError(f"depths {config.depths} and num_heads {config.num_heads} name different numbers of stages")
    total = sum(config.depths)
    rates = [config.drop_path_rate * i / max(total - 1, 1) for i in range(total)]  # growing with depth
    pretrained = getattr(config, "pretrained_window_sizes", None) or [0] * len(config.depths)
    plans, grid, resolution, full = [], image // patch, image // patch, config.window_size
    for stage, (depth, heads) in enumerate(zip(config.depths, config.num_heads)):
        fitted_to = grid // 2 ** stage if variant.window_fitted_at_build else resolution
        window = min(fitted_to, full)  # a stage no larger than the window is one window, unshifted
        if window < 1:
            raise ValueError(f"stage {stage} has no patches left ({grid} halved {stage} times): use fewer stages")
        if window < full and not variant.window_fitted_at_build:
            raise ValueError(f"stage {stage} runs at {resolution}×{resolution} patches, fewer than window_size = "
                             f"{full}: Swin's bias table is for {full}×{full} windows (transformers cannot run it "
                             f"either); choose a window_size of at most {resolution}, or fewer stages")
        for index in range(depth):
            shift = full // 2 if index % 2 and fitted_to > full else 0
            plans.append(BlockPlan(stage, int(config.embed_dim * 2 ** stage), heads, resolution, window, shift,
                                   rates[len(plans)], pretrained[stage],
                                   merges=stage < len(config.depths) - 1 and index == depth - 1))
        resolution = (resolution + 1) // 2
    return plans


def patches(pixel_values: torch.Tensor, patch: int) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/p)·(W/p), C·p·p]: each patch's channels and pixels, patches row-major."""
    grid = pixel_values.unflatten(2, (-1, patch)).unflatten(4, (-1, patch)).permute(0, 2, 4, 1, 3, 5)
    return grid.flatten(3).flatten(1, 2)


class SwinEmbeddings(nn.Module):
    """Patches -> linear projection -> LayerNorm (+ learned positions: use_absolute_embeddings)."""

    def __init__(self, config: SwinConfig):
        super().__init__()
        self.image_size = _side(config.image_size, "image_size")
        self.patch_size = _side(config.patch_size, "patch_size")
        self.num_channels = config.num_channels
        dim = config.embed_dim
        self.patch_projection = Linear(self.num_channels * self.patch_size ** 2, dim, parallel="data",
                                       sequence_parallel=False)
        self.norm = LayerNorm(dim, PATCH_NORM_EPS, sequence_parallel=False)
        self.position_embeddings = None
        if config.use_absolute_embeddings:
            self.position_embeddings = nn.Parameter(torch.zeros(1, (self.image_size // self.patch_size) ** 2, dim))
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        _, channels, height, width = pixel_values.shape
        if (channels, height, width) != (self.num_channels, self.image_size, self.image_size):
            raise ValueError(f"pixel_values of shape {tuple(pixel_values.shape)} do not match the config: expected "
                             f"[B, {self.num_channels}, {self.image_size}, {self.image_size}] (each block's "
                             f"resolution follows from image_size: resize the images, or build the model for theirs)")
        x = patches(pixel_values, self.patch_size).to(self.patch_projection.weight.dtype)
        x = self.norm(self.patch_projection(x))
        if self.position_embeddings is not None:
            x = x + self.position_embeddings
        return self.dropout(x)


class PatchMerging(nn.Module):
    """Each 2×2 group of tokens as one of twice the width: [B, r², C] -> [B, ⌈r/2⌉², 2C]; an odd
    side is padded with zeros. The group's tokens are concatenated as transformers orders them,
    (row, column) = (0, 0), (1, 0), (0, 1), (1, 1), then LayerNorm(4C) and a linear 4C -> 2C
    without bias (``norm_after``: the linear map, then LayerNorm(2C))."""

    def __init__(self, dim: int, resolution: int, *, norm_after: bool = False):
        super().__init__()
        self.resolution, self.norm_after = resolution, norm_after
        self.reduction = Linear(4 * dim, 2 * dim, bias=False, parallel="data", sequence_parallel=False)
        self.norm = LayerNorm(2 * dim if norm_after else 4 * dim, PATCH_NORM_EPS, sequence_parallel=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, channels = x.shape
        side = self.resolution
        x = x.view(batch, side, side, channels)
        if side % 2:
            x = F.pad(x, (0, 0, 0, 1, 0, 1))
        x = torch.cat(self.neighbours(x), dim=-1).flatten(1, 2)
        return self.norm(self.reduction(x)) if self.norm_after else self.reduction(self.norm(x))

    def neighbours(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The four tokens of every 2×2 group, each [B, r/2, r/2, C], in transformers' order."""
        return [x[:, row::2, column::2] for column in (0, 1) for row in (0, 1)]

    def extra_repr(self) -> str:
        return f"resolution={self.resolution}, norm_after={self.norm_after}"


class SwinBlock(nn.Module):
    """One block at its stage's resolution: window attention and an MLP, each a residual branch
    with its LayerNorm (on the branch's input, or with ``post_norm`` its output), dropout and
    stochastic depth; ``downsample`` is the patch merging after the last block of a stage."""

    def __init__(self, config: SwinConfig, variant: Variant, plan: BlockPlan):
        super().__init__()
        dim, eps = plan.dim, config.layer_norm_eps
        self.resolution, self.post_norm, self.drop_path_mlp = plan.resolution, variant.post_norm, variant.drop_path_mlp
        self.attn_norm = LayerNorm(dim, eps, sequence_parallel=False)
        self.attn = WindowAttention(dim, plan.heads, plan.resolution, window_size=plan.window, shift_size=plan.shift,
                                    bias=config.qkv_bias, key_bias=variant.key_bias or not config.qkv_bias,
                                    cosine=variant.cosine_attention,
                                    continuous_position_bias=variant.continuous_position_bias,
                                    pretrained_window_size=plan.pretrained_window,
                                    shift_mask_value=variant.shift_mask_value,
                                    dropout=config.attention_probs_dropout_prob)
        self.attn_dropout = nn.Dropout(getattr(config, variant.attention_output_dropout))
        self.mlp_norm = LayerNorm(dim, eps, sequence_parallel=False)
        self.mlp = MLP(dim, int(config.mlp_ratio * dim), activation=config.hidden_act, sequence_parallel=False)
        self.mlp_dropout = nn.Dropout(config.hidden_dropout_prob)
        self.drop_path = DropPath(plan.drop_path)
        self.downsample = PatchMerging(dim, plan.resolution, norm_after=variant.merge_norm_after) if plan.merges \
            else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[B, r², C] -> [B, r², C], or after patch merging [B, ⌈r/2⌉², 2C]."""
        x = hidden_states
        if self.post_norm:
            x = x + self.drop_path(self.attn_norm(self.attn_dropout(self.attn(x))))
            x = x + self.drop_path(self.mlp_norm(self.mlp_dropout(self.mlp(x))))
        else:
            x = x + self.drop_path(self.attn_dropout(self.attn(self.attn_norm(x))))
            mlp = self.mlp_dropout(self.mlp(self.mlp_norm(x)))
            x = x + (self.drop_path(mlp) if self.drop_path_mlp else mlp)
        return x if self.downsample is None else self.downsample(x)


class SwinModel(PreTrainedModel):
    """The Swin encoder with the final LayerNorm; ``pooler_output`` the mean over the tokens unless
    ``add_pooling_layer=False``."""

    config_class = SwinConfig
    base_model_prefix = "swin"
    variant: ClassVar[Variant] = SWIN

    def __init__(self, config: SwinConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        if config.use_absolute_embeddings and not self.variant.absolute_positions:
            raise ValueError(f"use_absolute_embeddings: transformers' {type(self).__name__} gives its position table "
                             f"one row more than it has patches and cannot add it; build the model without them")
        plans = block_plans(config, self.variant)
        self.embeddings = SwinEmbeddings(config)
        self.layers = nn.ModuleList(SwinBlock(config, self.variant, plan) for plan in plans)
        self.num_features = plans[-1].dim
        self.layernorm = LayerNorm(self.num_features, config.layer_norm_eps, sequence_parallel=False)
        self.add_pooling_layer = add_pooling_layer
        self.post_init()

    def init_parameter(self, name: str, module: nn.Module, tensor: torch.Tensor,
                       generator: torch.Generator | None) -> None:
        """As transformers: position embeddings and bias tables at zero, Swin V2's temperatures at
        ln 10; the rest Normal(0, initializer_range), norms at one, biases at zero."""
        if isinstance(module, SwinEmbeddings) and name.endswith("position_embeddings") \
                or isinstance(module, WindowPositionBias) and name.endswith("table"):
            tensor.zero_()
        elif name.endswith("logit_scale"):
            tensor.fill_(math.log(10.0))
        else:
            super().init_parameter(name, module, tensor, generator)

    def forward(self, pixel_values: torch.Tensor) -> BaseModelOutputWithPooling:
        x = self.embeddings(pixel_values)
        for block in self.layers:
            x = block(x)
        x = self.layernorm(x)
        return BaseModelOutputWithPooling(last_hidden_state=x,
                                          pooler_output=x.mean(1) if self.add_pooling_layer else None)

    def hf_weight_map(self):
        return swin_weight_map(self.config, self.variant, prefix="")


class Swinv2Model(SwinModel):
    """The Swin V2 encoder: Swin's, its `Variant` Swin V2's."""

    config_class = Swinv2Config
    base_model_prefix = "swinv2"
    variant = SWIN_V2


class SwinForImageClassification(PreTrainedModel, Classifier):
    """Swin with a linear classifier on the mean of the final states (transformers' pooler output);
    config.num_labels classes. The body is `body_class`, kept under its ``base_model_prefix``."""

    body_class: ClassVar[type[SwinModel]] = SwinModel
    main_input_name = "pixel_values"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _body_paths(cls)

    def __init__(self, config: SwinConfig):
        super().__init__(config)
        setattr(self, self.base_model_prefix, self.body_class(config, add_pooling_layer=False))
        self.classifier = Linear(self.body.num_features, config.num_labels, parallel="data", sequence_parallel=False)
        self.post_init()

    @property
    def body(self) -> SwinModel:
        return getattr(self, self.base_model_prefix)

    def embed(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.body.embeddings(inputs["pixel_values"])

    def layer_inputs(self, inputs: dict[str, torch.Tensor], hidden: torch.Tensor | None = None) -> dict:
        return {}

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.body.layernorm(hidden)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(hidden.mean(1))

    def layout_problems(self, *, sequence_parallel: bool, cp: int, ep: int) -> list[str]:
        """Swin splits its heads over tp, and nothing else: its windows are cut from the whole image."""
        name, problems = type(self).__name__, []
        if sequence_parallel:
            problems.append(f"{name} attends within windows of the whole feature map and merges neighbouring "
                            f"patches, so its tokens are not split over tp: set dist.sequence_parallel=false")
        if cp > 1:
            problems.append(f"{name} attends within windows, not over a sequence split over cp: set dist.cp=1")
        if ep > 1:
            problems.append(f"{name} has no Mixture-of-Experts layers to split: set dist.ep=1")
        return problems

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None,
                return_logits: bool = True) -> ImageClassifierOutput:
        """``return_logits`` is accepted for the engine's sake; the logits are small and always returned."""
        logits = self.head(self.body(pixel_values).last_hidden_state)
        return ImageClassifierOutput(loss=None if labels is None else self.loss(logits, labels), logits=logits)

    def hf_weight_map(self):
        return swin_weight_map(self.config, self.body_class.variant, prefix=f"{self.base_model_prefix}.",
                               classifier=True)


def _body_paths(cls: type[SwinForImageClassification]) -> None:
    """A classifier's config class and contract paths, from its body's class and prefix."""
    cls.config_class, cls.base_model_prefix = cls.body_class.config_class, cls.body_class.base_model_prefix
    cls.layer_stack = f"{cls.base_model_prefix}.layers"
    cls.first_stage_modules = (f"{cls.base_model_prefix}.embeddings",)
    cls.last_stage_modules = (f"{cls.base_model_prefix}.layernorm", "classifier")


_body_paths(SwinForImageClassification)


class Swinv2ForImageClassification(SwinForImageClassification):
    """Swin V2 with its classifier: Swin's, on a `Swinv2Model`."""

    body_class = Swinv2Model
