"""The tests' recipes: real config files under tests/support/configs/ (linted like any other
Python), each test's own values (paths, sizes) given as overrides, as a user runs
``tools/train.py CONFIG.py key=value ...``.

    cfg = recipe("tiny_gpt2.py", f"dataloader.train.text_file={text}")    # a loaded, overridden DictConfig
    path = saved_recipe(tmp / "config.yaml", "tiny_gpt2.py", ...)          # the same, on disk for a subprocess
    argv = [str(config_path("recorded_gpt2.py")), *overrides]              # or the file and its overrides
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from libai_zoo.config import LazyConfig

CONFIGS = Path(__file__).resolve().parent / "configs"


def config_path(name: str) -> Path:
    """The config file ``tests/support/configs/<name>``."""
    path = CONFIGS / name
    if not path.is_file():
        raise FileNotFoundError(f"no test config {name!r} in {CONFIGS}")
    return path


def recipe(name: str | Path, *overrides: str) -> DictConfig:
    """The config file (a name under tests/support/configs/, or a path) loaded with `overrides` applied."""
    path = Path(name) if Path(name).is_absolute() else config_path(str(name))
    return LazyConfig.apply_overrides(LazyConfig.load(path), overrides)


def saved_recipe(path: Path, name: str | Path, *overrides: str) -> Path:
    """`recipe` written to `path` (a .yaml) with LazyConfig.save, for a run that reads a file; returns `path`.
    Interpolations are written resolved, so a recipe that refers to train.output_dir is passed as
    its file plus overrides instead."""
    LazyConfig.save(recipe(name, *overrides), path)
    return path
