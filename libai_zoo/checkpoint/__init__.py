"""libai_zoo.checkpoint: Hugging Face weight files, the trainer's resumable checkpoints, and
exporting those to Hugging Face directories."""

from .checkpointer import Checkpointer
from .convert import hf_to_zoo, resolve_checkpoint, zoo_to_hf
from .describe import describe
from .export import export_to_hf, load_checkpoint_model
from .hf_reader import HFWeightReader
from .megatron import megatron_to_hf

__all__ = ["HFWeightReader", "Checkpointer", "export_to_hf", "load_checkpoint_model", "hf_to_zoo", "zoo_to_hf",
           "resolve_checkpoint", "megatron_to_hf", "describe"]
