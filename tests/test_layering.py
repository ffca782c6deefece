"""The layers of the house (docs/design.md): each package imports only those before it (no import
cycle), model files hold no process-group code, and importing the models loads neither the
conversion code nor torch.distributed.checkpoint."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# docs/design.md, "The layers of the house": a package may import only the ones before it.
ORDER = ["utils", "config", "data", "optim", "distributed", "layers", "hf", "models", "parallel", "plan", "checkpoint",
         "convert", "engine"]
FOLDERS = {"layers": ROOT / "layers", "models": ROOT / "models",
           **{name: ROOT / "libai_zoo" / name for name in ORDER if name not in ("layers", "models")}}


def test_each_package_imports_only_the_ones_before_it():
    wrong = []
    for package, folder in FOLDERS.items():
        allowed = set(ORDER[:ORDER.index(package)])
        for path in sorted(folder.rglob("*.py")):
            text = path.read_text()
            imported = set(re.findall(r"^\s*from libai_zoo\.(\w+)", text, re.M))
            imported |= set(re.findall(r"^\s*from libai_zoo import (\w+)", text, re.M))
            wrong += [f"{path.relative_to(ROOT)} imports libai_zoo.{name}" for name in imported - allowed - {package}]
    assert wrong == []


def test_model_files_reach_no_process_group_code():
    leaks = [f"{path.relative_to(ROOT)}:{number}" for path in sorted((ROOT / "models").rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"libai_zoo\.distributed|import distributed|torch\.distributed", line)]
    assert leaks == []


def test_importing_the_models_loads_no_conversion_and_no_distributed_checkpoint():
    probe = ("import sys, libai_zoo.models; "
             "print(sorted(m for m in sys.modules if m.startswith(('libai_zoo.convert', 'libai_zoo.checkpoint', "
             "'libai_zoo.engine', 'libai_zoo.parallel', 'torch.distributed.checkpoint'))))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


def test_a_run_that_reads_no_datasets_source_does_not_import_datasets():
    """The engine, the models and GPT-2's text data load without `datasets`, pandas and pyarrow (1 s
    of every process start): libai_zoo.data imports a dataset module only when it is asked for."""
    probe = ("import sys, libai_zoo.engine, libai_zoo.models; "
             "from libai_zoo.data import MicroBatchSampler, build_gpt_dataset, check_dataset; "
             "print(sorted(m for m in ('datasets', 'pandas', 'pyarrow') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


def test_top_level_layers_and_models_refuse_to_load_a_second_copy():
    for package in ("layers", "models"):
        run = subprocess.run([sys.executable, "-c", f"import {package}"], cwd=ROOT, capture_output=True, text=True)
        assert run.returncode != 0, package
        assert f"from libai_zoo import {package}" in run.stderr, run.stderr
