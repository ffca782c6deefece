"""The built-in hooks of `DefaultTrainer`: timing, LR schedule, checkpoints, evaluation,
best-checkpoint keeping, the spread of step time over ranks, log writing and a progress bar."""

from __future__ import annotations

import logging
import math
import resource
import sys
import time

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from libai_zoo.checkpoint import Checkpointer
from libai_zoo.utils import mfu

from .trainer_base import HookBase

logger = logging.getLogger("libai_zoo")


class IterationTimer(HookBase):
    """Step time, and from it samples/s, tokens/s, MFU and peak memory (the step records how many
    samples and tokens it processed as "samples"/"tokens")."""

    def __init__(self, flops_per_token: float | None = None, peak_flops: float | None = None, world_size: int = 1):
        self.flops_per_token, self.peak_flops, self.world_size = flops_per_token, peak_flops, world_size
        self._start = 0.0

    def before_train(self) -> None:
        self._train_start = time.perf_counter()

    def before_step(self) -> None:
        self._start = time.perf_counter()

    def after_step(self) -> None:
        storage = self.trainer.storage
        elapsed = time.perf_counter() - self._start
        latest = storage.latest()
        storage.put_scalar("time", elapsed)
        if "samples" in latest:
            storage.put_scalar("samples_per_s", latest["samples"][0] / elapsed)
        if "tokens" in latest:
            tokens_per_s = latest["tokens"][0] / elapsed
            storage.put_scalar("tokens_per_s", tokens_per_s)
            if self.flops_per_token and self.peak_flops:
                storage.put_scalar("mfu", mfu(tokens_per_s, self.flops_per_token, self.peak_flops, self.world_size))
        if torch.cuda.is_available():
            storage.put_scalar("max_mem_mb", torch.cuda.max_memory_allocated() / 2**20)
        else:  # the process's peak resident memory (Linux reports KiB)
            storage.put_scalar("max_mem_mb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)

    def after_train(self) -> None:
        steps = self.trainer.iter - self.trainer.start_iter
        total = time.perf_counter() - self._train_start
        if steps:
            logger.info("trained %d steps in %.1f s (%.4f s/step)", steps, total, total / steps)


class LRScheduler(HookBase):
    """Record the learning rate used by the step, then advance the schedule."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler):
        self.optimizer, self.scheduler = optimizer, scheduler

    def after_step(self) -> None:
        self.trainer.storage.put_scalar("lr", self.optimizer.param_groups[0]["lr"])
        self.scheduler.step()


class PeriodicCheckpointer(HookBase):
    """Save `model_{steps:07d}` every `period` steps and after the last one (period 0: only the last),
    keeping the newest `max_to_keep` (None: all)."""

    def __init__(self, checkpointer: Checkpointer, period: int, max_to_keep: int | None = None):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"train.checkpoint.max_to_keep = {max_to_keep} must be at least 1 (None keeps all)")
        self.checkpointer, self.period, self.max_to_keep = checkpointer, period, max_to_keep

    def after_step(self) -> None:
        done = self.trainer.iter + 1
        if (self.period and done % self.period == 0) or done == self.trainer.max_iter:
            start = time.perf_counter()
            self.checkpointer.save(f"model_{done:07d}", done)
            self.checkpointer.prune(self.max_to_keep)
            self.trainer.storage.put_scalar("checkpoint_s", time.perf_counter() - start)  # the loop's stall


class CheckpointCommitter(HookBase):
    """Commit an asynchronous checkpoint once every rank has written it (`Checkpointer.poll`, a
    no-op without one pending), and wait for the last one when the run ends."""

    def __init__(self, checkpointer: Checkpointer):
        self.checkpointer = checkpointer

    def after_step(self) -> None:
        self.checkpointer.poll()

    def after_train(self) -> None:
        self.checkpointer.wait()


class EvalHook(HookBase):
    """Run `eval_function()` (a dict of metrics) every `period` steps and after the last; record
    them as "eval/<name>"."""

    def __init__(self, period: int, eval_function):
        self.period, self.eval_function = period, eval_function

    def after_step(self) -> None:
        done = self.trainer.iter + 1
        if (self.period and done % self.period == 0) or done == self.trainer.max_iter:
            start = time.perf_counter()
            results = self.eval_function()
            self.trainer.storage.put_scalar("eval_s", time.perf_counter() - start)
            self.trainer.storage.put_scalars(**{f"eval/{name}": value for name, value in results.items()})
            logger.info("evaluation after %d steps: %s", done,
                        ", ".join(f"{name} = {value:.4f}" for name, value in results.items()))


class BestCheckpointer(HookBase):
    """After each evaluation, save `model_best` when "eval/<metric>" improved (mode "max" or "min")."""

    def __init__(self, checkpointer: Checkpointer, metric: str, mode: str = "max"):
        if mode not in ("max", "min"):
            raise ValueError(f"train.best_mode = {mode!r} must be 'max' or 'min'")
        self.checkpointer, self.metric, self.mode = checkpointer, f"eval/{metric}", mode
        self.best = -math.inf if mode == "max" else math.inf

    def after_step(self) -> None:
        latest = self.trainer.storage.latest().get(self.metric)
        if latest is None or latest[1] != self.trainer.iter:
            return
        value = latest[0]
        if (value > self.best) if self.mode == "max" else (value < self.best):
            logger.info("%s improved from %.4f to %.4f: saving model_best", self.metric, self.best, value)
            self.best = value
            self.checkpointer.save("model_best", self.trainer.iter + 1, pointer=False)


def is_log_step(trainer, period: int) -> bool:
    """Whether the step just done is logged: the run's first (the starting loss), every `period`-th
    and the last."""
    done = trainer.iter + 1
    return done % period == 0 or done == trainer.max_iter or trainer.iter == trainer.start_iter


class StepTimeSpread(HookBase):
    """At every logged step, the busy time of the slowest and the fastest rank (one all-gather), so
    a straggler shows in the console line: ``time_max``, ``time_min``, ``slowest_rank``.

    Busy time is the step time less the wait at the step's first collective (``sync_wait_s``, the
    targets count): a rank late with its data or its host work makes the others wait there, so its
    busy time is the largest. A rank slow inside forward/backward makes the others wait inside
    collectives this does not time: there the step time evens out."""

    def __init__(self, period: int, device: torch.device):
        self.period, self.device = period, device

    def after_step(self) -> None:
        if not is_log_step(self.trainer, self.period):
            return
        storage = self.trainer.storage
        latest = storage.latest()
        busy = latest["time"][0] - latest.get("sync_wait_s", (0.0,))[0] if "time" in latest else 0.0
        mine = torch.tensor([busy], dtype=torch.float64, device=self.device)
        times = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(times, mine)
        times = [t.item() for t in times]
        slowest = max(range(len(times)), key=times.__getitem__)
        storage.put_scalars(time_max=times[slowest], time_min=min(times), slowest_rank=slowest)


class PeriodicWriter(HookBase):
    """Call every writer after the run's first step (the starting loss), every `period` steps,
    after the last step, and after a step that evaluated (whatever the period: its results are
    recorded at that step only)."""

    def __init__(self, writers: list, period: int):
        self.writers, self.period = writers, period

    def after_step(self) -> None:
        storage = self.trainer.storage
        evaluated = any(name.startswith("eval/") and at == storage.iter for name, (_, at) in storage.latest().items())
        if evaluated or is_log_step(self.trainer, self.period):
            for writer in self.writers:
                writer.write(self.trainer.storage)

    def close(self) -> None:
        for writer in self.writers:
            close = getattr(writer, "close", None)
            if close is not None:
                close()


class ProgressBar(HookBase):
    """A tqdm bar of the steps, on an interactive terminal only (logs stay one line per period)."""

    def before_train(self) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=self.trainer.max_iter, initial=self.trainer.start_iter, dynamic_ncols=True,
                        leave=False, disable=not sys.stderr.isatty())

    def after_step(self) -> None:
        latest = self.trainer.storage.latest()
        if "loss" in latest:
            self.bar.set_postfix(loss=f"{latest['loss'][0]:.4f}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class GenerateSample(HookBase):
    """After training, let a causal LM continue `prompt` (greedy) and log the text: a quick look at
    what the model learned. ``tokenizer`` is a Hugging Face tokenizer directory."""

    def __init__(self, tokenizer: str, prompt: str, max_new_tokens: int = 40):
        self.tokenizer, self.prompt, self.max_new_tokens = tokenizer, prompt, max_new_tokens

    def after_train(self) -> None:
        with self.trainer.generation_model() as ready:
            if ready is None:
                logger.warning("no sample under pipeline parallelism: generate from a checkpoint with dist.pp=1")
                return
            model, device = ready
            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer)
            tokens = model.generate(tokenizer(self.prompt, return_tensors="pt").input_ids.to(device),
                                    max_new_tokens=self.max_new_tokens)
        self.text = tokenizer.decode(tokens[0], skip_special_tokens=True)
        logger.info("sample after %d steps: %r", self.trainer.iter, self.text)
