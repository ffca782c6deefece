"""Checkpoints that cannot lie: every save writes manifest.json (each file's size and CRC-32)
before the commit, `find_resumable` skips a checkpoint whose files differ from it (a flipped
byte, a truncated or deleted file) and falls back to the previous one, and an asynchronous save
writes exactly the state of the moment `save()` was called, commits only through `poll`/`wait`,
and a process killed while it writes commits nothing.

One process where possible (DCP needs no process group); one slow test on 2 forked gloo ranks
with a tensor-parallel model checks the same on sharded checkpoints, every rank agreeing.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.tensor import DTensor

from libai_zoo.checkpoint import Checkpointer, CheckpointManager, commit
from support.forked import run_forked


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler=None, steps: int = 1) -> None:
    for _ in range(steps):
        model(torch.randn(4, model[0].in_features)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the model and its optimizer state, copied."""
    state = {f"model.{name}": _local(value) for name, value in model.state_dict().items()}
    for index, param_state in optimizer.state_dict()["state"].items():
        state.update({f"optim.{index}.{key}": _local(value) for key, value in param_state.items()})
    return state


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def _resumed(path: Path) -> tuple[dict[str, torch.Tensor], int, dict]:
    """(model + optimizer tensors, iteration, LR schedule state) of a fresh model resumed from `path`."""
    model, optimizer, scheduler = _model(seed=1)
    _train(model, optimizer)  # give the optimizer state tensors to load into
    iteration = Checkpointer(path.parent, [model], optimizer, stateful={"scheduler": scheduler}).resume(path)
    return _snapshot(model, optimizer), iteration, scheduler.state_dict()


@pytest.fixture
def logs(caplog):
    """The libai_zoo logger's records (setup_logging may have turned its propagation off)."""
    logger = logging.getLogger("libai_zoo")
    level, propagate = logger.level, logger.propagate
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # each record once, whether or not setup_logging ran before
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.setLevel(level)
    logger.propagate = propagate


def _saved(output_dir: Path, iterations: list[int], **options) -> Checkpointer:
    model, optimizer, scheduler = _model()
    checkpointer = Checkpointer(output_dir, [model], optimizer, stateful={"scheduler": scheduler}, **options)
    for iteration in iterations:
        _train(model, optimizer, scheduler)
        checkpointer.save(f"model_{iteration:07d}", iteration)
    checkpointer.wait()
    return checkpointer


def test_manifest_lists_every_file_and_verifies(tmp_path):
    checkpointer = _saved(tmp_path, [1])
    checkpoint = tmp_path / "model_0000001"
    manifest = json.loads((checkpoint / commit.MANIFEST).read_text())
    assert manifest["iteration"] == 1 and manifest["world_size"] == 1 and manifest["checksum"] == "crc32"
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "trainer_state_rank0.pt"]
    for name, record in manifest["files"].items():
        assert record["size"] == (checkpoint / name).stat().st_size
        assert record["crc32"] == commit.checksum(checkpoint / name)
    assert checkpointer.find_resumable() == checkpoint
    assert not list(tmp_path.glob("*.tmp"))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


