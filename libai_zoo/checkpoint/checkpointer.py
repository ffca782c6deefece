"""Training checkpoints that survive crashes and layout changes, and that cannot lie.

    output_dir/
      model_0000500/         model + optimizer (torch.distributed.checkpoint: every rank writes
                             its own shards; DTensors keep their global shapes, so a checkpoint
                             loads at another dp × tp × pp) and trainer_state_rank{r}.pt
                             (iteration, RNG states, and the state of the run's other stateful
                             objects: LR schedule, loss scaler); config.yaml (the config of the
                             run that wrote it); manifest.json (every file's size and CRC-32)
      last_checkpoint        the name of the newest complete checkpoint

A checkpoint counts only once complete (`commit`: written under ``<name>.tmp``, renamed when every
rank has finished, then named by `last_checkpoint`): a run killed while writing resumes from the
previous one.

Integrity: at save every rank records the size and CRC-32 of the files it wrote; rank 0 gathers
the records and writes ``manifest.json`` into the staging directory before the commit.
`Checkpointer.find_resumable` (every rank) walks the committed checkpoints newest first, each
rank checking every world-size-th file of the manifest, and returns the newest whose files all
match, logging a warning that names each skipped checkpoint and what differed (a checkpoint
without its manifest is damaged like any other).

Asynchronous saving (``Checkpointer(..., async_save=True)``, torch.distributed.checkpoint's
``async_save``): `save` copies the state off the live tensors (staging) and returns; the shards
are written by a background thread whose collectives run on a gloo group of their own, then the
rank writes its trainer state and records its files. `poll` (after every step: no collective
while nothing is pending; otherwise one 1-element all-reduce on a second gloo group until every
rank has finished, then rank 0 writes the manifest and commits) and `wait` commit it; `save`, `remove_incomplete`, `find_resumable` and `resume` wait for a pending
save themselves. With ``stage_in_background=True`` even the copy runs in the background: `save`
returns at once and the optimizer's next ``step()`` waits for the copy (a step pre-hook, or
`wait_for_staging`). A run killed while a write is pending never commits it: its ``.tmp`` is
removed on resume. When a run saves, commits and prunes is `CheckpointManager`'s to decide
(`manager.py`); this file is how.
"""

from __future__ import annotations

import copy
import logging
import re
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from libai_zoo import distributed
from libai_zoo.config import ConfigError
from libai_zoo.layers import is_adapter_parameter
from libai_zoo.utils import rng_state, set_rng_state

from . import commit

logger = logging.getLogger("libai_zoo")

@contextmanager
def _one_process_ok():
    """DCP warns when it runs without a process group; for a one-process run that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@dataclass
class _PendingSave:
    """An asynchronous save not committed yet: `staging` completes once the state is copied (None:
    it was copied inside save()), `written` once this rank's files are on disk (its result: the
    rank's report for the manifest)."""

    final: Path
    iteration: int
    pointer: bool
    staging: Future | None
    written: Future
    started: float


