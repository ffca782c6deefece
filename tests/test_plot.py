"""tools/plot.py: the panels and lines it draws from metrics.json (synthetic and a real run's),
restarted runs, the time axis, and the errors it gives."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.recipes import recipe
from trainer_runs import run_trainer

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("plot_tool", ROOT / "tools" / "plot.py")
plot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot)


def write_run(run_dir: Path, records: list[dict], tail: str = "") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.json").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return run_dir


def lm_records(iterations, loss0: float = 9.0, eval_every: int = 20) -> list[dict]:
    """Lines like an LM run's: loss, lr, tokens/s and wall time on every line, eval metrics on some."""
    records = []
    for it in iterations:
        record = {"iteration": it, "loss": loss0 - it / 10, "lr": 1e-3, "samples_per_s": 10.0,
                  "tokens_per_s": 1280.0, "goodput/wall_s": 0.5 * it}
        if it % eval_every == 0:
            record.update({"eval/loss": loss0 - it / 9, "eval/perplexity": 100.0 - it, "eval_s": 0.1})
        records.append(record)
    return records


def lines_by_panel(figure) -> dict[str, list]:
    return {axes.get_title(): axes.get_lines() for axes in figure.get_axes()}


def test_one_run_draws_every_panel_it_has_data_for(tmp_path, capsys):
    run = write_run(tmp_path / "run", lm_records(range(5, 45, 5)))
    out = plot.main([str(run)])
    assert out == run / "metrics.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.strip() == str(out)
    figure = plot.draw({"run": plot.read_run(run)})
    panels = lines_by_panel(figure)
    assert list(panels) == ["training loss", "learning rate", "throughput (tokens/s)", "eval/loss", "eval/perplexity"]
    assert all(len(lines) == 1 for lines in panels.values())
    assert list(panels["training loss"][0].get_xdata()) == list(range(5, 45, 5))
    assert list(panels["eval/loss"][0].get_xdata()) == [20, 40]  # only the lines that evaluated


def test_runs_are_compared_on_the_same_panels(tmp_path):
    classifier = [{"iteration": i, "loss": 2.0, "lr": 1e-3, "samples_per_s": 50.0, "eval/accuracy": 0.5}
                  for i in (10, 20)]
    runs = {"a": plot.read_run(write_run(tmp_path / "a", lm_records(range(10, 30, 10)))),
            "b": plot.read_run(write_run(tmp_path / "b", classifier))}
    panels = lines_by_panel(plot.draw(runs))
    assert list(panels) == ["training loss", "learning rate", "throughput (tokens/s)", "eval/accuracy", "eval/loss",
                            "eval/perplexity"]
    assert [line.get_label() for line in panels["training loss"]] == ["a", "b"]
    assert [line.get_label() for line in panels["eval/accuracy"]] == ["b"]
    assert [line.get_label() for line in panels["throughput (tokens/s)"]] == ["a"]
    assert lines_by_panel(plot.draw({"b": runs["b"]}))["throughput (samples/s)"][0].get_ydata().tolist() == [50.0] * 2


def test_a_mixture_of_experts_run_draws_its_expert_balance(tmp_path):
    moe = [{**record, "aux_loss": 0.021 - record["iteration"] / 10000, "moe/imbalance": 3.0 - record["iteration"] / 50,
            "moe/dropped_tokens": 0.0} for record in lm_records(range(10, 50, 10))]
    dropping = [{**record, "moe/dropped_tokens": 12.0 * (record["iteration"] == 20)} for record in moe]
    panels = lines_by_panel(plot.draw({"dropless": plot.read_run(write_run(tmp_path / "dropless", moe))}))
    aux, imbalance = "auxiliary loss (as added to the loss)", "expert imbalance (max / mean tokens)"
    assert list(panels) == ["training loss", "learning rate", "throughput (tokens/s)", aux, imbalance, "eval/loss",
                            "eval/perplexity"]
    assert panels[aux][0].get_ydata().tolist() == pytest.approx([0.02, 0.019, 0.018, 0.017])
    assert panels[imbalance][0].get_ydata().tolist() == [2.8, 2.6, 2.4, 2.2]
    runs = {"dropless": moe, "dropping": plot.read_run(write_run(tmp_path / "dropping", dropping))}
    dropped = lines_by_panel(plot.draw(runs))["dropped tokens"]  # drawn once some run dropped tokens
    assert [line.get_label() for line in dropped] == ["dropless", "dropping"]
    assert dropped[1].get_ydata().tolist() == [0.0, 12.0, 0.0, 0.0]


