"""Plot the curves of one or more training runs from their metrics.json into one PNG.

    python tools/plot.py output/gpt2_pretrain                        # -> output/gpt2_pretrain/metrics.png
    python tools/plot.py output/run_a output/run_b --out compare.png  # several runs on one figure
    python tools/plot.py output/gpt2_pretrain --x time                # wall-clock seconds on the x axis

A run's output_dir holds metrics.json (one JSON line per logged step, written by the trainer).
Panels, each drawn only when some run recorded it: training loss, learning rate, throughput
(tokens/s, or samples/s for a model without tokens), a Mixture of Experts' expert balance
(aux_loss: router_aux_loss_coef × the load-balancing loss as the loss includes it; moe/imbalance:
the worst layer's max / mean tokens per expert; moe/dropped_tokens when some were dropped over
capacity) and each evaluation metric (eval/loss,
eval/perplexity, eval/accuracy, ...). Each run is one line per panel, labelled by its directory.
After a restart or a rollback a run logs some steps again: the later lines replace the earlier.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TIME_KEY = "goodput/wall_s"  # seconds since the job started (restarts included)
THROUGHPUT_KEYS = (("tokens_per_s", "throughput (tokens/s)"), ("samples_per_s", "throughput (samples/s)"))
# A Mixture of Experts' routing, as the train step logs it (StepResult.scalars).
MOE_KEYS = (("aux_loss", "auxiliary loss (as added to the loss)"),
            ("moe/imbalance", "expert imbalance (max / mean tokens)"), ("moe/dropped_tokens", "dropped tokens"))


class PlotError(Exception):
    """Something the user can fix: the message says what."""


def read_run(run_dir: str | Path) -> list[dict]:
    """The records of a run's metrics.json in the order they count: a line whose iteration is not
    after the one before it starts a restart (or a rollback, or --no-resume in the same
    directory), and replaces the earlier lines from its iteration on. A last line without its newline
    (being written) is left out."""
    path = Path(run_dir) / "metrics.json"
    if not path.is_file():
        raise PlotError(f"{run_dir} has no metrics.json: pass a run's output_dir (its train.output_dir, "
                        f"e.g. output/gpt2_pretrain)")
    text = path.read_text()
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        lines = lines[:-1]
    records: list[dict] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise PlotError(f"{path}:{number} is not a JSON line ({error})") from error
        if not isinstance(record, dict) or "iteration" not in record:
            raise PlotError(f"{path}:{number} has no iteration: is this a metrics.json written by the trainer?")
        while records and records[-1]["iteration"] >= record["iteration"]:
            records.pop()
        records.append(record)
    if not records:
        raise PlotError(f"{path} is empty: the run has not logged a step yet (train.log_period)")
    return records


def panels(runs: dict[str, list[dict]]) -> list[tuple[str, str]]:
    """(metric key, panel title) of every panel some run has data for, in drawing order."""
    keys = {key for records in runs.values() for record in records for key in record}
    chosen = [(key, title) for key, title in (("loss", "training loss"), ("lr", "learning rate")) if key in keys]
    chosen += [pair for pair in THROUGHPUT_KEYS if pair[0] in keys][:1]
    chosen += [(key, title) for key, title in MOE_KEYS if key in keys and (
        key != "moe/dropped_tokens" or any(r.get(key) for records in runs.values() for r in records))]
    return chosen + [(key, key) for key in sorted(keys) if key.startswith("eval/")]


def draw(runs: dict[str, list[dict]], x: str = "iteration") -> Figure:
    """A matplotlib Figure (not registered with pyplot; saved through Agg): one panel per metric
    `panels` finds, one line per run (label: the run's name; colour: its place in `runs`, the same in
    every panel) with the points that recorded it.
    `x`: "iteration" or "time" (goodput/wall_s)."""
    x_key = "iteration" if x == "iteration" else TIME_KEY
    if x_key == TIME_KEY:
        for name, records in runs.items():
            if any(TIME_KEY not in r for r in records):
                raise PlotError(f"{name}/metrics.json has no {TIME_KEY} on every line (written by the goodput "
                                f"hook of newer runs): plot it with --x iteration")
    chosen = panels(runs)
    if not chosen:
        raise PlotError(f"no loss, lr, throughput, MoE routing or eval/* values in {', '.join(runs)}")
    columns = min(3, len(chosen))
    rows = math.ceil(len(chosen) / columns)
    figure = _new_figure(figsize=(4.5 * columns, 3.2 * rows), layout="constrained")
    first = None
    for index, (key, title) in enumerate(chosen, 1):
        axes = figure.add_subplot(rows, columns, index, sharex=first)  # eval points sit under the training steps
        first = first or axes
        for run, (name, records) in enumerate(runs.items()):
            points = [(r[x_key], r[key]) for r in records if key in r]
            if points:  # colour by the run's place, not the panel's: a panel may lack some runs
                xs, ys = zip(*points)
                axes.plot(xs, ys, label=name, color=f"C{run}", marker="o" if len(points) <= 10 else None,
                          markersize=4)
        axes.set_title(title)
        axes.set_xlabel("iteration" if x == "iteration" else "wall time (s)")
        if key in ("loss", "eval/loss", "eval/perplexity") and _spans_decades(axes):
            axes.set_yscale("log")
        axes.grid(alpha=0.3)
        if index == 1:  # one legend: a run has the same colour in every panel
            axes.legend(fontsize=8)
    return figure


def _spans_decades(axes) -> bool:
    """Whether the positive values on `axes` span more than a factor of 10 (worth a log scale)."""
    values = [y for line in axes.get_lines() for y in line.get_ydata() if y > 0]
    return bool(values) and max(values) / min(values) > 10


def _new_figure(**kwargs) -> Figure:
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise PlotError("tools/plot.py needs matplotlib: pip install libai_zoo[plot]") from error
    return Figure(**kwargs)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tools/plot.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a run's output_dir (holding metrics.json); "
                                                                   "several are drawn on the same panels")
    parser.add_argument("--out", default=None, metavar="FILE.png",
                        help="where to write the picture (default: FIRST_RUN_DIR/metrics.png)")
    parser.add_argument("--x", choices=("iteration", "time"), default="iteration",
                        help="x axis: the step, or wall-clock seconds since the job started (default: iteration)")
    parser.add_argument("--dpi", type=int, default=100, help="resolution of the PNG (default 100)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    """Read the runs, draw them, write the PNG and print its path."""
    args = parse_args(argv)
    runs = {str(run).rstrip("/"): read_run(run) for run in args.runs}
    out = Path(args.out) if args.out else Path(args.runs[0]) / "metrics.png"
    figure = draw(runs, args.x)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=args.dpi)
    print(out)
    return out


if __name__ == "__main__":
    try:
        main()
    except PlotError as error:
        raise SystemExit(f"tools/plot.py: error: {error}") from None
