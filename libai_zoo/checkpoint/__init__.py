"""libai_zoo.checkpoint: Hugging Face weight files, the trainer's resumable checkpoints, and
exporting those to Hugging Face directories."""

from .checkpointer import Checkpointer
from .export import export_to_hf, load_checkpoint_model
from .hf_reader import HFWeightReader

__all__ = ["HFWeightReader", "Checkpointer", "export_to_hf", "load_checkpoint_model"]