class Checkpointer:
    """Saves and loads this rank's model parts, their optimizer and the run's other state under
    `output_dir`.

    ``model_parts``: the modules this rank trains (one model, or its pipeline stages' pruned copies,
    which keep the full model's parameter names). ``stateful``: other objects with
    ``state_dict``/``load_state_dict`` saved per rank (the LR schedule, the loss scaler).
    ``aliases``: this rank's name of a parameter -> the name its optimizer state may be saved
    under instead (a pipeline's last stage holds a copy of the embedding tied to its head; a
    layout without that copy saves the state under the embedding's name).
    ``record``: the run's config as YAML, written into every checkpoint as ``config.yaml`` (what the
    export and `tools/convert inspect` read). ``model``: the whole model the parts are of (required
    with several parts: a pipeline rank's stages), whose tensors a checkpoint it loads must hold: one
    of another model is refused, naming what differs.
    ``async_save``: write in the background (see the module docstring); with a process group,
    constructing the Checkpointer is then a collective (it creates two gloo groups).
    ``stage_in_background``: with `async_save`, copy the state in the background too; the
    optimizer's next ``step()`` waits for the copy. ``timeout`` (seconds): bounds the collectives
    of those groups (None: gloo's default). ``group``: the run's process group (the parallel
    context's `world_group`) every collective of a save, a load and a verification runs over;
    None: this process alone, with no collective at all.
    """

    def __init__(self, output_dir: str | Path, model_parts: Sequence[nn.Module],
                 optimizer: torch.optim.Optimizer | None = None, *, stateful: dict[str, object] | None = None,
                 aliases: dict[str, str] | None = None, async_save: bool = False, stage_in_background: bool = False,
                 record: str | None = None, model: nn.Module | None = None, timeout: float | None = None,
                 group: dist.ProcessGroup | None = None):
        if stage_in_background and not async_save:
            raise ValueError("stage_in_background=True needs async_save=True: a synchronous save copies nothing")
        self.output_dir = Path(output_dir)
        self.run_group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world_size = dist.get_world_size(group) if group is not None else 1
        if model is None and len(model_parts) > 1:
            raise ValueError("several model parts (pipeline stages): pass model=, the whole model they are of, "
                             "whose tensors the checkpoints hold")
        self.model = _one_module(list(model_parts))
        whole = model if model is not None else self.model
        #: What a checkpoint this run loads must hold: the whole model's tensors (names as DCP saves them,
        #: tied ones under each name; global shapes), not only this rank's stages
        self.expected = {name: tuple(tensor.shape) for name, tensor in whole.state_dict(keep_vars=True).items()
                         if isinstance(tensor, torch.Tensor)}
        #: the layer stacks' paths, which name a difference of depth in errors
        self.layer_stacks = [stack.path for stack in whole.stacks()] if hasattr(whole, "stacks") else []
        self.optimizer = optimizer
        self.stateful = stateful or {}
        self.record = record
        self.aliases = aliases or {}
        self.async_save = async_save
        self.stage_in_background = stage_in_background
        self._pending: _PendingSave | None = None
        #: The checkpoint this run committed last with the pointer (the same on every rank; None before).
        self.last_committed: Path | None = None
        self._prune_after_commit: int | None = None
        # The background write's DCP collectives run on one gloo group, the main thread's checkpoint
        # collectives (poll, manifest, verification) on another: two threads must never interleave
        # collectives on one group, and the training's group (NCCL on GPUs) stays untouched.
        self._write_group, self._group = None, group
        if async_save and group is not None:
            ranks = dist.get_process_group_ranks(group)
            self._write_group = distributed.new_group(ranks, backend="gloo", timeout=timeout)
            self._group = distributed.new_group(ranks, backend="gloo", timeout=timeout)
        if async_save and group is None:
            # DCP's background thread warns that it runs without a process group: here that is the intent.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled",
                                    module=r"torch\.distributed\.checkpoint\.")
        if stage_in_background and optimizer is not None:
            optimizer.register_step_pre_hook(lambda *_: self.wait_for_staging())

    def _sharded_optimizers(self, with_optimizer: bool = True) -> list[torch.optim.Optimizer]:
        """The optimizer, when its state is saved or loaded with the model's."""
        return [self.optimizer] if with_optimizer and self.optimizer is not None else []

    def _state(self, with_optimizer: bool = True) -> dict:
        """The FQN-keyed state DCP saves and loads: {"model": ..., ["optim": ...]}."""
        optimizers = self._sharded_optimizers(with_optimizer)
        model_state, optim_state = get_state_dict(self.model, optimizers)
        return {"model": model_state, "optim": optim_state} if optimizers else {"model": model_state}

    def _write_own_files(self, staged: Path, trainer_state: dict) -> None:
        """This rank's files beside its shards: its trainer state, and on rank 0 the run's config (`record`)."""
        torch.save(trainer_state, staged / f"trainer_state_rank{self.rank}.pt")
        if self.rank == 0 and self.record is not None:
            (staged / commit.CONFIG).write_text(self.record)

    def _trainer_state(self, iteration: int) -> dict:
        """What trainer_state_rank{r}.pt holds, copied now (a later step must not change it)."""
        return copy.deepcopy({"iteration": iteration, "rng": rng_state(),
                              **{key: obj.state_dict() for key, obj in self.stateful.items()}})

    # ------------------------------------------------------------------------------ collectives
    def _gather(self, obj: object) -> list | None:
        """Every rank's `obj` on rank 0 (None elsewhere), over the checkpoint group."""
        if self._group is None:
            return [obj]
        gathered = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, gathered, group=self._group, group_dst=0)
        return gathered

    def _all_gather(self, obj: object) -> list:
        """Every rank's `obj` on every rank, over the checkpoint group."""
        if self._group is None:
            return [obj]
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self._group)
        return gathered

    def _broadcast(self, obj: object) -> object:
        """Rank 0's `obj` on every rank, over the checkpoint group."""
        if self._group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self._group, group_src=0)
        return box[0]

    # ------------------------------------------------------------------------------------ saving
    def save(self, name: str, iteration: int, *, pointer: bool = True) -> Path:
        """Write checkpoint `name` after `iteration` steps (every rank must call this); with
        `pointer`, `last_checkpoint` names it once it is complete. Returns where it will be.

        Synchronous: returns once it is committed. Asynchronous: first waits for a pending save
        to commit, then returns once the state is staged (copied), or at once with
        `stage_in_background`; `poll` or `wait` commits it."""
        self.wait()
        final = self.output_dir / name
        staged = commit.staging_dir(final)
        if self.rank == 0:
            commit.start(final)
        self._barrier()
        if self.async_save:
            self._pending = self._save_async(final, iteration, pointer)
            return final
        with _one_process_ok():
            dcp.save(self._state(), checkpoint_id=str(staged), process_group=self.run_group,
                     no_dist=self.run_group is None)
        self._write_own_files(staged, self._trainer_state(iteration))
        self._commit(final, iteration, pointer, _report(self.rank, lambda: commit.record_files(staged, self.rank)))
        return final

    def _save_async(self, final: Path, iteration: int, pointer: bool) -> _PendingSave:
        """Start DCP's async_save of the state into the staging directory of `final`, and a thread
        that, once the shards are written, writes this rank's trainer state and records its files."""
        started = time.perf_counter()
        staged = commit.staging_dir(final)
        trainer_state = self._trainer_state(iteration)
        stager = (DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                               use_async_staging=True, use_non_blocking_copy=False))
                  if self.stage_in_background else None)
        response = dcp.async_save(self._state(), checkpoint_id=str(staged), process_group=self._write_group,
                                  async_stager=stager, no_dist=self.run_group is None)
        if isinstance(response, Future):
            staged_future, upload = None, response
        else:
            staged_future, upload = response.staging_completion, response.upload_completion

        def finish_rank() -> dict:
            try:
                upload.result()
            finally:
                if stager is not None:
                    stager.close()
            self._write_own_files(staged, trainer_state)
            return commit.record_files(staged, self.rank)

        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="libai_zoo_checkpoint")
        written = executor.submit(_report, self.rank, finish_rank)
        executor.shutdown(wait=False)
        return _PendingSave(final, iteration, pointer, staged_future, written, started)

    def _commit(self, final: Path, iteration: int, pointer: bool, report: dict) -> None:
        """Gather every rank's report ({"files": records} or {"error": message}) on rank 0, which
        writes the manifest and commits; every rank raises if any part failed."""
        reports = self._gather(report)
        error = None
        if self.rank == 0:
            try:
                error = _manifest_and_commit(final, iteration, pointer, reports)
            except Exception as exc:  # every rank must learn of it, not rank 0 alone
                error = f"committing failed on rank 0: {type(exc).__name__}: {exc}"
            if error is None and self._prune_after_commit is not None:
                self._prune_now(self._prune_after_commit)
        self._prune_after_commit = None
        error = self._broadcast(error)
        if error is not None:
            raise RuntimeError(f"checkpoint {final} was not saved: {error}; the previous checkpoint stays the "
                               f"newest (its staging directory {commit.staging_dir(final).name} is removed on "
                               f"resume)")
        if pointer:
            self.last_committed = final

    def poll(self) -> Path | None:
        """Commit the pending asynchronous save if every rank has finished writing it; return the
        checkpoint it committed, else None. Every rank calls it after every step: no collective
        when nothing is pending, one 1-element all-reduce while a save is."""
        pending = self._pending
        if pending is None:
            return None
        unfinished = torch.tensor([0 if pending.written.done() else 1])
        if self._group is not None:
            dist.all_reduce(unfinished, group=self._group)
        if unfinished.item():
            return None
        self._pending = None
        self._commit(pending.final, pending.iteration, pending.pointer, pending.written.result())
        logger.info("committed %s, %.2f s after its save started", pending.final, time.perf_counter() - pending.started)
        return pending.final

    def wait(self) -> Path | None:
        """Block until the pending asynchronous save (if any) is committed, and return it (every rank)."""
        pending = self._pending
        if pending is None:
            return None
        wait_for_futures([pending.written])
        return self.poll()

    def wait_for_staging(self) -> None:
        """Block until the pending save's copy of the state is complete, so the parameters and the
        optimizer state may change (the optimizer's step pre-hook calls it; this rank only)."""
        pending = self._pending
        if pending is not None and pending.staging is not None:
            pending.staging.result()

    @property
    def pending(self) -> Path | None:
        """The checkpoint an asynchronous save is writing and has not committed yet."""
        return None if self._pending is None else self._pending.final

    def prune(self, max_to_keep: int | None) -> None:
        """Keep only the newest `max_to_keep` periodic checkpoints (model_XXXXXXX; model_best stays);
        while a save is pending, once it is committed (so it is counted and the previous one stays)."""
        if max_to_keep is None:
            return
        if self._pending is not None:
            self._prune_after_commit = max_to_keep
        elif self.rank == 0:
            self._prune_now(max_to_keep)

    def _prune_now(self, max_to_keep: int) -> None:
        periodic = sorted(p for p in self.output_dir.glob("model_*") if p.is_dir() and p.name[6:].isdigit())
        for old in periodic[:-max_to_keep]:
            shutil.rmtree(old)

    def discard_after(self, iteration: int) -> None:
        """Delete the periodic checkpoints of more than `iteration` steps (a rollback abandons them;
        a restart must not resume from them). Every rank calls this."""
        self.wait()
        if self.rank == 0:
            for path in self.output_dir.glob("model_*"):
                if path.is_dir() and (commit.iteration_of(path) or 0) > iteration:
                    logger.info("removing %s: the run rolled back to iteration %d", path, iteration)
                    shutil.rmtree(path)
        self._barrier()

    # ----------------------------------------------------------------------------------- loading
    def remove_incomplete(self) -> None:
        """Delete the checkpoints whose writing was interrupted (every rank must call this)."""
        self.wait()
        if self.rank == 0:
            commit.remove_incomplete(self.output_dir)
        self._barrier()

    def _barrier(self) -> None:
        if self._group is not None:
            dist.barrier(group=self._group)

    def find_resumable(self, at_most: int | None = None) -> Path | None:
        """The newest committed checkpoint whose files match its manifest (every rank calls this and
        gets the same answer): the one `last_checkpoint` names, else the periodic ones before it,
        newest first; `at_most` keeps only those of at most that iteration (a rollback). Each rank
        checks every world-size-th file. A bad one (a file, or the manifest itself, missing or
        differing) is skipped with a warning naming what is wrong. None: nothing to resume."""
        self.wait()
        candidates = self._broadcast(commit.resumable_candidates(self.output_dir, at_most)
                                     if self.rank == 0 else None)
        for path in candidates:
            verdicts = self._all_gather(_check_share(path, self.rank, self.world_size))
            # every rank finds a missing manifest: name each problem once
            problems = list(dict.fromkeys(problem for verdict in verdicts for problem in verdict))
            if problems:
                logger.warning("checkpoint %s is damaged, skipping it: %s", path, "; ".join(problems))
                continue
            return path
        if candidates:
            logger.warning("no intact checkpoint in %s%s", self.output_dir,
                           "" if at_most is None else f" at or before iteration {at_most}")
        return None

    def load(self, path: str | Path, *, with_optimizer: bool = False) -> None:
        """Load the model parts' weights (and, `with_optimizer`, the optimizer) from checkpoint `path`,
        whatever layout wrote it."""
        self.wait_for_staging()
        path = Path(path)
        if not (path / ".metadata").is_file():
            raise FileNotFoundError(f"{path} is not a libai_zoo checkpoint (no .metadata): pass a model_XXXXXXX "
                                    f"directory written by the trainer")
        optimizers = self._sharded_optimizers(with_optimizer)
        state = self._state(with_optimizer)
        if "optim" in state:
            _rename_state(state["optim"], self.aliases)
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        # LoRA adapters put on a model whose weights had none keep their fresh values (a resumed run has them all)
        differences = _differences(saved, self.expected, self.layer_stacks, new_adapters_ok=not with_optimizer)
        if differences:
            fix = ("start over in this directory with --no-resume (its checkpoints are then replaced), or give this "
                   "run its own train.output_dir" if with_optimizer else
                   "point train.load_weight at a checkpoint of this model")
            raise ConfigError(f"{path} was written by another model than this run's ({'; '.join(differences)}): "
                              f"{fix}")
        new_adapters = [name for name in state["model"] if f"model.{name}" not in saved and is_adapter_parameter(name)]
        for name in new_adapters:
            del state["model"][name]
        with _one_process_ok():
            dcp.load(state, checkpoint_id=str(path), process_group=self.run_group, no_dist=self.run_group is None)
        if "optim" in state:
            _rename_state(state["optim"], {saved: own for own, saved in self.aliases.items()})
        set_state_dict(self.model, optimizers, model_state_dict=state["model"],
                       optim_state_dict=state.get("optim", {}), options=StateDictOptions(strict=not new_adapters))

    def resume(self, path: str | Path) -> int:
        """Restore everything a run saved in checkpoint `path` (model, optimizer, stateful objects,
        RNG states); return the number of steps it had done. Waits for a pending save first."""
        self.wait()
        path = Path(path)
        states = [path / f"trainer_state_rank{self.rank}.pt", path / "trainer_state_rank0.pt"]
        state_file = next((file for file in states if file.is_file()), None)
        if state_file is None:
            raise ValueError(f"{path} holds model weights only (e.g. from tools/convert hf-to-zoo), not a run to "
                             f"resume: start from it with train.load_weight={path} instead of --resume")
        self.load(path, with_optimizer=True)
        state = torch.load(state_file, weights_only=True)
        lacking = sorted(set(self.stateful) - set(state))
        if lacking:
            raise ValueError(f"{state_file} holds no state of {', '.join(lacking)}: it was not written by a run "
                             f"like this one; start from its weights with train.load_weight={path}")
        for key, obj in self.stateful.items():
            obj.load_state_dict(state[key])
        set_rng_state(state["rng"])
        return state["iteration"]


