"""libai_zoo: a PyTorch-native, Hugging Face-compatible model zoo on drop-in parallel layers."""

from . import distributed

__version__ = "0.1.0"
__all__ = ["distributed", "__version__"]
