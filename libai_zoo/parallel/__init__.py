"""libai_zoo.parallel: how a model is wrapped for training (activation checkpointing; ZeRO and
pipeline stages come here too)."""

from .activation_checkpoint import apply_activation_checkpointing

__all__ = ["apply_activation_checkpointing"]
