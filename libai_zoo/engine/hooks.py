"""The built-in hooks of `DefaultTrainer`: timing, the spread of step time over ranks, log writing,
a progress bar and a sample at the end. They observe: they read the step's `StepResult`
(`trainer.last_step`), its time (`trainer.step_time`) and the trainer's records (its latest
`Evaluation`), not one another."""

from __future__ import annotations

import logging
import resource
import sys
import time

import torch
import torch.distributed as dist
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from libai_zoo.utils import mfu

from .trainer_base import HookBase

logger = logging.getLogger("libai_zoo")


class IterationTimer(HookBase):
    """The step's time (the loop's `step_time`), and from it samples/s, tokens/s, MFU and peak memory."""

    def __init__(self, flops_per_token: float | None = None, peak_flops: float | None = None, world_size: int = 1):
        self.flops_per_token, self.peak_flops, self.world_size = flops_per_token, peak_flops, world_size

    def before_train(self) -> None:
        self._train_start, self._steps = time.perf_counter(), 0

    def after_step(self) -> None:
        self._steps += 1  # steps run (a rollback repeats some: iter - start_iter would miss them)
        storage, result = self.trainer.storage, self.trainer.last_step
        elapsed = self.trainer.step_time
        storage.put_scalar("time", elapsed)
        storage.put_scalar("samples_per_s", result.samples / elapsed)
        if result.tokens is not None:
            tokens_per_s = result.tokens / elapsed
            storage.put_scalar("tokens_per_s", tokens_per_s)
            if self.flops_per_token and self.peak_flops:
                storage.put_scalar("mfu", mfu(tokens_per_s, self.flops_per_token, self.peak_flops, self.world_size))
        if torch.cuda.is_available():
            storage.put_scalar("max_mem_mb", torch.cuda.max_memory_allocated() / 2**20)
        else:  # the process's peak resident memory (Linux reports KiB)
            storage.put_scalar("max_mem_mb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)

    def after_train(self) -> None:
        steps = self._steps
        total = time.perf_counter() - self._train_start
        if steps:
            logger.info("trained %d steps in %.1f s (%.4f s/step)", steps, total, total / steps)


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
    collectives this does not time: there the step time evens out. ``group``: the run's ranks (the
    parallel context's `world_group`)."""

    def __init__(self, period: int, device: torch.device, group: dist.ProcessGroup):
        self.period, self.device, self.group = period, device, group

    def after_step(self) -> None:
        if not is_log_step(self.trainer, self.period):
            return
        busy = self.trainer.step_time - self.trainer.last_step.sync_wait_s
        mine = torch.tensor([busy], dtype=torch.float64, device=self.device)
        times = [torch.zeros_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(times, mine, group=self.group)
        times = [t.item() for t in times]
        slowest = max(range(len(times)), key=times.__getitem__)
        self.trainer.storage.put_scalars(time_max=times[slowest], time_min=min(times), slowest_rank=slowest)


class PeriodicWriter(HookBase):
    """Call every writer after the run's first step (the starting loss), every `period` steps,
    after the last step, and after a step the trainer evaluated (`trainer.last_evaluation`),
    whatever the period: its results are recorded at that step only. It writes in report_step, so
    a line holds what every hook recorded in after_step."""

    def __init__(self, writers: list, period: int):
        self.writers, self.period = writers, period

    def report_step(self) -> None:
        last = self.trainer.last_evaluation
        evaluated = last is not None and last.iteration == self.trainer.iter + 1
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
        self.bar.set_postfix(loss=f"{self.trainer.last_step.loss:.4f}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class GenerateSample(HookBase):
    """After training, let the model answer `prompt` (greedy) and log the text: a quick look at what
    it learned. A causal LM continues the prompt; an encoder-decoder (T5) reads it and its decoder's
    output is logged, special tokens such as T5's sentinels kept (`<extra_id_0> ...`: the spans it
    fills in). ``tokenizer``: a Hugging Face tokenizer directory, or a tokenizer (T5's recipes pass
    `libai_zoo.data.sentinel_tokenizer`'s)."""

    def __init__(self, tokenizer: str | PreTrainedTokenizerBase, prompt: str, max_new_tokens: int = 40):
        self.tokenizer, self.prompt, self.max_new_tokens = tokenizer, prompt, max_new_tokens

    def after_train(self) -> None:
        with self.trainer.generation_model() as ready:
            if ready is None:
                logger.warning("no sample under pipeline parallelism: generate from a checkpoint with dist.pp=1")
                return
            model, device = ready
            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer) if isinstance(self.tokenizer, str) \
                else self.tokenizer
            seq2seq = getattr(model.config, "is_encoder_decoder", False)
            prompt = tokenizer(self.prompt, return_tensors="pt").input_ids
            if seq2seq:  # the encoder reads the prompt as it read its training inputs: ended by eos
                prompt = torch.cat([prompt, torch.tensor([[tokenizer.eos_token_id]])], dim=1)
            tokens = model.generate(prompt.to(device), max_new_tokens=self.max_new_tokens)
        if seq2seq:
            ends = {tokenizer.pad_token_id, tokenizer.eos_token_id}
            self.text = tokenizer.decode([t for t in tokens[0].tolist() if t not in ends])
        else:
            self.text = tokenizer.decode(tokens[0], skip_special_tokens=True)
        logger.info("sample after %d steps: %r", self.trainer.iter, self.text)
