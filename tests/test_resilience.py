"""A run survives what a long job meets, on its own: ranks killed under torchrun restarts (static,
standalone and c10d rendezvous, one agent or two), SIGTERM, a damaged checkpoint, divergence, a
hung rank, and inputs that would crash late. Every recovered run is compared with an
uninterrupted one: the same losses (≤ 1e-6) and the same samples, each trained once, in order."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from libai_zoo.config import DistConfig, LazyCall, LazyConfig
from libai_zoo.data import IndexedDatasetWriter, IndexedGPTDataset, MicroBatchSampler
from libai_zoo.engine import DivergenceError
from recorded_data import attempts
from support.forked import run_forked
from support.recipes import config_path
from trainer_runs import losses, records, run_trainer

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
MAX_ITER, PER_RANK_STEP = 8, 2  # micro-batch 2, global batch 4: 2 samples per dp rank and step at dp2, 4 at dp1


@pytest.fixture(scope="module")
def config_file() -> Path:
    return config_path("recorded_gpt2.py")


def load(config_file: Path, output_dir: Path, *overrides: str):
    return LazyConfig.apply_overrides(LazyConfig.load(str(config_file)), [f"train.output_dir={output_dir}",
                                                                            *overrides])


def _reference(config_file: Path, output_dir: Path, overrides: list[str]) -> None:
    run_trainer(load(config_file, output_dir, *overrides))


@pytest.fixture(scope="module")
def references(config_file, tmp_path_factory) -> dict[str, Path]:
    """Uninterrupted runs at tp2 and dp2 (forked gloo workers, no torchrun)."""
    out = {}
    for name, world, overrides in (("tp2", 2, ["dist.tp=2"]), ("dp2", 2, ["dist.dp=2"])):
        out[name] = tmp_path_factory.mktemp(f"reference_{name}")
        run_forked(_reference, world, config_file, out[name], overrides)
    return out


def torchrun_env(tmp_path: Path, fault: str | None = None) -> dict:
    env = dict(os.environ, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    env.pop("LIBAI_ZOO_FAULT", None)
    if fault:
        env["LIBAI_ZOO_FAULT"] = fault
    return env


def torchrun(launcher: list[str], config_file: Path, output_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launcher, str(ROOT / "tools/train.py"), str(config_file),
            f"train.output_dir={output_dir}", *overrides]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def assert_same_run(output_dir: Path, reference: Path, ranks: list[int], per_rank_step: int) -> None:
    """Same losses as the reference at every step; each rank read, over its attempts, exactly the
    samples the reference read, in order (the last attempt resumed at its checkpoint's step)."""
    got, want = losses(output_dir), losses(reference)
    assert sorted(got) == list(range(1, MAX_ITER + 1))
    assert max(abs(got[i] - want[i]) for i in want) <= 1e-6, (got, want)
    for rank in ranks:
        runs = attempts(output_dir / "samples", rank)
        expected = [i for run in attempts(reference / "samples", rank) for i in run]
        assert len(runs) >= 2, "the run was not restarted"
        resumed_at = MAX_ITER - len(runs[-1]) // per_rank_step  # the steps the last attempt did not redo
        log = (output_dir / ("log.txt" if rank == 0 else f"log.txt.rank{rank}")).read_text()
        assert resumed_at > 0 and f"resumed from {output_dir / f'model_{resumed_at:07d}'}" in log
        kept = [i for run in runs[:-1] for i in run]
        assert kept[:resumed_at * per_rank_step] == expected[:resumed_at * per_rank_step]
        assert runs[-1] == expected[resumed_at * per_rank_step:]


def kill_step(seed: int) -> int:
    step = random.Random(seed).randint(3, MAX_ITER - 1)  # after the first checkpoint (step 2)
    print(f"killing at step {step}")
    return step


@pytest.mark.slow
@pytest.mark.system
def test_kill_a_rank_static_rendezvous_tp2(config_file, references, tmp_path):
    out = tmp_path / "run"
    env = torchrun_env(tmp_path, f"kill:rank=1:step={kill_step(1)}")
    result = subprocess.run(torchrun(["--nproc_per_node=2", "--max-restarts=2", f"--master-port={free_port()}"],
                                     config_file, out, "dist.tp=2"),
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert_same_run(out, references["tp2"], [0, 1], PER_RANK_STEP * 2)
    goodput = records(out)[-1]
    assert goodput["goodput/restarts"] == 1 and 0 < goodput["goodput/ratio"] < 1


@pytest.mark.slow
@pytest.mark.system
def test_kill_a_rank_standalone_dp2(config_file, references, tmp_path):
    """Rank 1 dies; rank 0 is a straggler (0.3 s late with its data every step), which the
    console line names."""
    out = tmp_path / "run"
    env = torchrun_env(tmp_path, f"kill:rank=1:step={kill_step(2)}; slow:rank=0:step=1:seconds=0.3")
    result = subprocess.run(torchrun(["--standalone", "--nproc_per_node=2", "--max-restarts=2"], config_file, out,
                                     "dist.dp=2"), env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert_same_run(out, references["dp2"], [0, 1], PER_RANK_STEP)
    lines = [line for line in (out / "log.txt").read_text().splitlines() if "(slowest " in line]
    assert len(lines) >= MAX_ITER and sum("(slowest 0)" in line for line in lines) >= len(lines) - 2, lines


@pytest.mark.slow
@pytest.mark.system
def test_kill_a_rank_of_one_of_two_agents_c10d(config_file, references, tmp_path):
    out = tmp_path / "run"
    env = torchrun_env(tmp_path, f"kill:rank=1:step={kill_step(3)}")
    launcher = ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{free_port()}",
                "--rdzv-id=resilience", "--max-restarts=2"]
    agents = [subprocess.Popen(torchrun(launcher, config_file, out, "dist.tp=2"), env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [agent.communicate(timeout=600)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert_same_run(out, references["tp2"], [0, 1], PER_RANK_STEP * 2)


@pytest.mark.slow
@pytest.mark.system
def test_sigterm_saves_then_the_restart_resumes(config_file, references, tmp_path):
    """The scheduler's SIGTERM to torchrun: the workers finish the step, save, exit; the same command
    run again resumes there."""
    out = tmp_path / "run"
    command = torchrun(["--nproc_per_node=2"], config_file, out, "dist.tp=2", "train.checkpoint.period=100")
    agent = subprocess.Popen(command, env=torchrun_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    deadline = time.monotonic() + 300
    while len(losses(out)) < 3 and time.monotonic() < deadline and agent.poll() is None:
        time.sleep(0.05)
    agent.send_signal(signal.SIGTERM)
    agent.communicate(timeout=120)
    stopped = max(losses(out))
    assert stopped < MAX_ITER and (out / "last_checkpoint").read_text() == f"model_{stopped:07d}"
    assert f"stopped on SIGTERM after {stopped} steps" in (out / "log.txt").read_text()
    result = subprocess.run(command, env=torchrun_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    got, want = losses(out), losses(references["tp2"])
    assert max(abs(got[i] - want[i]) for i in want) <= 1e-6
    assert f"resumed from {out / f'model_{stopped:07d}'} at iteration {stopped}" in (out / "log.txt").read_text()


STOPPED_RANK_TIMEOUT = 5


@pytest.fixture(scope="module", autouse=True)
def stopped_rank_job(request, config_file, tmp_path_factory):
    """The hung-rank job, started as the module begins when its test is selected: it spends most of
    its ~40 s waiting (the collective timeout, then torchrun's fixed 30 s before it SIGKILLs a
    worker that ignores SIGTERM; `--shutdown-timeout` does not shorten that path), time the
    module's other tests use. Yields (the process, its output directory, its seconds to exit)."""
    if not any(item.originalname == "test_a_stopped_rank_ends_the_job_naming_it" for item in request.session.items):
        yield None
        return
    tmp = tmp_path_factory.mktemp("stopped_rank")
    out, started, ended = tmp / "run", time.monotonic(), []
    with open(tmp / "torchrun.log", "w") as console:
        job = subprocess.Popen(torchrun(["--nproc_per_node=2"], config_file, out, "dist.tp=2",
                                        f"dist.timeout={STOPPED_RANK_TIMEOUT}"),
                               env=torchrun_env(tmp, "hang:rank=1:step=3"), stdout=console, stderr=subprocess.STDOUT)

    def wait() -> None:
        job.wait()
        ended.append(time.monotonic() - started)

    watcher = threading.Thread(target=wait, daemon=True)
    watcher.start()
    yield job, out, watcher, ended
    if job.poll() is None:
        job.kill()


@pytest.mark.slow
@pytest.mark.system
def test_a_stopped_rank_ends_the_job_naming_it(stopped_rank_job):
    job, out, watcher, ended = stopped_rank_job
    watcher.join(timeout=300)
    assert job.returncode not in (None, 0)
    log = (out / "log.txt").read_text()
    assert "rank 1 last seen" in log and "in step 2 (after the step" in log, log[-3000:]
    # start-up, the 5 s timeout and torchrun's 30 s before SIGKILL take 40-100 s (by the machine's load):
    # the default timeout would have ended it after more than 330
    assert ended and ended[0] < DistConfig.timeout, ended


def test_preemption_exit_code_and_resume_in_one_process(config_file, tmp_path):
    """SIGTERM in a single-process run: save after the step, exit 75; run again: same losses."""
    straight = tmp_path / "straight"
    run_trainer(load(config_file, straight))
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, str(ROOT / "tools/train.py"), str(config_file), f"train.output_dir={out}"],
                            env=torchrun_env(tmp_path, "term:rank=0:step=3"), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 75, result.stderr[-3000:]
    assert (out / "last_checkpoint").read_text() == "model_0000003"
    os.environ.pop("LIBAI_ZOO_FAULT", None)
    run_trainer(load(config_file, out), resume=True)
    got, want = losses(out), losses(straight)
    assert max(abs(got[i] - want[i]) for i in want) <= 1e-6
    first, second = attempts(out / "samples", 0)
    assert first[:12] + second == attempts(straight / "samples", 0)[0]  # 3 steps of 4 samples, then the rest


def test_damaged_newest_checkpoint_falls_back(config_file, tmp_path):
    straight = tmp_path / "straight"
    run_trainer(load(config_file, straight))
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        run_trainer(load(config_file, out), interrupt_after=6)
    data = sorted((out / "model_0000006").glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    trainer = run_trainer(load(config_file, out), resume=True)
    assert trainer.start_iter == 4
    assert f"checkpoint {out / 'model_0000006'} is damaged, skipping it: {data.name} has CRC-32" in \
        (out / "log.txt").read_text()
    got, want = losses(out), losses(straight)
    assert max(abs(got[i] - want[i]) for i in want) <= 1e-6


def test_divergence_stops_naming_the_steps_and_parameters(config_file, tmp_path, monkeypatch):
    monkeypatch.setenv("LIBAI_ZOO_FAULT", "nan:rank=0:step=3:count=9")
    out = tmp_path / "run"
    with pytest.raises(DivergenceError, match=r"steps 3\.\.5 had a non-finite loss") as error:
        run_trainer(load(config_file, out, "train.max_bad_steps=3"))
    assert "transformer.h.0." in str(error.value) and "train.on_divergence=rollback" in str(error.value)
    assert max(losses(out)) == 4  # the run stopped inside step 5


def test_divergence_rolls_back_and_skips_the_bad_batches(config_file, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    run_trainer(load(config_file, straight))
    monkeypatch.setenv("LIBAI_ZOO_FAULT", "nan:rank=0:step=5:count=2")
    out = tmp_path / "run"
    trainer = run_trainer(load(config_file, out, "train.max_bad_steps=2", "train.on_divergence=rollback"))
    log = (out / "log.txt").read_text()
    assert f"rolled back to {out / 'model_0000004'} (after 4 steps); skipping the 2 data batches read since it " \
           f"(steps 5..6)" in log
    sampler = iter(MicroBatchSampler(256, 2, seed=42, global_batch_size=4))
    batches = [next(sampler) + next(sampler) for _ in range(MAX_ITER + 2)]  # one process: 2 micro-batches a step
    # steps 1-6 read batches 1-6 (5 and 6 diverged); after the rollback to step 4, steps 5-8 read batches 7-10
    assert attempts(out / "samples", 0) == [[i for batch in batches for i in batch]]
    got, want = losses(out), losses(straight)
    assert all(abs(got[i] - want[i]) <= 1e-6 for i in range(1, 5))
    assert all(torch.isfinite(torch.tensor(got[i])) for i in range(5, MAX_ITER + 1))
    assert trainer.data.position.skipped_batches == 2
    assert records(out)[-1]["goodput/replayed_steps"] == 2


def test_bad_inputs_are_refused_before_the_first_step(config_file, tmp_path, monkeypatch):
    """Each gives one error naming the file or key and the fix, before any step, and the output
    directory holds at most the log."""
    corpus = tmp_path / "corpus"
    with IndexedDatasetWriter(corpus, np.uint16) as writer:
        writer.add_document(np.arange(200) % 128)
    indexed = LazyCall(IndexedGPTDataset)(prefix=str(corpus), seq_len=16)
    cases = {
        "token ids": (["model.config.vocab_size=64"], {}, rf"{corpus}.bin holds token ids up to 127, but the model's "
                                                          rf"vocabulary has 64"),
        "positions": (["dataloader.train.seq_len=32"], {}, r"seq_len = 32 tokens, but the model's learned position "
                                                           r"embeddings hold 16 positions"),
        "heads": (["dist.tp=3"], {"WORLD_SIZE": "3"}, r"cannot be split over dist.tp = 3"),
        "batch": (["train.global_batch_size=6", "dist.dp=2"], {"WORLD_SIZE": "2"}, r"global_batch_size = 6 is not"),
        "world": (["dist.tp=2"], {"WORLD_SIZE": "3"}, r"world size 3 does not match"),
        "pipeline": (["dist.pp=4", "train.global_batch_size=8"], {"WORLD_SIZE": "4"},
                     r"larger than the number of layers 2"),
    }
    for name, (overrides, env, message) in cases.items():
        out = tmp_path / name
        cfg = load(config_file, out)
        cfg.dataloader.train = indexed
        cfg = LazyConfig.apply_overrides(cfg, overrides)
        with monkeypatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            with pytest.raises(ValueError, match=message):
                run_trainer(cfg)
        assert not out.exists() or set(os.listdir(out)) <= {"log.txt"}, (name, os.listdir(out))
    assert not torch.distributed.is_initialized()


def test_fault_switch_is_parsed_strictly():
    from libai_zoo.engine.faults import Fault, parse_faults

    assert parse_faults("kill:rank=1:step=5; nan:rank=0:step=2:count=3") == [
        Fault("kill", 1, 5), Fault("nan", 0, 2, count=3)]
    with pytest.raises(ValueError, match="KIND:rank=R:step=K"):
        parse_faults("kill:rank=1")
    with pytest.raises(ValueError, match="kind 'explode'"):
        parse_faults("explode:rank=1:step=2")


def test_goodput_file_is_json_and_accounts_saves_and_evaluations(config_file, tmp_path):
    out = tmp_path / "run"
    cfg = load(config_file, out, "train.max_iter=2", "train.eval.period=1", "train.eval.max_batches=1")
    cfg.dataloader.test = cfg.dataloader.train
    run_trainer(cfg)
    account = json.loads((out / "goodput.json").read_text())
    assert account["restarts"] == 0 and account["last_iter"] == 2 and account["productive_s"] > 0
    # the stall of the save after step 2 and both evaluations, read from the trainer's records
    assert account["checkpoint_s"] > 0 and account["eval_s"] > 0 and list(account["productive_at"]) == ["2"]
    evaluated = [r["iteration"] for r in records(out) if "eval/loss" in r]
    assert evaluated == [1, 2]


class GoodputClock:
    """Drives the `Goodput` hook without a trainer: `now` is what time.time() returns in goodput.py."""

    def __init__(self, monkeypatch, out: Path):
        from types import SimpleNamespace

        from libai_zoo.engine import goodput
        self.now, self.out, self.namespace = 1000.0, out, SimpleNamespace
        monkeypatch.setattr(goodput, "time", SimpleNamespace(time=lambda: self.now))

    def attempt(self, start_iter: int = 0):
        """A process starts now, builds for 1 s and begins training (`before_train`)."""
        from libai_zoo.engine.goodput import Goodput
        hook = Goodput(self.out, self.now)
        hook.trainer = self.namespace(start_iter=start_iter, resumes=True, iter=start_iter, step_time=0.0,
                                      checkpoint_manager=self.namespace(last_saved=None), last_evaluation=None,
                                      storage=self.namespace(put_scalars=lambda **scalars: None))
        self.now += 1.0
        hook.before_train()
        return hook

    def step(self, hook, seconds: float = 0.5) -> None:
        self.now += seconds
        hook.trainer.step_time = seconds
        hook.after_step()
        hook.trainer.iter += 1


def test_goodput_idle_time_between_jobs_is_no_restart(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)  # plain `python tools/train.py`: new jobs
    clock = GoodputClock(monkeypatch, tmp_path)
    first = clock.attempt()
    clock.step(first)
    first.after_train()
    clock.now += 900.0  # idle until the next command, which resumes from the checkpoint
    second = clock.attempt(start_iter=1)
    clock.step(second)
    figures = second.figures()
    assert figures["restarts"] == 0 and figures["restart_lost_s"] == 0.0
    assert figures["wall_s"] == 1.5 and figures["productive_s"] == 0.5 and figures["ratio"] == 0.5 / 1.5


def test_goodput_torchrun_restarts_count_the_measured_gap_once(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    clock = GoodputClock(monkeypatch, tmp_path)
    clock.step(clock.attempt())  # one step (last sign of life at 1001.5), then the attempt dies
    clock.now += 8.5
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = clock.attempt()  # no checkpoint: goes back to step 0
    assert restarted.figures()["restarts"] == 1 and restarted.figures()["restart_lost_s"] == 9.5
    clock.now += 9.0  # this attempt dies before its first step
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    again = clock.attempt()
    clock.step(again)
    figures = again.figures()
    assert figures["restarts"] == 2 and figures["restart_lost_s"] == 9.5 + 10.0
    assert figures["replayed_steps"] == 1 and figures["wall_s"] == 21.5 >= figures["restart_lost_s"]


def test_goodput_a_restart_does_not_continue_an_earlier_jobs_account(tmp_path, monkeypatch):
    """Attempt 0 of a torchrun job died before it trained (before its goodput.json): its restart finds an
    earlier job's account, of another torchrun agent, and starts this job's own."""
    from libai_zoo.engine import goodput

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    clock = GoodputClock(monkeypatch, tmp_path)
    clock.step(clock.attempt())  # the earlier job
    clock.now += 3600.0
    monkeypatch.setattr(goodput.os, "getppid", lambda: -1)  # this job's torchrun agent
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    figures = clock.attempt().figures()
    assert figures["restarts"] == 0 and figures["restart_lost_s"] == 0.0 and figures["wall_s"] == 1.0