DAMAGE = {  # name -> (file, how, what the warning says)
    "flipped_byte": ("__0_0.distcp", _flip_byte, "CRC-32"),
    "truncated": ("__0_0.distcp", _truncate, "bytes, the manifest says"),
    "deleted_trainer_state": ("trainer_state_rank0.pt", Path.unlink, "is missing"),
    "deleted_metadata": (".metadata", Path.unlink, "is missing"),
    "deleted_manifest": (commit.MANIFEST, Path.unlink, "is missing"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_previous(tmp_path, logs, damage):
    name, spoil, said = DAMAGE[damage]
    checkpointer = _saved(tmp_path, [1, 2])
    spoil(tmp_path / "model_0000002" / name)
    assert checkpointer.find_resumable() == tmp_path / "model_0000001"
    warnings = [r.getMessage() for r in logs.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "model_0000002" in warnings[0] and name in warnings[0] and said in warnings[0]
    _, iteration, _ = _resumed(tmp_path / "model_0000001")
    assert iteration == 1


def test_pointer_to_a_missing_checkpoint_falls_back(tmp_path, logs):
    checkpointer = _saved(tmp_path, [1, 2])
    shutil.rmtree(tmp_path / "model_0000002")
    assert checkpointer.find_resumable() == tmp_path / "model_0000001"
    assert any("model_0000002 does not exist" in r.getMessage() for r in logs.records)


def test_every_checkpoint_damaged_means_none(tmp_path, logs):
    checkpointer = _saved(tmp_path, [1])
    _flip_byte(tmp_path / "model_0000001" / "__0_0.distcp")
    assert checkpointer.find_resumable() is None
    assert any("no intact checkpoint" in r.getMessage() for r in logs.records)


def test_at_most_and_order(tmp_path):
    checkpointer = _saved(tmp_path, [1, 2, 3])
    assert checkpointer.find_resumable() == tmp_path / "model_0000003"
    assert checkpointer.find_resumable(at_most=2) == tmp_path / "model_0000002"
    assert checkpointer.find_resumable(at_most=1) == tmp_path / "model_0000001"
    assert checkpointer.find_resumable(at_most=0) is None
    # only last_checkpoint's checkpoint and older ones count: a newer directory was never committed
    (tmp_path / commit.POINTER).write_text("model_0000002")
    assert checkpointer.find_resumable() == tmp_path / "model_0000002"
    assert Checkpointer(tmp_path / "empty", [nn.Linear(2, 2)]).find_resumable() is None


def test_checkpoint_without_manifest_is_damaged(tmp_path, logs):
    checkpointer = _saved(tmp_path, [1])
    (tmp_path / "model_0000001" / commit.MANIFEST).unlink()  # nothing vouches for its files any more
    assert checkpointer.find_resumable() is None
    warnings = [r.getMessage() for r in logs.records if r.levelno == logging.WARNING]
    assert "model_0000001 is damaged" in warnings[0] and "manifest.json is missing" in warnings[0]
    assert "no intact checkpoint" in warnings[1]


def test_the_manager_decides_every_save_and_what_stays(tmp_path, monkeypatch):
    model, optimizer, scheduler = _model()
    checkpointer = Checkpointer(tmp_path, [model], optimizer, stateful={"scheduler": scheduler})
    manager = CheckpointManager(checkpointer, period=2, max_to_keep=1, best_metric="loss", best_mode="min")
    saved = [manager.after_step(done, last=done == 5) for done in range(1, 6)]
    assert [s.iteration if s else None for s in saved] == [None, 2, None, 4, 5]
    assert sorted(p.name for p in tmp_path.glob("model_*")) == ["model_0000005"]  # max_to_keep=1
    manager.evaluated(4, {"loss": 2.0})
    manager.evaluated(5, {"loss": 3.0})  # worse: no save
    assert json.loads((tmp_path / "model_best" / commit.MANIFEST).read_text())["iteration"] == 4
    calls = []
    monkeypatch.setattr(checkpointer, "save", lambda *args, **kwargs: calls.append(args))
    assert manager.save_now(5) == tmp_path / "model_0000005" and calls == []  # this step's checkpoint exists
    assert commit.pointed_to(tmp_path) == tmp_path / "model_0000005"
    with pytest.raises(ValueError, match="max_to_keep = 0 must be at least 1"):
        CheckpointManager(checkpointer, period=2, max_to_keep=0)


def test_unreadable_manifest_is_damage(tmp_path, logs):
    checkpointer = _saved(tmp_path, [1, 2])
    (tmp_path / "model_0000002" / commit.MANIFEST).write_text("{not json")
    assert checkpointer.find_resumable() == tmp_path / "model_0000001"
    assert any("manifest.json is unreadable" in r.getMessage() for r in logs.records)


@pytest.mark.parametrize("stage_in_background", [False, True])
def test_async_save_writes_the_state_of_the_save_call(tmp_path, monkeypatch, stage_in_background):
    slow_stage = DefaultStager._stage

    def late_stage(self, state_dict, **kwargs):  # the copy starts after the next step would have begun
        time.sleep(0.3)
        return slow_stage(self, state_dict, **kwargs)

    monkeypatch.setattr(DefaultStager, "_stage", late_stage)
    model, optimizer, scheduler = _model()
    _train(model, optimizer, scheduler, steps=2)
    sync = Checkpointer(tmp_path / "sync", [model], optimizer, stateful={"scheduler": scheduler})
    sync.save("model_0000002", 2)
    checkpointer = Checkpointer(tmp_path / "async", [model], optimizer, stateful={"scheduler": scheduler},
                                async_save=True, stage_in_background=stage_in_background)
    at_save, schedule_at_save = _snapshot(model, optimizer), scheduler.state_dict()
    assert checkpointer.poll() is None  # nothing pending: no work, no collective
    checkpointer.save("model_0000002", 2)
    if stage_in_background:
        _train(model, optimizer, scheduler)  # the optimizer's step waits for the copy
    else:
        with torch.no_grad():  # save() returned: the state is staged, however the tensors change now
            for tensor in [*model.parameters(), *(v for s in optimizer.state.values() for v in s.values())]:
                tensor.add_(1.0)
        scheduler.step()
    assert not _equal(_snapshot(model, optimizer), at_save)
    # not committed before poll/wait, whatever the background thread has done
    assert checkpointer.pending == tmp_path / "async" / "model_0000002"
    assert not (tmp_path / "async" / "model_0000002").exists()
    assert commit.pointed_to(tmp_path / "async") is None
    assert checkpointer.wait() == tmp_path / "async" / "model_0000002"
    assert checkpointer.pending is None and checkpointer.poll() is None
    assert checkpointer.find_resumable() == tmp_path / "async" / "model_0000002"
    written, iteration, schedule = _resumed(tmp_path / "async" / "model_0000002")
    reference, _, _ = _resumed(tmp_path / "sync" / "model_0000002")
    assert iteration == 2 and schedule == schedule_at_save
    assert _equal(written, at_save) and _equal(written, reference)
    manifest = json.loads((tmp_path / "async" / "model_0000002" / commit.MANIFEST).read_text())
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "trainer_state_rank0.pt"]


def test_async_poll_commits_once_written_and_prune_waits(tmp_path):
    model, optimizer, _ = _model()
    checkpointer = Checkpointer(tmp_path, [model], optimizer, async_save=True)
    _train(model, optimizer)
    checkpointer.save("model_0000001", 1)
    while checkpointer.poll() is None:
        _train(model, optimizer)
    assert commit.pointed_to(tmp_path) == tmp_path / "model_0000001"
    checkpointer.save("model_0000002", 2)
    checkpointer.prune(1)  # deferred: the pending one is not committed yet, model_0000001 stays
    assert (tmp_path / "model_0000001").is_dir()
    _train(model, optimizer)
    checkpointer.save("model_0000003", 3)  # waits for model_0000002 to commit (and prunes) first
    assert not (tmp_path / "model_0000001").exists() and (tmp_path / "model_0000002").is_dir()
    assert checkpointer.wait() == tmp_path / "model_0000003"
    assert checkpointer.find_resumable() == tmp_path / "model_0000003"


def test_failed_async_write_is_never_committed(tmp_path, monkeypatch):
    checkpointer = _saved(tmp_path, [1], async_save=True)

    def broken(staged: Path, rank: int) -> dict:
        raise OSError(f"disk full while reading {staged}")

    monkeypatch.setattr(commit, "record_files", broken)
    checkpointer.save("model_0000002", 2)
    with pytest.raises(RuntimeError, match=r"model_0000002 was not saved: rank 0: OSError: disk full"):
        checkpointer.wait()
    assert commit.pointed_to(tmp_path) == tmp_path / "model_0000001"
    assert checkpointer.find_resumable() == tmp_path / "model_0000001"


def _save_and_die(output_dir: str) -> None:
    torch.set_num_threads(1)
    model, optimizer, _ = _model()
    checkpointer = Checkpointer(output_dir, [model], optimizer, async_save=True)
    checkpointer.save("model_0000002", 2)
    os._exit(0)  # killed while the write is pending: no poll, no wait, no exit handlers


def test_killed_while_async_write_is_pending_commits_nothing(tmp_path):
    _saved(tmp_path, [1])
    child = multiprocessing.get_context("fork").Process(target=_save_and_die, args=(str(tmp_path),))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert commit.pointed_to(tmp_path) == tmp_path / "model_0000001"
    assert not (tmp_path / "model_0000002").exists() and (tmp_path / "model_0000002.tmp").is_dir()
    checkpointer = Checkpointer(tmp_path, [nn.Linear(2, 2)])
    checkpointer.remove_incomplete()
    assert not (tmp_path / "model_0000002.tmp").exists()
    assert checkpointer.find_resumable() == tmp_path / "model_0000001"


# ----------------------------------------------------------------------- 2 ranks, tp-sharded
def _tp_model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    from libai_zoo import distributed, layers

    torch.manual_seed(seed)
    model = distributed.shard(nn.Sequential(layers.Linear(16, 32, parallel="col"), layers.Linear(32, 16, parallel="row")))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _two_ranks(output_dir: str) -> dict:
    import torch.distributed as dist

    from libai_zoo import distributed

    group = distributed.init(tp=2).world_group
    rank, out = dist.get_rank(), Path(output_dir)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("libai_zoo")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)

    model, optimizer = _tp_model()
    snapshots, polls = {}, 0
    sync = Checkpointer(out, [model], optimizer, group=group)
    asynchronous = Checkpointer(out, [model], optimizer, async_save=True, group=group)
    background = Checkpointer(out, [model], optimizer, async_save=True, stage_in_background=True, group=group)
    for iteration, checkpointer in [(1, sync), (2, asynchronous), (3, background)]:
        _train(model, optimizer)
        snapshots[iteration] = _snapshot(model, optimizer)
        checkpointer.save(f"model_{iteration:07d}", iteration)
        while checkpointer.poll() is None and checkpointer.pending is not None:
            _train(model, optimizer)  # training goes on while the write does
            polls += 1
    result = {"polls": polls, "newest": sync.find_resumable()}
    for iteration in (1, 2, 3):
        fresh, fresh_optimizer = _tp_model(seed=1)
        _train(fresh, fresh_optimizer)
        result[f"iteration_{iteration}"] = Checkpointer(out, [fresh], fresh_optimizer, group=group).resume(
            out / f"model_{iteration:07d}")
        result[f"equal_{iteration}"] = _equal(_snapshot(fresh, fresh_optimizer), snapshots[iteration])
    if rank == 1:
        _flip_byte(out / "model_0000003" / "__1_0.distcp")
    dist.barrier()
    records.clear()
    result["after_flip"] = asynchronous.find_resumable()
    result["warnings"] = list(records)
    if rank == 0:
        _truncate(out / "model_0000002" / "__0_0.distcp")
    dist.barrier()
    result["after_truncate"] = background.find_resumable()
    result["at_most_1"] = sync.find_resumable(at_most=1)
    result["manifest_files"] = sorted(json.loads((out / "model_0000002" / commit.MANIFEST).read_text())["files"])
    logger.removeHandler(handler)
    return result


@pytest.mark.slow
def test_two_ranks_sharded_sync_and_async_fall_back_alike(tmp_path):
    results = run_forked(_two_ranks, 2, str(tmp_path))
    for rank, result in enumerate(results):
        assert result["newest"] == tmp_path / "model_0000003", rank
        assert [result[f"iteration_{i}"] for i in (1, 2, 3)] == [1, 2, 3]
        assert all(result[f"equal_{i}"] for i in (1, 2, 3)), rank
        assert result["after_flip"] == tmp_path / "model_0000002", rank
        assert any("model_0000003" in w and "__1_0.distcp has CRC-32" in w for w in result["warnings"]), rank
        assert result["after_truncate"] == tmp_path / "model_0000001", rank
        assert result["at_most_1"] == tmp_path / "model_0000001", rank
        assert result["manifest_files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "trainer_state_rank0.pt",
                                            "trainer_state_rank1.pt"]
