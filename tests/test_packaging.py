"""A non-editable install puts layers/ and models/ inside the libai_zoo namespace only."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_installs_only_the_libai_zoo_package(tmp_path):
    source = tmp_path / "src"  # build from a copy: setuptools writes build/ into the source tree
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), str(source)],
                   check=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("libai_zoo-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names}
    assert top_level == {"libai_zoo", next(t for t in top_level if t.endswith(".dist-info"))}
    for module in ("libai_zoo/layers/attention.py", "libai_zoo/layers/__init__.py", "libai_zoo/models/__init__.py",
                   "libai_zoo/dist/collectives.py"):
        assert module in names
