"""Where a run's numbers go: an `EventStorage` the step and hooks write scalars into, and the
writers that read it every `log_period` iterations (console line, metrics.json, TensorBoard)."""

from __future__ import annotations

import datetime
import json
import logging
import statistics
from collections import defaultdict, deque
from pathlib import Path

logger = logging.getLogger("libai_zoo")


class EventStorage:
    """Scalars by name, each with the iteration it was recorded at and a window of history."""

    def __init__(self, start_iter: int = 0, max_iter: int | None = None, window: int = 20):
        self.iter, self.max_iter = start_iter, max_iter
        self.window = window
        self._history: dict[str, deque[tuple[float, int]]] = defaultdict(lambda: deque(maxlen=window))

    def put_scalar(self, name: str, value: float) -> None:
        self._history[name].append((float(value), self.iter))

    def put_scalars(self, **values: float) -> None:
        for name, value in values.items():
            if value is not None:
                self.put_scalar(name, value)

    def latest(self) -> dict[str, tuple[float, int]]:
        """name -> (last value, its iteration)."""
        return {name: history[-1] for name, history in self._history.items() if history}

    def median(self, name: str) -> float | None:
        """Median over the window: what the console shows for noisy values such as step time."""
        history = self._history.get(name)
        return statistics.median(v for v, _ in history) if history else None


class ConsoleWriter:
    """One line per logged iteration: progress (of the running loop's max_iter), ETA, loss, a Mixture
    of Experts' auxiliary loss and expert imbalance, lr, grad norm, throughput, MFU, memory, step
    time and, with several ranks, its spread over them (the fastest and the slowest rank's median
    step time, and which rank is the slowest)."""

    FIELDS = (("loss", "loss", "{:.4f}"), ("aux_loss", "aux_loss", "{:.4f}"), ("moe/imbalance", "imbalance", "{:.2f}"),
              ("lr", "lr", "{:.3e}"), ("grad_norm", "grad_norm", "{:.3f}"),
              ("samples_per_s", "samples/s", "{:.1f}"), ("tokens_per_s", "tokens/s", "{:.0f}"),
              ("mfu", "mfu", "{:.1%}"), ("max_mem_mb", "max_mem", "{:.0f}M"), ("loss_scale", "loss_scale", "{:g}"))

    def write(self, storage: EventStorage) -> None:
        latest = storage.latest()
        iteration = storage.iter + 1
        parts = [f"iter: {iteration}/{storage.max_iter}"]
        step_time = storage.median("time")
        if step_time is not None and storage.max_iter is not None:
            eta = datetime.timedelta(seconds=int(step_time * (storage.max_iter - iteration)))
            parts.append(f"eta: {eta}")
        for key, label, fmt in self.FIELDS:
            if key in latest:
                value = storage.median(key) if key in ("samples_per_s", "tokens_per_s", "mfu") else latest[key][0]
                parts.append(f"{label}: {fmt.format(value)}")
        if step_time is not None:
            parts.append(f"time: {step_time:.4f}s")
        if "time_max" in latest and latest["time_max"][1] == storage.iter:
            parts.append(f"ranks: {latest['time_min'][0]:.4f}-{latest['time_max'][0]:.4f}s "
                         f"(slowest {int(latest['slowest_rank'][0])})")
        logger.info("  ".join(parts))


class JSONWriter:
    """Appends one JSON object per logged iteration to metrics.json: {"iteration": n, name: value, ...}."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def write(self, storage: EventStorage) -> None:
        iteration = storage.iter + 1
        record = {"iteration": iteration}
        record.update({name: value for name, (value, it) in storage.latest().items() if it == storage.iter})
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


class TensorBoardWriter:
    """Every scalar recorded at the logged iteration, as TensorBoard scalars (needs `tensorboard`)."""

    def __init__(self, log_dir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ImportError("train.tensorboard=True needs the tensorboard package: pip install tensorboard") \
                from error
        self._writer = SummaryWriter(str(log_dir))

    def write(self, storage: EventStorage) -> None:
        for name, (value, it) in storage.latest().items():
            if it == storage.iter:
                self._writer.add_scalar(name, value, it + 1)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
