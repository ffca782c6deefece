"""Run a ``.py`` config file, with relative imports of other config files by their place on disk.

Config directories are not packages, yet a config builds on its neighbours::

    from .base import train                  # base.py beside this file
    from ..common.optim import optim         # common/optim.py one directory up
    from . import base                       # the file as a module

Each file runs with its own ``__import__`` (in its globals' ``__builtins__``), so Python's import
system and other threads are untouched: a relative import (level > 0) runs the named file with the
same loader, and an absolute one (``import torch``) is an ordinary import. Within one load each file
runs once and importers share its values, as modules do; its top-level dicts become DictConfigs, so
an importer can write ``train.max_iter = 10``.
"""

from __future__ import annotations

import builtins
import types
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from .instantiate import OBJECT_FLAGS


class ConfigFileLoader:
    """Runs config files; one instance per `LazyConfig.load`, so every load starts fresh."""

    def __init__(self) -> None:
        self._done: dict[Path, types.ModuleType] = {}
        self._running: list[Path] = []

    def run(self, path: Path) -> types.ModuleType:
        """Execute the file (once per loader) and return it as a module object."""
        path = path.resolve()
        if path in self._done:
            return self._done[path]
        if path in self._running:
            chain = " -> ".join(str(p) for p in [*self._running[self._running.index(path):], path])
            raise ImportError(f"config files import each other in a circle: {chain}")
        module = types.ModuleType(f"libai_zoo_config_file.{path.stem}", f"config file {path}")
        module.__file__ = str(path)
        own_builtins = dict(vars(builtins))
        own_builtins["__import__"] = self._import
        module.__dict__["__builtins__"] = own_builtins
        self._running.append(path)
        try:
            exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
        finally:
            self._running.pop()
        for name, value in list(vars(module).items()):  # so an importer can write `train.max_iter = 10`
            if isinstance(value, dict) and not name.startswith("_"):
                setattr(module, name, OmegaConf.create(value, flags=OBJECT_FLAGS))
        self._done[path] = module
        return module

    def _import(self, name: str, globals: dict[str, Any] | None = None, locals: Any = None,
                fromlist: tuple[str, ...] | None = (), level: int = 0) -> Any:
        if level == 0 or not globals or "__file__" not in globals:
            return builtins.__import__(name, globals, locals, fromlist, level)
        importer = Path(globals["__file__"])
        statement = f"from {'.' * level}{name} import {', '.join(fromlist or ())}"
        base = importer.parent
        for _ in range(level - 1):
            base = base.parent
        location = base.joinpath(*name.split("."))
        module = self._module_at(location, importer, statement) if name else _Directory(base)
        for attr in fromlist or ():
            if attr == "*" or hasattr(module, attr):
                continue
            if isinstance(module, _Directory):  # `from . import base`: a file of the directory
                setattr(module, attr, self._module_at(location / attr, importer, statement))
            else:
                public = sorted(k for k in vars(module) if not k.startswith("_"))
                raise ImportError(f"{importer}: `{statement}`: {module.__file__} defines no {attr!r} "
                                  f"(it defines {', '.join(public) or 'nothing'})", name=name, path=module.__file__)
        return module

    def _module_at(self, location: Path, importer: Path, statement: str) -> types.ModuleType:
        """The config file ``location``.py, or the directory ``location`` as a namespace."""
        file = location.with_name(location.name + ".py")
        if file.is_file():
            return self.run(file)
        if location.is_dir():
            return _Directory(location)
        raise ModuleNotFoundError(f"{importer}: `{statement}` looks for the config file {file} (or a directory "
                                  f"{location}), which does not exist", name=location.name)


class _Directory(types.ModuleType):
    """A directory named in a relative import; its files are loaded as they are imported."""

    def __init__(self, path: Path):
        super().__init__(path.name, f"config directory {path}")
        self.__file__ = str(path)
