"""Config files in and out: load ``.py``/``.yaml``, override from the command line, save as YAML.

    cfg = LazyConfig.load("projects/gpt2/configs/pretrain.py")
    LazyConfig.apply_overrides(cfg, ["train.max_iter=100", "dist.tp=2", "+note=smoke"])
    LazyConfig.save(cfg, "output/config.yaml")      # loads back equal: LazyConfig.load("...yaml")
    train = get_config("common/train.py").train    # a default shipped inside libai_zoo (schema.TrainConfig)

The config of a ``.py`` file is its module-level names that hold config values: DictConfigs,
ListConfigs, schema sections, dicts, lists, tuples, strings, numbers, booleans and None. Modules, functions and
classes it imports or defines are code, not keys, and so is any name that starts with ``_``.
"""

from __future__ import annotations

import difflib
import re
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from omegaconf import Container, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .instantiate import OBJECT_FLAGS, TARGET, TUPLE_TYPES, ConfigError, dotted_name
from .python_file import ConfigFileLoader
from .schema import Section, added_key_error, error_text, typed

_CONFIG_VALUE_TYPES = (Container, Section, dict, list, tuple, str, int, float, bool, type(None))
_PACKAGED_ROOT = Path(__file__).resolve().parent


class LazyConfig:
    """Load, override and save configs; every method is static."""

    @staticmethod
    def load(path: str | Path, keys: Iterable[str] | str | None = None) -> DictConfig:
        """The config in a ``.py`` or ``.yaml`` file, as a DictConfig that may hold objects.

        A ``.py`` file runs as Python and may import other config files relatively
        (``from ..common.optim import optim``), resolved on disk beside it; see `python_file`.
        The schema's sections (``train``, ``dist``, ``dataloader``) come out typed (`schema.typed`):
        every key there, missing ones at their defaults (so a config.yaml of an earlier run loads),
        values checked against their types.
        ``keys`` keeps only those top-level keys (one name or several).
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        if path.suffix == ".py":
            content = _config_values(ConfigFileLoader().run(path))
        elif path.suffix in (".yaml", ".yml"):
            content = OmegaConf.load(path)
            if not isinstance(content, DictConfig):
                raise ConfigError(f"{path} holds a YAML {type(content).__name__}; a config file is a mapping "
                                  "of top-level keys")
        else:
            raise ConfigError(f"{path}: a config file ends in .py, .yaml or .yml")
        try:
            cfg = typed(OmegaConf.create(content, flags=OBJECT_FLAGS), str(path))
        except OmegaConfBaseException as error:  # a recipe gave a typed key a value of another type
            raise ConfigError(f"{path}: {error_text(error)}") from error
        if keys is None:
            return cfg
        keys = [keys] if isinstance(keys, str) else list(keys)
        unknown = [key for key in keys if key not in cfg.keys()]
        if unknown:
            raise ConfigError(f"{path} has no top-level key {', '.join(unknown)}; "
                              f"its keys are {', '.join(map(str, cfg.keys())) or 'none'}")
        return OmegaConf.create({key: cfg[key] for key in keys}, flags=OBJECT_FLAGS)

    @staticmethod
    def save(cfg: DictConfig, path: str | Path) -> None:
        """Write the config as YAML that `load` reads back equal (see `to_container`).

        Interpolations are written resolved and ``_target_`` callables as dotted names. A value
        YAML cannot hold (a lambda, a tensor, a built model, a class outside ``_target_``) raises
        `ConfigError` naming its key rather than writing a file that would not load the same:
        save the config before filling such values in.
        """
        text = LazyConfig.to_yaml(cfg)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    @staticmethod
    def to_yaml(cfg: DictConfig) -> str:
        """The YAML text `save` writes."""
        return OmegaConf.to_yaml(OmegaConf.create(LazyConfig.to_container(cfg)))

    @staticmethod
    def to_container(cfg: Any) -> Any:
        """The config as plain dicts and lists: resolved, ``_target_`` callables as dotted names.

        This is what `save` writes, so ``to_container(load(saved)) == to_container(cfg)``.
        """
        return _plain(cfg, "")

    @staticmethod
    def apply_overrides(cfg: DictConfig, overrides: Iterable[str]) -> DictConfig:
        """Set ``key.path=value`` items in place and return ``cfg``.

        Values are read as YAML (``100`` int, ``1e-3`` float, ``true`` bool, ``[1,2]`` list,
        ``null`` None, ``'100'`` a string; an empty value is the empty string). The key must exist:
        a typo fails with the closest keys; ``+key.path=value`` adds a new key, except under a schema
        section (``train``, ``dist``, ``dataloader``), which has only its own keys.
        """
        for item in overrides:
            key, sep, text = item.partition("=")
            key = key.strip()
            if not sep or key in ("", "+"):
                raise ConfigError(f"override {item!r} is not key=value (e.g. train.max_iter=100)")
            add = key.startswith("+")
            key = key.lstrip("+")
            value = _parse_value(text, item)
            exists = _has_key(cfg, key)
            if add and exists:
                raise ConfigError(f"+{key} adds a key, but {key} already exists: drop the + to change it")
            if not add and not exists:
                raise ConfigError(_unknown_key_message(cfg, key, text))
            refusal = added_key_error(key) if add else None
            if refusal:
                raise ConfigError(refusal)
            try:
                OmegaConf.update(cfg, key, value, merge=False, force_add=add)
            except OmegaConfBaseException as error:  # a value the key's type does not take
                raise ConfigError(f"override {item!r}: {error_text(error)}") from error
        return cfg


def get_config(name: str) -> types.SimpleNamespace:
    """A default config file shipped inside libai_zoo, as a recipe edits it:
    ``get_config("common/train.py").train`` is a `schema.TrainConfig`.

    A fresh copy on every call, so editing it never changes the next one.
    """
    available = packaged_config_files()
    if name not in available:
        raise FileNotFoundError(f"no packaged config {name!r}; available: {', '.join(available)}")
    return types.SimpleNamespace(**_config_values(ConfigFileLoader().run(_PACKAGED_ROOT / name)))


def _config_values(module: types.ModuleType) -> dict[str, Any]:
    """A config file's keys: its module-level names that hold config values (not modules, functions,
    classes or _names)."""
    return {name: value for name, value in vars(module).items()
            if not name.startswith("_") and isinstance(value, _CONFIG_VALUE_TYPES)}


def packaged_config_files() -> list[str]:
    """Names `get_config` accepts: the .py config files in the subdirectories of libai_zoo/config/."""
    return sorted(p.relative_to(_PACKAGED_ROOT).as_posix() for p in _PACKAGED_ROOT.glob("*/**/*.py")
                  if p.name != "__init__.py" and "__pycache__" not in p.parts)


# ---------------------------------------------------------------------------------------- saving
def _plain(value: Any, path: str) -> Any:
    if isinstance(value, DictConfig):
        return {key: _plain_item(value, key, path) for key in value.keys()}
    if isinstance(value, dict):
        return {key: _plain(v, _join(path, key)) for key, v in value.items()}
    if isinstance(value, (*TUPLE_TYPES, Container, list)):
        return [_plain(v, _join(path, i)) for i, v in enumerate(value)]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    kind = "a class or function" if callable(value) else f"a {type(value).__module__}.{type(value).__qualname__}"
    raise ConfigError(f"{path or 'the config'} holds {kind}, which YAML cannot represent: "
                      "only _target_ may hold a callable (use LazyCall, or a dotted name string); "
                      "other values must be plain data (save the config before filling in objects)")


def _plain_item(cfg: DictConfig, key: Any, path: str) -> Any:
    where = _join(path, key)
    if OmegaConf.is_missing(cfg, key):
        return "???"
    value = cfg[key]
    if key == TARGET and callable(value):
        try:
            return dotted_name(value)
        except ConfigError as error:
            raise ConfigError(f"{where} cannot be saved: {error}") from error
    return _plain(value, where)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


# -------------------------------------------------------------------------------------- overrides
class _ValueLoader(yaml.SafeLoader):
    """YAML 1.1 as PyYAML reads it, plus floats without a dot (1e-3), as people write them."""


_ValueLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def _parse_value(text: str, item: str) -> Any:
    if not text.strip():
        return ""
    try:
        return yaml.load(text, Loader=_ValueLoader)
    except yaml.YAMLError as error:
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({error}); "
                          "quote a string that contains YAML syntax: key='...'") from error


def _has_key(cfg: Any, key: str) -> bool:
    """Whether the dotted `key` names a node (a missing ``???`` value or an interpolation included),
    walked node by node: nothing is resolved or copied."""
    node = cfg
    for part in key.split("."):
        if isinstance(node, DictConfig) and not (node._is_none() or node._is_missing() or node._is_interpolation()):
            node = node._get_node(part, validate_access=False, throw_on_missing_key=False)
        elif isinstance(node, ListConfig) and part.isdigit() and int(part) < len(node):
            node = node._get_node(int(part))
        else:
            return False
        if node is None:
            return False
    return True


def _key_paths(node: Any, prefix: str = "") -> list[str]:
    """Every dotted path into nested mappings (list items are not enumerated)."""
    paths = []
    if isinstance(node, dict):
        for key, value in node.items():
            path = _join(prefix, key)
            paths.append(path)
            paths.extend(_key_paths(value, path))
    return paths


def _unknown_key_message(cfg: DictConfig, key: str, text: str) -> str:
    paths = _key_paths(OmegaConf.to_container(cfg, resolve=False))
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [p for p in paths if p.rsplit(".", 1)[-1] == leaf]
    close = difflib.get_close_matches(key, paths, n=3, cutoff=0.6)
    if close:  # only those about as close as the closest, not every path that shares a prefix
        best = difflib.SequenceMatcher(None, key, close[0]).ratio()
        close = [p for p in close if difflib.SequenceMatcher(None, key, p).ratio() >= best - 0.05]
    suggestions = list(dict.fromkeys(same_leaf + close))[:3]
    hint = (f"did you mean {' or '.join(suggestions)}?" if suggestions
            else f"its top-level keys are {', '.join(map(str, cfg.keys()))}")
    add = "" if added_key_error(key) else f" (to add a new key, write +{key}={text})"  # not in a section
    return f"{key} is not a key of this config; {hint}{add}"
