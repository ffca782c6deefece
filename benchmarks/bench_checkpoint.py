"""How long a checkpoint stalls the training loop: synchronous save vs asynchronous save.

A stack of Linear layers (default 12 × 2048², 192 MiB fp32) with AdamW state (twice that) trains
on the CPU in one process; every few steps the `Checkpointer` saves it, in three modes taking
turns: synchronous; asynchronous (`async_save=True`: `save` returns once the state is copied, the
write, trainer state and checksums run in a background thread, `poll` after each step commits);
asynchronous with background staging (`stage_in_background=True`: even the copy runs in the
background and the next optimizer step waits for it). Per save it measures:

    save() returns   time from the save() call until it returns
    loop stalled     time the loop spent in checkpoint code: save() + every poll() until the
                     commit + waiting for the staged copy before the next optimizer step
    committed after  time from the save() call until the checkpoint is committed (renamed, named
                     by last_checkpoint)
    steps meanwhile  training steps run while the write was pending, and their mean time
                     against the steps just before the save (the background thread shares the cores)
    loop time lost   loop stalled + what the steps meanwhile took beyond the quiet step time

glibc moves 16 MiB allocations between its heap and fresh mmaps as it goes (a dynamic threshold),
which made quiet steps swing between 0.2 and 1.6 s around the checkpoints' large copies in a first
run; by default the script pins the thresholds (mallopt) so the figures measure the checkpoint,
not the allocator. ``--glibc-malloc`` keeps glibc's defaults.

    python benchmarks/bench_checkpoint.py                         # writes benchmarks/results/checkpoint_stall_cpu.md
    python benchmarks/bench_checkpoint.py --glibc-malloc --append # adds a section with glibc's defaults
    python benchmarks/bench_checkpoint.py --hidden 1024 --repeats 2 --out /tmp/stall.md
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from libai_zoo.checkpoint import Checkpointer, commit

MODES = {
    "sync": {},
    "async": {"async_save": True},
    "async, background staging": {"async_save": True, "stage_in_background": True},
}
ROOT = Path(__file__).resolve().parents[1]
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def _steady_malloc() -> str:
    """Pin glibc's mmap and trim thresholds (32 MiB, 1 GiB): freed tensors stay in the heap for reuse."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        pinned = libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):
        pinned = False
    return "glibc, thresholds pinned (mmap 32 MiB, trim 1 GiB)" if pinned else "default (mallopt unavailable)"


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


class Loop:
    """A training loop over a Linear stack that times the checkpoint code it runs."""

    def __init__(self, hidden: int, layers: int, batch: int):
        torch.manual_seed(0)
        self.model = nn.Sequential(*[nn.Linear(hidden, hidden, bias=False) for _ in range(layers)])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.inputs = torch.randn(batch, hidden)
        self.stalled = 0.0

    def step(self, checkpointer: Checkpointer | None = None) -> float:
        """One training step, then poll; returns the step's time without the checkpoint calls."""
        start = time.perf_counter()
        self.model(self.inputs).square().mean().backward()
        before = time.perf_counter()
        if checkpointer is not None:
            checkpointer.wait_for_staging()  # what the optimizer's step pre-hook would otherwise wait
        after = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)  # no 192 MiB of fresh gradients per step
        end = time.perf_counter()
        if checkpointer is not None:
            checkpointer.poll()
        self.stalled += (after - before) + (time.perf_counter() - end)
        return (before - start) + (end - after)


