"""Hugging Face accelerate with the zoo: `accelerate launch --multi_gpu` runs tools/train.py exactly as
torchrun does (it is torch's elastic launcher underneath), and a plain accelerate loop over a zoo
model (projects/accelerate_loop) gives DefaultTrainer's losses at dp2 from the same Hugging Face
directory, data order and optimizer. 2 gloo processes on CPU; no accelerate config file."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from libai_zoo.models import GPT2Config, GPT2LMHeadModel
from support.recipes import config_path
from trainer_runs import losses

ROOT = Path(__file__).resolve().parents[1]
MICRO_BATCH, PROCESSES, ACCUMULATION, STEPS, SEQ_LEN, WARMUP = 2, 2, 2, 6, 32, 2

CONFIG = config_path("pretrained_on_text.py")


def recipe_overrides(workdir: Path) -> list[str]:
    """The config's keys for this test, as tools/train.py takes them on the command line: the GPT-2
    directory, the text, the batches and the schedule that projects/accelerate_loop's flags repeat."""
    return [
        "model._target_=libai_zoo.models.GPT2LMHeadModel.from_pretrained", f"model.path={workdir / 'hf'}",
        f"dataloader.train.text_file={workdir / 'text.txt'}", f"dataloader.train.cache_dir={workdir / 'cache'}",
        f"dataloader.train.seq_len={SEQ_LEN}", f"train.max_iter={STEPS}", f"train.micro_batch_size={MICRO_BATCH}",
        f"train.global_batch_size={MICRO_BATCH * PROCESSES * ACCUMULATION}", "train.log_period=1",
        "train.checkpoint.period=100", "train.clip_grad_norm=1.0", f"train.scheduler.warmup_iters={WARMUP}",
        "train.scheduler.min_lr_ratio=0.0", "optim.lr=1e-3", "optim.betas=[0.9,0.95]"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A tiny GPT-2 Hugging Face directory (dropout off) and a slice of the corpus."""
    root = tmp_path_factory.mktemp("accelerate")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_positions=SEQ_LEN, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                               eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
                    ).save_pretrained(root / "hf")
    documents = (ROOT / "data/corpus/python_docs.txt").read_text().split("\n\n")[:300]
    (root / "text.txt").write_text("\n\n".join(documents))
    (root / "home").mkdir()
    return root


def launch_env(workdir: Path) -> dict:
    """One thread per process; HOME and HF_HOME in the test's folder, so no accelerate config of the
    user's (~/.cache/huggingface/accelerate/default_config.yaml) changes the launch."""
    return dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(workdir), HOME=str(workdir / "home"),
                HF_HOME=str(workdir / "home" / "hf"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def accelerate_launch(script: Path, *args: str) -> list[str]:
    """`accelerate launch` at 2 processes, every choice a flag (no config file)."""
    return [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu",
            "--num_processes", str(PROCESSES), "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no", "--main_process_port", str(free_port()), str(script), *args]


def run(command: list[str], env: dict) -> subprocess.CompletedProcess:
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def train(workdir: Path, launcher: list[str], name: str) -> Path:
    out = workdir / name
    run([*launcher, str(ROOT / "tools/train.py"), str(CONFIG), *recipe_overrides(workdir), f"train.output_dir={out}",
         "dist.dp=2"], launch_env(workdir))
    return out


@pytest.fixture(scope="module")
def torchrun_run(workdir) -> Path:
    """DefaultTrainer at dp2 under torchrun: the reference."""
    return train(workdir, [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={PROCESSES}",
                           f"--master-port={free_port()}"], "torchrun")


LAYOUT = "ParallelContext(world_size=2, dp=2, tp=1, pp=1, rank=0, device=cpu"


@pytest.mark.slow
@pytest.mark.system
def test_accelerate_launch_runs_train_py_as_torchrun_does(workdir, torchrun_run):
    launcher = accelerate_launch(ROOT / "tools/train.py")[:-1]  # the script and its arguments follow
    out = train(workdir, launcher, "accelerate")
    got, want = losses(out), losses(torchrun_run)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert max(abs(got[i] - want[i]) for i in want) <= 1e-6, (got, want)
    for run_dir in (out, torchrun_run):
        assert LAYOUT in (run_dir / "log.txt").read_text()


@pytest.mark.slow
@pytest.mark.system
def test_accelerate_loop_gives_the_trainers_losses(workdir, torchrun_run):
    """projects/accelerate_loop/train_loop.py (Accelerator.prepare: DDP, the prepared loader sharding the
    global micro-batch order, accumulate, backward, clip_grad_norm_) against DefaultTrainer at dp2."""
    command = accelerate_launch(
        ROOT / "projects/accelerate_loop/train_loop.py", "--model", str(workdir / "hf"),
        "--text", str(workdir / "text.txt"), "--cache-dir", str(workdir / "cache"), "--seq-len", str(SEQ_LEN),
        "--micro-batch-size", str(MICRO_BATCH), "--grad-accum", str(ACCUMULATION), "--steps", str(STEPS),
        "--lr", "1e-3", "--warmup", str(WARMUP), "--min-lr-ratio", "0", "--seed", "42")
    env = dict(launch_env(workdir), ACCELERATE_USE_CPU="1")  # no GPU: else accelerate runs each process alone
    printed = run(command, env).stdout
    got = {int(step): float(loss) for step, loss in re.findall(r"^step (\d+)/\d+  loss (\S+)", printed, re.M)}
    want = losses(torchrun_run)
    assert sorted(got) == list(range(1, STEPS + 1)), printed
    assert max(abs(got[i] - want[i]) for i in want) <= 1e-5, (got, want)


@pytest.mark.slow
@pytest.mark.system
def test_the_loop_refuses_to_run_each_process_alone(workdir):
    """Without a GPU and without ACCELERATE_USE_CPU, accelerate would let each launched process train
    alone on all the data (num_processes 1); the example stops and says what to set."""
    command = accelerate_launch(ROOT / "projects/accelerate_loop/train_loop.py", "--model", str(workdir / "hf"))
    env = launch_env(workdir)
    env.pop("ACCELERATE_USE_CPU", None)
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "launch with ACCELERATE_USE_CPU=1" in result.stderr
