"""Every command the READMEs and the recipes' docstrings give runs as written and exits 0.

The commands are read from the files themselves (`documented_commands`), so a new line in the
docs is a new test. Each block of commands (one shell fence, one docstring) runs in its own
working directory, in the documented order, so that a command that continues an earlier one
(resumes its run, converts its checkpoint, loads its adapter) finds what that one wrote; `data/`,
`projects/` and `tools/` are the repository's, `output/` is the block's own. A block whose commands
all run, in the same order, within another block is covered by that one.

Each command runs as written, with the recipe's hooks (the end-of-run sample too), shortened:
a training run trains 2 steps past its output directory's newest checkpoint, evaluates 1 batch
and samples 4 tokens; `train_loop.py` trains 2 steps; a long-context recipe runs at 1,024 tokens
(`SHORTER`).
`/path/to/...` (your own model) is the block's stand-in (`PLACEHOLDERS`). `python X` runs X in
this process (as `__main__`, with its argv); `torchrun --nproc_per_node=N X` and `accelerate
launch --num_processes N X` run X in N processes forked from this one with the environment
torchrun gives its workers (`tests/test_torchrun.py` and `tests/test_accelerate.py` launch the
real launchers); `NOT_RUN` says why a few are not run here. A test also fails when a table
below names a command the docs no longer give.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import re
import runpy
import shlex
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from documented_commands import ROOT, Block, Command, documented_blocks
from libai_zoo.checkpoint import commit
from libai_zoo.config import LazyConfig

pytestmark = pytest.mark.system

#: a stand-in for your own model directory: the block's make_tiny_hf_model.py output
PLACEHOLDERS = {
    "/path/to/llama": "output/tiny_llama",
    "/path/to/bert": "output/tiny_bert",
    "/path/to/gemma-3-4b-it": "output/tiny_gemma3",
    "/path/to/Qwen3-0.6B": "output/tiny_qwen3",
    "/path/to/Qwen3-30B-A3B": "output/tiny_qwen3_moe",
}
#: commands not run here, and why
NOT_RUN = {
    "python3 -m venv .venv '&&' . .venv/bin/activate '&&' pip install torch==2.13.0 -e '.[test]' '&&' "
    "python tools/train.py projects/gpt2_pretrain/config.py": "the set-up and main job: .ci/run runs it on a fresh "
                                                              "machine, and the main job is gpt2_pretrain's block",
    "ruff check . '&&' pytest -n 2 --dist loadfile --no-loadscope-reorder": "the linter and test command itself: "
                                                                            ".ci/run runs it",
    "torchrun --nnodes=16 --nproc_per_node=8 --max-restarts=3 --rdzv-backend=c10d '--rdzv-endpoint=$HEAD:29500' "
    "'--rdzv-id=$SLURM_JOB_ID' tools/train.py CONFIG.py dist.tp=8 dist.pp=2 dist.timeout=300":
        "128 GPUs on 16 nodes; tests/test_resilience.py restarts runs under torchrun's static, standalone and c10d "
        "rendezvous on this machine",
    # the planner's reports and its Mixtures of Experts at scale: minutes of enumeration on 2 cores each
    "python projects/layout_planning/published_layouts.py": "a report (the README's table, 2 minutes): its layouts "
                                                            "are planned by tests/test_planner.py and dry-run below",
    "python projects/layout_planning/long_sequence_recipes.py": "a report (40 s): tests/test_planner.py::"
                                                                "test_nvidias_llama3_70b_recipe_fits_an_h100 plans its "
                                                                "70B row, and its 405B dry run is run below",
    "python tools/plan.py projects/layout_planning/deepseek_v3.py --world-size 1024 --device h100":
        "6 minutes of DeepSeek-V3's 389,872 expert-parallel layouts; tests/test_planner.py::"
        "test_moe_plan_enumerates_ep_and_states_its_routing plans a tiny MoE the same way, and the dry run below "
        "builds this model at 1,024 ranks",
    "python tools/plan.py projects/layout_planning/qwen3_30b_a3b.py --world-size 64 --device h100":
        "2.5 minutes of expert-parallel layouts; tests/test_planner.py::test_moe_plan_enumerates_ep_and_states_its_routing "
        "plans this config at a tiny size, and the dry run below builds it at 64 ranks",
}
#: what a program's runs are shortened by (besides a training run's steps)
SHORTER = {
    "projects/long_context/config.py": ["dataloader.train.seq_len=1024", "dataloader.test.seq_len=1024"],
    "projects/accelerate_loop/train_loop.py": ["--steps", "2"],
}
STEPS, EVAL_BATCHES, SAMPLE_TOKENS = 2, 1, 4
DEADLINE_S = 300  # a multi-process command that hangs fails here, not at CI's limit


def _moe_pretrain_records(output: Path) -> None:
    """A Mixture of Experts' step logs its expert balance: in metrics.json and on the console line."""
    record = json.loads((output / "moe_pretrain" / "metrics.json").read_text().splitlines()[-1])
    assert {"aux_loss", "moe/imbalance", "moe/dropped_tokens"} <= set(record), record
    assert "  aux_loss: " in (output / "moe_pretrain" / "log.txt").read_text()


