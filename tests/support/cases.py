"""Training cases computed lazily, once per session, batched by world size, named when they fail.

A module declares its cases (`Case`: a function run on every rank of a world size) in one
`Cases`, and its tests ask for a case's result by name. The first ask for any case of a world
size runs, in one group of forked gloo processes (process start-up dominates on CPU), every case
of that world size that the session's *selected* tests ask for: `pytest -k CASE` computes only
CASE (and what it needs). One-process cases (the references) run in the pytest process. A case
that raises fails only the tests that ask for it, with its name and traceback; the rest of its
batch goes on in a fresh group of processes.

A test asks for cases through a parameter named `case` (or the `param` a module names) or a
`@pytest.mark.cases(...)` marker.
"""

from __future__ import annotations

import gc
import os
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp


@dataclass(frozen=True)
class Case:
    """`fn(root, *args)` on `world_size` processes (`root`: the module's directory of this session);
    `needs`: cases whose outputs it reads, which run first (declare one of the same world size
    before it)."""

    world_size: int
    fn: Callable
    args: tuple = ()
    needs: tuple[str, ...] = ()


class CaseFailed(Exception):
    """A case raised (or a case it needs did)."""


def _worker(rank: int, cases: dict[str, Case], names: list[str], world_size: int, root: str, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    gc.freeze()  # the parent's objects: a context's teardown collects only what the runs made
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank,
                                         world_size=world_size)
    from libai_zoo import distributed

    for name in names:
        case = cases[name]
        try:
            result = case.fn(root, *case.args)
        except Exception:
            Path(out, f"{name}.rank{rank}.error").write_text(traceback.format_exc())
            raise  # the other ranks may wait in a collective of this case: end the group
        finally:
            distributed.destroy()
        torch.save(result, os.path.join(out, f"{name}.rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


class Cases:
    """The cases of one test module, computed on demand; see the module docstring."""

    def __init__(self, module_file: str, cases: dict[str, Case], setup: Callable[[Path], None] | None = None,
                 param: str = "case"):
        self.path, self.cases, self.setup, self.param = Path(module_file), cases, setup, param
        self.results: dict[str, list | CaseFailed] = {}
        self.root: Path | None = None
        self.session = None

    def fixture(self, name: str = "runs"):
        """A session fixture named `name` (assign it to that module-level name) that gives the tests this object."""
        @pytest.fixture(scope="session", name=name)
        def cases(request, tmp_path_factory) -> Cases:
            if self.root is None:
                self.session = request.session
                self.root = tmp_path_factory.mktemp(self.path.stem)
                if self.setup is not None:
                    self.setup(self.root)
            return self
        return cases

    def __call__(self, name: str) -> Any:
        """Rank 0's result of case `name`."""
        return self.ranks(name)[0]

    def ranks(self, name: str) -> list:
        """Every rank's result of case `name` (rank order)."""
        self._ensure(name)
        result = self.results[name]
        if isinstance(result, CaseFailed):
            raise CaseFailed(str(result)) from None
        return result

    def _selected(self) -> list[str]:
        """The cases the session's selected tests of this module ask for, in declaration order."""
        wanted = set()
        for item in self.session.items:
            if Path(item.path) != self.path:
                continue
            callspec = getattr(item, "callspec", None)
            if callspec is not None and self.param in callspec.params:
                wanted.add(callspec.params[self.param])
            for marker in item.iter_markers("cases"):
                wanted.update(marker.args)
        return [name for name in self.cases if name in wanted]

    def _closure(self, names) -> list[str]:
        """`names` and every case they need, in declaration order."""
        found, todo = set(), list(names)
        while todo:
            name = todo.pop()
            if name not in found:
                found.add(name)
                todo.extend(self.cases[name].needs)
        return [name for name in self.cases if name in found]

    def _ensure(self, name: str, with_selected: bool = True) -> None:
        """Compute `name`: with the selected cases of its world size, or (a case another world
        size needs) with only what it needs itself."""
        if name in self.results:
            return
        if name not in self.cases:
            raise KeyError(f"no case {name!r} in {self.path.name}: the cases are {', '.join(self.cases)}")
        world = self.cases[name].world_size
        batch = [n for n in self._closure([name, *(self._selected() if with_selected else [])])
                 if self.cases[n].world_size == world and n not in self.results]
        for need in {need for n in batch for need in self.cases[n].needs if self.cases[need].world_size != world}:
            self._ensure(need, with_selected=False)
        self._run(world, batch)

    def _failed_needs(self, name: str) -> CaseFailed | None:
        failed = [need for need in self.cases[name].needs if isinstance(self.results.get(need), CaseFailed)]
        return CaseFailed(f"case {name!r} needs {', '.join(failed)}, which failed") if failed else None

    def _run(self, world: int, batch: list[str]) -> None:
        pending = [name for name in batch if not self._skip_failed(name)]
        while pending:
            if world == 1:
                pending = self._run_here(pending)
            else:
                pending = self._run_forked(world, pending)
            pending = [name for name in pending if not self._skip_failed(name)]

    def _skip_failed(self, name: str) -> bool:
        failed = self._failed_needs(name)
        if failed is not None:
            self.results[name] = failed
        return failed is not None

    def _run_here(self, pending: list[str]) -> list[str]:
        name, case = pending[0], self.cases[pending[0]]
        try:
            self.results[name] = [case.fn(str(self.root), *case.args)]
        except Exception as error:
            self.results[name] = CaseFailed(f"case {name!r} raised {error!r}:\n{traceback.format_exc()}")
        return pending[1:]

    def _run_forked(self, world: int, pending: list[str]) -> list[str]:
        """Run `pending` in one group; return the cases after the first failure (to run again)."""
        with tempfile.TemporaryDirectory() as out:
            error = None
            try:
                mp.start_processes(_worker, args=(self.cases, pending, world, str(self.root), out), nprocs=world,
                                   start_method="fork")
            except Exception as raised:  # a rank raised or died: the files say which case
                error = raised
            for index, name in enumerate(pending):
                files = [Path(out, f"{name}.rank{rank}.pt") for rank in range(world)]
                if all(file.is_file() for file in files):
                    self.results[name] = [torch.load(file, weights_only=False) for file in files]
                    continue
                reports = sorted(Path(out).glob(f"{name}.rank*.error"))
                detail = "\n".join(f"{file.name}:\n{file.read_text()}" for file in reports) or str(error)
                self.results[name] = CaseFailed(f"case {name!r} failed on {world} processes:\n{detail}")
                return pending[index + 1:]
        return []