def _differences(saved: dict, ours: dict[str, tuple], layer_stacks: list[str], *, new_adapters_ok: bool) -> list[str]:
    """How the model of a checkpoint's metadata (`saved`: DCP's state_dict_metadata) differs from
    `ours` (the model's tensor names -> global shapes), in a few words each: layers, LoRA adapters,
    other tensors missing or extra, shapes. Empty: they fit. ``new_adapters_ok``: adapters the
    checkpoint lacks altogether are no difference (fresh ones on loaded weights)."""
    theirs = {key.removeprefix("model."): tuple(md.size) for key, md in saved.items()
              if key.startswith("model.") and isinstance(md, TensorStorageMetadata)}
    differences, told = [], []  # told: what a line already accounts for
    for stack in layer_stacks:
        layer = re.compile(rf"{re.escape(stack)}\.(\d+)\.")
        counts = [len({m.group(1) for name in names if (m := layer.match(name))}) for names in (theirs, ours)]
        if counts[0] != counts[1]:
            where = f" ({stack})" if len(layer_stacks) > 1 else ""
            differences.append(f"{counts[0]} layers in it, {counts[1]} in this model{where}")
            told.append(lambda name, layer=layer: layer.match(name) is not None)
    adapters = [sum(is_adapter_parameter(name) for name in names) for names in (theirs, ours)]
    if adapters[0] != adapters[1] and not (new_adapters_ok and adapters[0] == 0):
        differences.append(f"LoRA adapter tensors: {adapters[0]} in it, {adapters[1]} in this model: set train.lora "
                           f"as the run that wrote it had it (its config.yaml), or export it with the adapters merged "
                           f"(tools/convert zoo-to-hf) and start from that")
    if adapters[0] != adapters[1]:
        told.append(is_adapter_parameter)
    for names, other, what in ((ours, theirs, "of this model not in it"), (theirs, ours, "in it this model lacks")):
        lacking = [name for name in names if name not in other and not any(rule(name) for rule in told)]
        if lacking:
            differences.append(f"{len(lacking)} tensor(s) {what}, e.g. {lacking[0]}")
    shapes = [f"{name} {theirs[name]} in it, {shape} in this model" for name, shape in ours.items()
              if name in theirs and theirs[name] != shape]
    if shapes:
        differences.append(f"{len(shapes)} tensor(s) of other shapes, e.g. {shapes[0]}")
    return differences