def _auto_layout_agrees(output: Path) -> None:
    """`--auto-layout` under torchrun: rank 0 plans (measuring this CPU's compute, optimizer step and
    gloo link into the cache) and every rank runs its pick, for its reasons, at the layout it logs."""
    chosen = []
    for rank, name in enumerate(("log.txt", "log.txt.rank1")):
        log = (output / "gpt2_auto" / name).read_text()
        assert log.count("dist.auto: ") == 1, name
        why = log.split("dist.auto: ", 1)[1]
        short = re.match(r"(.+?) is the fastest of (\d+) layouts that fit \((\d+) considered", why)
        assert short, why[:300]
        best = dict(item.split("=", 1) for item in re.search(r"^best: (.+)$", why, re.MULTILINE).group(1).split())
        context = re.search(r"ParallelContext\(world_size=2, dp=(\d), tp=(\d), pp=(\d), rank=(\d)[^)]*\)", log)
        assert context and int(context.group(4)) == rank
        assert [context.group(i) for i in (1, 2, 3)] == [best["dist.dp"], best["dist.tp"], best["dist.pp"]]
        cp = f" cp{best['dist.cp']}" if best["dist.cp"] != "1" else ""  # the planner may split the sequence
        assert short.group(1).startswith(f"dp{best['dist.dp']}{cp} tp{best['dist.tp']} pp{best['dist.pp']} ")
        micro = re.search(r"; (\d+) micro-batch\(es\) of (\d+) per step, global batch (\d+)", log)
        assert micro and micro.group(2) == best["train.micro_batch_size"]
        assert int(micro.group(1)) * int(micro.group(2)) * int(best["dist.dp"]) == int(micro.group(3))
        chosen.append((why.split("\n[")[0], re.sub(r"rank=\d", "", context.group(0)), micro.group(0)))
    assert chosen[0] == chosen[1]  # every rank runs rank 0's pick, for rank 0's reasons
    entries = [json.loads(key) for key in json.loads(Path(os.environ["LIBAI_ZOO_CACHE"]).read_text())]
    assert {entry["what"] for entry in entries} >= {"compute", "optimizer", "gloo"}


#: what a block's run must also have written, by the file that documents it
AFTER = {"projects/moe_pretrain/README.md": _moe_pretrain_records, "docs/planner.md": _auto_layout_agrees}


def _substituted(text: str) -> str:
    for placeholder, stand_in in PLACEHOLDERS.items():
        text = text.replace(placeholder, stand_in)
    return text


def _covered(block: Block, others: list[Block]) -> bool:
    """Whether every command of `block` runs, in the same order, within a larger block."""
    texts = [_substituted(c.text) for c in block.commands]
    for other in others:
        if other is block or len(other.commands) < len(texts):
            continue
        rest = iter(_substituted(c.text) for c in other.commands)
        if all(any(text == candidate for candidate in rest) for text in texts) and (
                len(other.commands) > len(texts) or other.name < block.name):
            return True
    return False


BLOCKS = documented_blocks()
RUN = {block.name: block for block in BLOCKS if not _covered(block, BLOCKS)
       and any(c.text not in NOT_RUN for c in block.commands)}


def _launch(words: list[str]) -> tuple[int, dict[str, str], list[str]]:
    """(processes, environment, [script, *args]) of a command as written; a launcher option this test
    does not know fails, rather than being misread."""
    env = {}
    while "=" in words[0] and words[0].split("=")[0].isupper():
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    program, rest = words[0], words[1:]
    if program in ("python", "python3"):
        return 1, env, rest
    nproc, options = 1, []
    if program == "torchrun":
        while rest[0].startswith("--"):
            options.append(rest.pop(0))
        for option in options:
            key, _, value = option.partition("=")
            assert key in ("--nproc_per_node", "--nproc-per-node", "--standalone"), \
                f"torchrun {option}: teach test_documented_commands.py what it means here"
            nproc = int(value) if value else nproc
        return nproc, env, rest
    if program == "accelerate" and rest[0] == "launch":
        rest = rest[1:]
        while rest[0].startswith("--"):
            key, _, value = rest.pop(0).partition("=")
            assert key in ("--multi_gpu", "--num_processes"), \
                f"accelerate launch {key}: teach test_documented_commands.py what it means here"
            if key == "--num_processes":
                nproc = int(value or rest.pop(0))
        return nproc, env, rest
    raise AssertionError(f"no launcher for {program!r}: teach test_documented_commands.py to run it")


