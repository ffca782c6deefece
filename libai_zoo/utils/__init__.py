"""libai_zoo.utils: FLOPs and MFU accounting, logging setup, random-number state."""

from .flops import mfu, peak_flops, training_flops_per_token
from .logging import setup_logging
from .memory import gradient_bytes, optimizer_state_bytes, parameter_bytes
from .rng import rng_state, seed_all, set_rng_state

__all__ = ["training_flops_per_token", "peak_flops", "mfu", "setup_logging", "seed_all", "rng_state",
           "set_rng_state",
           "parameter_bytes", "gradient_bytes", "optimizer_state_bytes"]
