"""libai_zoo.checkpoint: Hugging Face weight files, and the trainer's resumable checkpoints."""

from .checkpointer import Checkpointer
from .hf_reader import HFWeightReader

__all__ = ["HFWeightReader", "Checkpointer"]