def _shortened(argv: list[str]) -> list[str]:
    """`argv` ([script, *args]) with the shortening overrides of its program and recipe."""
    script, args = argv[0], argv[1:]
    extra = [word for name in (script, *args) for word in SHORTER.get(name, [])]
    if script == "tools/train.py":
        config = LazyConfig.apply_overrides(LazyConfig.load(args[0]), [a for a in args[1:] if "=" in a] + extra)
        newest = commit.pointed_to(Path(config.train.output_dir))
        done = int(newest.name.removeprefix("model_")) if newest is not None else 0
        extra += [f"train.max_iter={done + STEPS}", f"train.eval.max_batches={EVAL_BATCHES}"]
        extra += [f"hooks.{i}.max_new_tokens={SAMPLE_TOKENS}" for i, hook in enumerate(config.get("hooks", []))
                  if "max_new_tokens" in hook]
    return [script, *args, *extra]


def _run_script(argv: list[str]) -> None:
    """Run a script as its `__main__` with `argv`; a non-zero exit fails."""
    saved = sys.argv
    sys.argv = list(argv)
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as done:
        assert done.code in (None, 0), f"{shlex.join(argv)} exited {done.code}"
    finally:
        sys.argv = saved


def _worker(rank: int, world_size: int, port: int, cwd: str, env: dict[str, str], argv: list[str]) -> None:
    """A worker as torchrun starts it: the test's directory and environment, its ranks, and the agent's
    store (the test's) to meet in."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    gc.freeze()  # the fork server's imports: the collector scans only what the run makes
    torch.set_num_threads(1)
    _run_script(argv)


#: what the fork server imports once, so that each worker forked from it starts warm (`datasets`: the
#: recipes whose data it reads; libai_zoo.data imports it only for them)
multiprocessing.set_forkserver_preload([__name__, "libai_zoo.engine", "libai_zoo.models", "transformers", "datasets"])


def _run_workers(nproc: int, env: dict[str, str], argv: list[str]) -> None:
    """`argv` in `nproc` workers meeting in a store this process holds, as torchrun's agent does (no
    port to race for); a run past the deadline is killed and fails. The workers fork from a fork
    server, never from this process: a fork copies only the forking thread, and this one has others
    (the store's server, gloo's and OpenMP's from earlier runs, tqdm's monitor) whose held locks
    hung a forked worker before its first line now and then."""
    store = dist.TCPStore("127.0.0.1", 0, nproc + 1, is_master=True, wait_for_workers=False)
    workers = mp.start_processes(_worker, args=(nproc, store.port, os.getcwd(), {**os.environ, **env}, argv),
                                 nprocs=nproc, start_method="forkserver", join=False)
    deadline = time.monotonic() + DEADLINE_S
    while not workers.join(timeout=1):
        if time.monotonic() > deadline:
            for process in workers.processes:
                process.kill()
            raise AssertionError(f"{shlex.join(argv)} on {nproc} processes ran past {DEADLINE_S} s")


def run_command(command: Command) -> None:
    """Run one documented command (placeholders substituted, shortened) in the current directory."""
    nproc, env, argv = _launch(shlex.split(_substituted(command.text)))
    argv = _shortened(argv)
    start = time.perf_counter()
    if nproc == 1:
        with pytest.MonkeyPatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            _run_script(argv)
    else:
        _run_workers(nproc, env, argv)
    print(f"$ {' '.join(f'{k}={v}' for k, v in env.items())} {shlex.join(argv)}  ({nproc} process(es), "
          f"{time.perf_counter() - start:.1f} s)", flush=True)


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    """What every block may share: the tokenized data's cache, the planner's measured timings."""
    return tmp_path_factory.mktemp("documented_commands_cache")


@pytest.mark.parametrize("name", list(RUN))
def test_documented_block_runs(name, shared, tmp_path, monkeypatch):
    for folder in ("data", "projects", "tools"):
        (tmp_path / folder).symlink_to(ROOT / folder)
    (tmp_path / "output").mkdir()
    (tmp_path / "output" / "cache").symlink_to(shared)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LIBAI_ZOO_CACHE", str(shared / "planner.json"))
    for command in RUN[name].commands:
        if command.text not in NOT_RUN:
            run_command(command)
    check = AFTER.get(RUN[name].source)
    if check is not None:
        check(tmp_path / "output")


def test_every_recipe_is_documented_and_every_table_entry_is_used():
    """A recipe whose commands the docs do not give fails, and so does a table entry for a
    command (or a placeholder, or a program) that the docs no longer give."""
    texts = [c.text for block in BLOCKS for c in block.commands]
    recipes = {str(path.relative_to(ROOT)) for path in ROOT.glob("projects/*/config.py")}
    assert not {r for r in recipes if not any(r in text for text in texts)}
    assert not {text for text in NOT_RUN if text not in texts}
    assert not {p for p in PLACEHOLDERS if not any(p in text for text in texts)}
    assert not {name for name in SHORTER if not any(name in text for text in texts)}
    assert not {source for source in AFTER if not any(block.source == source for block in RUN.values())}
