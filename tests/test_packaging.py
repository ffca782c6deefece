"""A non-editable install puts layers/ and models/ inside the libai_zoo namespace only."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.system
def test_wheel_installs_only_the_libai_zoo_package(tmp_path):
    source = tmp_path / "src"  # build from a copy: setuptools writes build/ into the source tree
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), str(source)],
                   check=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("libai_zoo-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names}
    assert top_level == {"libai_zoo", next(t for t in top_level if t.endswith(".dist-info"))}
    # Every source file ships: a subpackage missing from pyproject's list would be left out.
    installed_as = {"libai_zoo": "libai_zoo", "layers": "libai_zoo/layers", "models": "libai_zoo/models"}
    sources = {f"{into}/{f.relative_to(ROOT / d).as_posix()}" for d, into in installed_as.items()
               for f in (ROOT / d).rglob("*.py")}
    assert sources - set(names) == set()
