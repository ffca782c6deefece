"""Recipes and the objects they make: `LazyCall` writes a recipe, `instantiate` follows it.

    layer = LazyCall(torch.nn.Linear)(in_features=4, out_features=2)   # a DictConfig, nothing built
    layer.out_features = 8                                             # edit it like any config
    instantiate(layer)                                                 # Linear(4, 8)

A recipe is any mapping with a ``_target_`` key: the callable, or its dotted ``"module.qualname"``
name (what a recipe becomes after a YAML round trip, and how a config names code that may not be
importable yet). Its other keys are the keyword arguments, built first, so recipes nest.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

import omegaconf
from omegaconf import Container, DictConfig, OmegaConf

from libai_zoo.utils.transformers_versions import is_dataclass_type

TARGET = "_target_"
# The config flag that lets a node hold any Python object (a callable, a built model).
OBJECT_FLAGS = {"allow_objects": True}
# omegaconf 2.4 keeps tuples as TupleConfig; 2.3 turns them into ListConfig.
TUPLE_TYPES: tuple[type, ...] = (tuple, omegaconf.TupleConfig) if hasattr(omegaconf, "TupleConfig") else (tuple,)


class ConfigError(ValueError):
    """A config that cannot be loaded, overridden, built or saved, or that the run's files do not
    fit (a checkpoint of another model in train.output_dir); the message names the key and the fix,
    so `tools/train.py` prints it as one line."""


class LazyCall:
    """``LazyCall(target)(**kwargs)`` records a call as a config instead of making it.

    ``target`` is a callable or the dotted ``"module.qualname"`` name of one; a name is imported
    only by `instantiate`, so a config can refer to code that is not importable yet.
    """

    def __init__(self, target: Callable[..., Any] | str):
        if isinstance(target, str):
            if "." not in target.strip("."):
                raise ConfigError(f"LazyCall target {target!r} is a string but not a dotted 'module.qualname' "
                                  "name: write e.g. LazyCall('torch.nn.Linear') or pass the callable itself")
        elif not callable(target):
            raise ConfigError(f"LazyCall target must be a callable or a dotted name, got {type(target).__name__}")
        self.target = target

    def __call__(self, *args: Any, **kwargs: Any) -> DictConfig:
        if args:
            raise ConfigError(f"LazyCall({target_name(self.target)}) takes keyword arguments only, so that every "
                              "argument is a named config key that can be overridden")
        if TARGET in kwargs:
            raise ConfigError(f"LazyCall({target_name(self.target)}) got a {TARGET} keyword argument: the target "
                              "is given to LazyCall itself")
        # omegaconf reads a dataclass type as a structured-config schema (transformers 5 configs are
        # dataclasses), so such a target is stored by its dotted name.
        target = dotted_name(self.target) if is_dataclass_type(self.target) \
            else self.target
        return OmegaConf.create({TARGET: target, **kwargs}, flags=OBJECT_FLAGS)

    def __repr__(self) -> str:
        return f"LazyCall({target_name(self.target)})"


def instantiate(cfg: Any) -> Any:
    """Build every recipe in ``cfg``, innermost first, and return the result.

    A mapping with ``_target_`` becomes ``target(**built_kwargs)``; the callee gets plain
    dicts/lists/tuples, never omegaconf containers. A DictConfig without ``_target_`` stays a
    DictConfig (so ``built.model`` still works) with its values built (a built dict or list in it
    becomes a DictConfig or ListConfig, as omegaconf stores them); other mappings and
    sequences become dicts, lists and tuples of built values; anything else is returned as is.
    A failing call raises `ConfigError` naming the key path and the target, chained from the
    original exception.
    """
    return _build(cfg, _config_path(cfg), plain=False)


def _build(cfg: Any, path: str, plain: bool) -> Any:
    """``plain``: make DictConfigs dicts too (for a callee's arguments)."""
    if isinstance(cfg, Mapping):
        is_call = TARGET in cfg.keys()
        values = {key: _build(value, _join(path, key), plain or is_call) for key, value in _items(cfg, path)}
        if not is_call:
            return values if plain or not isinstance(cfg, DictConfig) else OmegaConf.create(values, flags=OBJECT_FLAGS)
        target = values.pop(TARGET)
        func = locate(target, path) if isinstance(target, str) else target
        if not callable(func):
            raise ConfigError(f"cannot instantiate {_where(path)}: {TARGET} is a {type(func).__name__}, "
                              "not a callable or a dotted 'module.qualname' name")
        try:
            return func(**values)
        except Exception as error:
            raise ConfigError(f"while instantiating {_where(path)} ({target_name(target)}): "
                              f"{type(error).__name__}: {error}") from error
    if isinstance(cfg, TUPLE_TYPES):
        return tuple(_build(value, _join(path, i), plain) for i, value in enumerate(cfg))
    if isinstance(cfg, Container | list):  # ListConfig or list (a DictConfig is a Mapping)
        return [_build(value, _join(path, i), plain) for i, value in enumerate(cfg)]
    return cfg


def _items(cfg: Mapping, path: str):
    """Key/value pairs with interpolations resolved; a ``???`` value is an error naming its key."""
    for key in cfg.keys():
        if isinstance(cfg, DictConfig) and OmegaConf.is_missing(cfg, key):
            raise ConfigError(f"cannot instantiate {_where(path)}: {_join(path, key)} is ??? (missing); "
                              "set it before instantiating")
        yield key, cfg[key]


def locate(name: str, path: str = "") -> Any:
    """The object a dotted ``"module.qualname"`` name refers to, importing modules as needed."""
    at = f"{path}: " if path else ""
    parts = name.split(".")
    if not all(parts):
        raise ConfigError(f"{at}{TARGET} {name!r} is not a dotted 'module.qualname' name")
    try:
        obj = importlib.import_module(parts[0])
    except ModuleNotFoundError as error:
        if error.name != parts[0]:
            raise
        raise ConfigError(f"{at}{TARGET} {name!r} cannot be found: no module named "
                          f"{parts[0]!r}") from error
    for i, part in enumerate(parts[1:], start=1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        prefix = ".".join(parts[:i])
        if hasattr(obj, "__path__"):  # a package: the name may be a submodule not imported yet
            module = f"{prefix}.{part}"
            try:
                obj = importlib.import_module(module)
                continue
            except ModuleNotFoundError as error:
                if error.name != module:  # the module exists but one of its own imports failed
                    raise
        raise ConfigError(f"{at}{TARGET} {name!r} cannot be found: {prefix} has no attribute {part!r}")
    return obj


def dotted_name(obj: Any) -> str:
    """The ``"module.qualname"`` name that `locate` turns back into ``obj``; ConfigError if none does.
    A class's classmethod (``LlamaForCausalLM.from_pretrained``) is named through its class."""
    if inspect.ismethod(obj) and isinstance(obj.__self__, type):
        name = f"{dotted_name(obj.__self__)}.{obj.__name__}"
        if locate(name) != obj:  # a bound method is made anew at each lookup: equal, not identical
            raise ConfigError(f"{obj!r}: its name {name!r} refers to a different object")
        return name
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qualname or "<" in qualname:  # <lambda>, <locals>
        raise ConfigError(f"{obj!r} has no importable dotted name (a lambda, a local function, a bound "
                          "method or an instance); define it at module level or give its name as a string")
    name = f"{module}.{qualname}"
    try:
        found = locate(name)
    except (ConfigError, ImportError) as error:
        raise ConfigError(f"{obj!r}: its name {name!r} cannot be imported back") from error
    if found is not obj:
        raise ConfigError(f"{obj!r}: its name {name!r} refers to a different object")
    return name


def target_name(target: Any) -> str:
    """A readable name for a target, for messages: the dotted name when it has one."""
    if isinstance(target, str):
        return target
    module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else repr(target)


def _config_path(cfg: Any) -> str:
    """Where a sub-config sits in its root config ("optim.params"), so messages name the key."""
    if not isinstance(cfg, Container):
        return ""
    try:
        key = cfg._get_full_key(None)  # omegaconf has no public spelling of this
    except Exception:
        return ""
    return re.sub(r"\[(\w+)\]", r".\1", str(key or "")).strip(".")


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _where(path: str) -> str:
    return path or "the config root"