def test_a_run_has_one_colour_in_every_panel(tmp_path):
    """A panel missing a run (gpt2 logs no aux_loss) keeps the other runs' colours, so the one legend
    holds: MoE's aux_loss is drawn in MoE's loss colour (the cycle's 2nd), not in gpt2's (its 1st)."""
    from matplotlib.colors import to_hex

    runs = {"gpt2": lm_records(range(10, 30, 10)),
            "moe": [{**record, "aux_loss": 0.02} for record in lm_records(range(10, 30, 10))]}
    colours = {title: {line.get_label(): to_hex(line.get_color()) for line in lines}
               for title, lines in lines_by_panel(plot.draw(runs)).items()}
    assert colours["training loss"] == {"gpt2": to_hex("C0"), "moe": to_hex("C1")} == {
        "gpt2": "#1f77b4", "moe": "#ff7f0e"}
    assert colours["auxiliary loss (as added to the loss)"] == {"moe": "#ff7f0e"}


def test_curves_spanning_decades_get_a_log_scale(tmp_path):
    records = [{"iteration": 100, "loss": 9.0, "eval/perplexity": 8000.0}, {"iteration": 200, "loss": 6.0},
               {"iteration": 300, "loss": 5.0, "eval/perplexity": 300.0}]
    figure = plot.draw({"run": plot.read_run(write_run(tmp_path / "run", records))})
    assert {axes.get_title(): axes.get_yscale() for axes in figure.get_axes()} == {
        "training loss": "linear", "eval/perplexity": "log"}


def test_a_restart_replaces_the_steps_it_logs_again_and_a_partial_line_is_skipped(tmp_path):
    first = lm_records(range(1, 9))          # killed after step 8
    second = lm_records(range(5, 11), loss0=8.0)  # resumed from the checkpoint of step 4
    run = write_run(tmp_path / "run", first + second, tail='{"iteration": 11, "lo')
    records = plot.read_run(run)
    assert [r["iteration"] for r in records] == list(range(1, 11))
    assert records[4]["loss"] == pytest.approx(7.5)


def test_time_axis_is_the_wall_time(tmp_path):
    run = write_run(tmp_path / "run", lm_records(range(10, 50, 10)))
    loss = lines_by_panel(plot.draw({"run": plot.read_run(run)}, x="time"))["training loss"][0]
    assert list(loss.get_xdata()) == [5.0, 10.0, 15.0, 20.0]
    old = write_run(tmp_path / "old", [{"iteration": 1, "loss": 9.0}])
    with pytest.raises(plot.PlotError, match="has no goodput/wall_s.*--x iteration"):
        plot.draw({str(old): plot.read_run(old)}, x="time")


def test_errors_name_the_problem(tmp_path, monkeypatch):
    with pytest.raises(plot.PlotError, match=f"{tmp_path} has no metrics.json: pass a run's output_dir"):
        plot.read_run(tmp_path)
    write_run(tmp_path / "bad", [{"iteration": 1, "loss": 1.0}], tail="not json\n")
    with pytest.raises(plot.PlotError, match=r"metrics.json:2 is not a JSON line"):
        plot.read_run(tmp_path / "bad")
    write_run(tmp_path / "empty", [])
    with pytest.raises(plot.PlotError, match="empty"):
        plot.read_run(tmp_path / "empty")
    for name in ("matplotlib", "matplotlib.figure"):  # as if it were not installed
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(plot.PlotError, match=r"pip install libai_zoo\[plot\]"):
        plot.draw({"run": [{"iteration": 1, "loss": 1.0}]})


def test_command_line(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "tools/plot.py"), "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "--x {iteration,time}" in result.stdout
    result = subprocess.run([sys.executable, str(ROOT / "tools/plot.py"), str(tmp_path)], capture_output=True,
                            text=True)
    assert result.returncode == 1
    assert result.stderr.strip() == (f"tools/plot.py: error: {tmp_path} has no metrics.json: pass a run's "
                                     f"output_dir (its train.output_dir, e.g. output/gpt2_pretrain)")




def test_a_real_run(tmp_path):
    cfg = recipe("recorded_gpt2_1layer.py", f"train.output_dir={tmp_path / 'run'}")
    run_trainer(cfg)
    out = plot.main([str(tmp_path / "run"), "--out", str(tmp_path / "plot.png"), "--x", "time"])
    assert out.is_file()
    panels = lines_by_panel(plot.draw({"run": plot.read_run(tmp_path / "run")}))
    assert list(panels) == ["training loss", "learning rate", "throughput (tokens/s)", "eval/loss", "eval/perplexity"]
    assert list(panels["training loss"][0].get_xdata()) == [1, 2, 4, 6]  # the first step, every 2nd, the last
    assert list(panels["eval/loss"][0].get_xdata()) == [4, 6]
