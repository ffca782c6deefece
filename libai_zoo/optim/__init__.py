"""libai_zoo.optim: parameter groups, LAMB, and the learning-rate schedules of the trainer."""

from .clip_grad import clip_grad_norm_
from .configured import ConfiguredSettings
from .lamb import Lamb
from .local_shards import local_shards
from .lr_schedulers import ConstantLR, WarmupCosineLR, WarmupLinearLR
from .param_groups import build_optimizer, param_groups, unique_parameters

__all__ = ["build_optimizer", "param_groups", "unique_parameters", "clip_grad_norm_", "Lamb", "local_shards", "WarmupCosineLR",
           "WarmupLinearLR", "ConstantLR", "ConfiguredSettings"]