def _report(rank: int, records: Callable[[], dict[str, dict]]) -> dict:
    """A rank's report for the manifest: {"files": records()} or, if that failed, {"error": ...}."""
    try:
        return {"files": records()}
    except Exception as exc:  # reported to every rank through rank 0
        return {"error": f"rank {rank}: {type(exc).__name__}: {exc}"}


def _manifest_and_commit(final: Path, iteration: int, pointer: bool, reports: list[dict]) -> str | None:
    """On rank 0: merge the ranks' records, check they cover every file ``.metadata`` refers to,
    write the manifest and commit; return what failed instead, if anything did."""
    errors = [report["error"] for report in reports if "error" in report]
    if errors:
        return "; ".join(errors)
    staged = commit.staging_dir(final)
    files = {name: record for report in reports for name, record in report["files"].items()}
    metadata = dcp.FileSystemReader(str(staged)).read_metadata()
    referenced = {info.relative_path for info in metadata.storage_data.values()}
    unrecorded = sorted(referenced - set(files))
    if unrecorded:
        return (f"{', '.join(unrecorded)} in .metadata but recorded by no rank (torch.distributed.checkpoint "
                f"names its files differently than commit.files_of_rank expects: update files_of_rank)")
    commit.write_manifest(staged, files, iteration=iteration, world_size=len(reports))
    commit.finish(final, pointer=pointer)
    logger.info("saved checkpoint %s", final)
    return None


