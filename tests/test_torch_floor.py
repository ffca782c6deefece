"""The torch floor in pyproject.toml is the one the code needs: CI installs exactly the torch the
README pins, the floor is that release, and every library module imports under it (an import of
an API that a newer torch added fails here, not in a user's run)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _minor(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def test_the_floor_is_the_torch_ci_installs():
    floor = re.search(r'"torch>=([\d.]+)"', (ROOT / "pyproject.toml").read_text())[1]
    setup = (ROOT / "README.md").read_text().split("```")[1]  # CI runs this block's first line
    pinned = re.search(r"torch==([\d.]+)", setup)[1]
    assert _minor(pinned) == _minor(floor), f"README installs torch {pinned}, pyproject's floor is {floor}"
    assert _minor(torch.__version__) >= _minor(floor)


def test_every_library_module_imports():
    # layers/ and models/ install as libai_zoo.layers / .models from the top of the repository (package-dir),
    # outside libai_zoo/'s folder: walk them by name.
    probe = ("import importlib, pkgutil, libai_zoo, libai_zoo.layers, libai_zoo.models\n"
             "names = [m.name for package in (libai_zoo, libai_zoo.layers, libai_zoo.models)\n"
             "         for m in pkgutil.walk_packages(package.__path__, package.__name__ + '.')]\n"
             "for name in names:\n"
             "    importlib.import_module(name)\n"
             "print(len(names))\n")
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT / "tests", capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert int(run.stdout) > 100  # every module of every subpackage, layers and models included
