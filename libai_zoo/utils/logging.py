"""Logging of a training run: one format, rank 0 to the console, every rank to its own file."""

from __future__ import annotations

import logging
import sys
from pathlib import Path


def setup_logging(output_dir: str | Path | None, rank: int = 0, name: str = "libai_zoo") -> logging.Logger:
    """Configure the `name` logger: INFO to stdout on rank 0 only, and to output_dir/log.txt
    (rank 0) or log.txt.rank{r} (others) when output_dir is given. Idempotent."""
    logger = logging.getLogger(name)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    formatter = logging.Formatter("[%(asctime)s %(name)s] %(message)s", datefmt="%m/%d %H:%M:%S")
    if rank == 0:
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(formatter)
        logger.addHandler(console)
    if output_dir is not None:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        file = Path(output_dir) / ("log.txt" if rank == 0 else f"log.txt.rank{rank}")
        handler = logging.FileHandler(file)
        handler.setFormatter(formatter)
        logger.addHandler(handler)
    return logger
