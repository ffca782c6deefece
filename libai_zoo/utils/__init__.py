"""libai_zoo.utils: MFU accounting, logging setup, random-number state, state bytes per rank."""

from .flops import mfu, peak_flops
from .logging import setup_logging
from .memory import TensorMemoryPeak, gradient_bytes, local_bytes, optimizer_state_bytes, parameter_bytes
from .rng import rng_state, seed_all, set_rng_state

__all__ = ["peak_flops", "mfu", "setup_logging", "seed_all", "rng_state", "set_rng_state", "parameter_bytes",
           "gradient_bytes", "optimizer_state_bytes", "local_bytes", "TensorMemoryPeak"]