def measure(loop: Loop, checkpointer: Checkpointer, name: str, iteration: int, settle: int) -> dict:
    """One save in the middle of training: its stall, commit time and the steps run meanwhile."""
    quiet = statistics.median(loop.step(checkpointer) for _ in range(settle))
    start = time.perf_counter()
    checkpointer.save(name, iteration)
    returned = time.perf_counter() - start
    loop.stalled = returned
    meanwhile = []
    while checkpointer.pending is not None:
        meanwhile.append(loop.step(checkpointer))
    committed = time.perf_counter() - start
    checkpointer.prune(1)
    return {"returned": returned, "stalled": loop.stalled, "committed": committed, "steps": len(meanwhile),
            "step_meanwhile": statistics.mean(meanwhile) if meanwhile else None, "step_quiet": quiet,
            "lost": loop.stalled + sum(max(0.0, step - quiet) for step in meanwhile)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048, help="width of each Linear layer (default 2048)")
    parser.add_argument("--layers", type=int, default=12, help="number of Linear layers (default 12: 192 MiB)")
    parser.add_argument("--batch", type=int, default=8, help="rows per training step (default 8)")
    parser.add_argument("--repeats", type=int, default=5, help="saves per mode (default 5)")
    parser.add_argument("--settle", type=int, default=3, help="quiet steps before each save (default 3)")
    parser.add_argument("--glibc-malloc", action="store_true", help="keep glibc's dynamic malloc thresholds")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary "
                                                     "directory, removed afterwards)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/checkpoint_stall_cpu.md"),
                        help="markdown file the results are written to")
    parser.add_argument("--append", action="store_true", help="add this run as a section of --out")
    args = parser.parse_args()

    allocator = "glibc defaults (dynamic thresholds)" if args.glibc_malloc else _steady_malloc()
    loop = Loop(args.hidden, args.layers, args.batch)
    loop.step()  # the AdamW state exists from here on
    mib = 2**20
    params = sum(p.numel() * p.element_size() for p in loop.model.parameters()) / mib
    state = params + sum(t.numel() * t.element_size() for s in loop.optimizer.state.values()
                         for t in s.values()) / mib
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        checkpointers = {mode: Checkpointer(Path(root) / mode.replace(", ", "_").replace(" ", "_"), [loop.model],
                                            loop.optimizer, **options) for mode, options in MODES.items()}
        runs = {mode: [] for mode in MODES}
        begun = time.perf_counter()
        for repeat in range(args.repeats):
            for mode, checkpointer in checkpointers.items():  # modes take turns: drift hits all alike
                runs[mode].append(measure(loop, checkpointer, f"model_{repeat + 1:07d}", repeat + 1, args.settle))
                print(f"{mode:28s} repeat {repeat + 1}: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in runs[mode][-1].items() if isinstance(v, float)), flush=True)
        last = commit.pointed_to(checkpointers["sync"].output_dir)
        files = sorted(p for p in last.iterdir() if p.is_file())
        size = sum(p.stat().st_size for p in files) / mib
        start = time.perf_counter()
        for path in files:
            commit.checksum(path)
        checksum_s = time.perf_counter() - start
        total = time.perf_counter() - begun

    def median(mode: str, key: str, scale: float = 1.0, digits: int = 3) -> str:
        values = [run[key] for run in runs[mode] if run[key] is not None]
        return f"{statistics.median(values) * scale:.{digits}f}" if values else "–"

    rows = ["| mode | save() returns s | loop stalled s | committed after s | steps meanwhile | "
            "step ms meanwhile / quiet | loop time lost s |", "|---|---|---|---|---|---|---|"]
    for mode in MODES:
        rows.append(f"| {mode} | {median(mode, 'returned')} | {median(mode, 'stalled')} | "
                    f"{median(mode, 'committed')} | {median(mode, 'steps', digits=0)} | "
                    f"{median(mode, 'step_meanwhile', 1e3, 0)} / {median(mode, 'step_quiet', 1e3, 0)} | "
                    f"{median(mode, 'lost')} |")
    table = "\n".join(rows)
    print("\n" + table)
    detail = "\n".join(f"- {mode}: " + "; ".join(
        f"{run['returned']:.3f} / {run['stalled']:.3f} / {run['committed']:.3f} s, {run['steps']} steps"
        for run in runs[mode]) for mode in MODES)
    command = " ".join(["python benchmarks/bench_checkpoint.py", f"--hidden {args.hidden}", f"--layers {args.layers}",
                        f"--batch {args.batch}", f"--repeats {args.repeats}"]
                       + (["--glibc-malloc"] if args.glibc_malloc else []))
    section = f"""## malloc: {allocator}

`{command}` ({datetime.date.today().isoformat()}; whole run {total:.0f} s)

- device: {_cpu_name()}, {torch.get_num_threads()} threads ({platform.machine()}), one process, no process group
- torch {torch.__version__}, Python {platform.python_version()}
- model: {args.layers} × Linear({args.hidden}, {args.hidden}) fp32, {params:.0f} MiB of parameters, \
{state:.0f} MiB with AdamW state; checkpoint {size:.0f} MiB in {len(files)} files
- manifest cost: CRC-32 of the whole checkpoint (from the page cache) {checksum_s:.3f} s \
({size / checksum_s:.0f} MiB/s), inside the stall of a synchronous save, in the background thread of \
an asynchronous one

Medians over {args.repeats} saves per mode (modes take turns):

{table}

Every save (save() returns / loop stalled / committed after, steps meanwhile):

{detail}
"""
    header = """# Checkpoint stall on the CPU: synchronous vs asynchronous save

Written by `benchmarks/bench_checkpoint.py` (its docstring defines the columns). "loop stalled" is
the time the loop spent in checkpoint code: save() + every poll() until the commit + waiting for
the staged copy before the next optimizer step. "loop time lost" adds what the steps run during
the background write took beyond the quiet step time: on a CPU-only machine the writing thread
competes with training for the same cores.

"""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    before = out.read_text().rstrip("\n") + "\n\n" if args.append and out.is_file() else header
    out.write_text(before + section)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