def _check_share(path: Path, rank: int, world_size: int) -> list[str]:
    """This rank's share of verifying checkpoint `path`: what is wrong with it (empty: nothing)."""
    if not path.is_dir():
        return [f"{path.name} does not exist"]
    try:
        manifest = commit.read_manifest(path)
    except ValueError as error:
        return [str(error)]
    names = sorted(manifest["files"])
    problems = [commit.check_file(path, name, manifest["files"][name]) for name in names[rank::world_size]]
    return [problem for problem in problems if problem is not None]


def _one_module(parts: list[nn.Module]) -> nn.Module:
    """The model parts as one module whose parameter names are the full model's: what DCP's
    state-dict functions take to name one optimizer's parameters. The parts themselves when there
    is one; else a module whose children are the union of theirs (pipeline stages of one model
    keep its names and hold disjoint layers), sharing their submodules."""
    if len(parts) == 1 or all(part is parts[0] for part in parts):
        return parts[0]
    union = nn.Module()
    for name in dict.fromkeys(n for part in parts for n in part._modules):
        children = [part._modules[name] for part in parts if part._modules.get(name) is not None]
        if children:
            union.add_module(name, _one_module(children))
    for name in dict.fromkeys(n for part in parts for n in part._parameters):
        param = next((part._parameters[name] for part in parts if part._parameters.get(name) is not None), None)
        if param is not None:
            union.register_parameter(name, param)
    return union


def _rename_state(optim_state: dict, names: dict[str, str]) -> None:
    """Rename parameters in an FQN-keyed optimizer state dict (as get_state_dict returns it), in place."""
    for old, new in names.items():
        if old in optim_state.get("state", {}) and new not in optim_state["state"]:
            optim_state["state"][new] = optim_state["state"].pop(old)
            for group in optim_state.get("param_groups", []):
                group["params"] = [new if name == old else name for name in group["params"]]
