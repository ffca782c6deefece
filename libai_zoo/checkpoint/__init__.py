"""libai_zoo.checkpoint: reading and writing model weights in Hugging Face's file layout."""

from .hf_reader import HFWeightReader

__all__ = ["HFWeightReader"]
