import os
import tempfile

# The suite is CPU + gloo by design (CI has no GPU): on a GPU host, hide the GPU before torch
# looks for it, so distributed.init picks gloo and the forked workers never touch CUDA.
# LIBAI_ZOO_TEST_DEVICE=cuda leaves it visible for the one-process modules that read it
# (tests/test_planner_activations.py; benchmarks/gpu_suite.sh runs them so on a GPU).
if os.environ.get("LIBAI_ZOO_TEST_DEVICE", "cpu") == "cpu":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402

# Multi-process tests fork this process (tests/support/forked.py): a parent that has used an
# OpenMP pool can hang its forked children, and on 2 cores one thread per process is fastest.
torch.set_num_threads(1)
# torch.distributed and DTensor may write compile caches; keep them out of the user's /tmp.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="libai_zoo_inductor_"))


# ------------------------------------------------------------------ markers and the time budget
import gc  # noqa: E402
import json  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

BUDGET = Path(__file__).with_name("durations_budget.json")
# Seconds a module may take: its recorded time × SLACK + GRACE, DEFAULT_BUDGET for a module with no
# record. The slack is wide because under `-n 2` a module's time depends on which module shares the
# cores with it (gloo's collectives slow several-fold beside another module's processes): 57 s
# against a record of 32.5 s in one CI run, and a minute more for a module whose set-up launches
# processes (Megatron-Core's: 57 s here, 141 s in CI). A new matrix of layouts still costs several times that.
# LIBAI_ZOO_DURATIONS_SLACK=0 turns the check off (a loaded machine);
# LIBAI_ZOO_RECORD_DURATIONS=1 writes this run's times of the modules it ran into the budget.
SLACK = float(os.environ.get("LIBAI_ZOO_DURATIONS_SLACK", "2"))
GRACE, DEFAULT_BUDGET = 60.0, 60.0
_module_seconds: dict[str, float] = defaultdict(float)
_over_budget: list[str] = []


def _budget_key(report) -> str:
    """A module's tests of one kind: `path` (one-process), `path::slow` (multi-process),
    `path::system` (the slowest end-to-end ones), so `-m "not slow"` or `-m "not system"` sees whole keys."""
    kind = "system" if "system" in report.keywords else "slow" if "slow" in report.keywords else None
    module = report.nodeid.split("::")[0]
    return f"{module}::{kind}" if kind else module


def pytest_collection_modifyitems(items) -> None:
    """The longest modules first, by their recorded seconds: `--dist loadfile --no-loadscope-reorder`
    hands modules to the workers in this order, so no long module starts last beside an idle core."""
    seconds: dict[str, float] = defaultdict(float)
    for key, recorded in json.loads(BUDGET.read_text()).items():
        seconds[key.split("::")[0]] += recorded
    items.sort(key=lambda item: -seconds[item.nodeid.split("::")[0]])


def pytest_collection_finish(session) -> None:
    """Freeze what the imports and the collection made (torch, transformers, the zoo, the test
    modules): the collector then never scans it again, here or in the processes forked from here
    (a full collection of that heap costs 0.5-1 s, and a forked run of a few steps triggers several)."""
    gc.collect()
    gc.freeze()


def pytest_runtest_logreport(report) -> None:
    """Sum set-up, call and tear-down seconds per module and kind (under xdist, on the controller)."""
    _module_seconds[_budget_key(report)] += report.duration


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    """Fail the run when a module took longer than its budget: a new model or feature should pick
    layouts from tests/layouts.py and share runs, not add a matrix (see tests/durations_budget.json)."""
    if hasattr(session.config, "workerinput") or not _module_seconds:
        return  # an xdist worker: the controller checks
    budget = json.loads(BUDGET.read_text())
    if os.environ.get("LIBAI_ZOO_RECORD_DURATIONS") == "1":
        budget.update({key: round(seconds, 1) for key, seconds in _module_seconds.items()})
        BUDGET.write_text(json.dumps(dict(sorted(budget.items())), indent=1) + "\n")
        return
    if SLACK <= 0:
        return
    for key, seconds in sorted(_module_seconds.items()):
        allowed = budget[key] * SLACK + GRACE if key in budget else DEFAULT_BUDGET
        if seconds > allowed:
            recorded = f"recorded {budget[key]} s × {SLACK} + {GRACE:.0f} s" if key in budget else "no record"
            _over_budget.append(f"{key}: {seconds:.0f} s, over its budget of {allowed:.0f} s ({recorded})")
    if _over_budget and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    if _over_budget:
        terminalreporter.section("modules over their time budget (tests/durations_budget.json)", red=True)
        for line in _over_budget:
            terminalreporter.write_line(line)
        terminalreporter.write_line("Cover a new model or feature on the few layouts that exercise it (tests/layouts.py) "
                                    "and compose features into shared runs; if the time is earned, record it with "
                                    "LIBAI_ZOO_RECORD_DURATIONS=1.")
