"""Configs are Python: recipes that say what to build, edited as data, saved beside every run.

    from libai_zoo.config import LazyCall, LazyConfig, get_config, instantiate

    cfg = LazyConfig.load("my_config.py")                   # or a saved config.yaml
    LazyConfig.apply_overrides(cfg, ["train.max_iter=100"]) # command-line key=value items
    model = instantiate(cfg.model)                           # LazyCall recipes become objects
    LazyConfig.save(cfg, "output/config.yaml")

A config file is plain Python; its module-level config values are the keys. Defaults every recipe
builds on ship in ``libai_zoo/config/common/`` and load with ``get_config("common/train.py")``; their
keys, types and defaults are the dataclasses of `schema` (``train``, ``dist``, ``dataloader``, ``optim``).
`run_settings(cfg)` parses what a run's config means (sequence length, AMP dtype, pipeline, ...) for
the trainer and the planner alike.
"""

from .instantiate import ConfigError, LazyCall, instantiate
from .lazy_config import LazyConfig, get_config
from .schema import AdamWConfig, DataLoaderConfig, DistConfig, PipelineConfig, Section, TrainConfig, typed
from .settings import (
    AMP_DTYPES,
    FLOAT8_RECIPES,
    FULL,
    RECOMPUTE_MODULES,
    Float8,
    PipelineSettings,
    Recompute,
    RunSettings,
    run_settings,
)

__all__ = ["AMP_DTYPES", "AdamWConfig", "ConfigError", "DataLoaderConfig", "DistConfig", "FLOAT8_RECIPES", "FULL",
           "Float8", "LazyCall", "LazyConfig", "PipelineConfig", "PipelineSettings", "RECOMPUTE_MODULES", "Recompute",
           "RunSettings", "Section", "TrainConfig", "get_config", "instantiate", "run_settings", "typed"]
