"""`DefaultTrainer(cfg)`: the standard recipe around the loop, every part overridable.

    checks that need no process group (layout, batch sizes) -> distributed.init(cfg.dist) -> build_model
    (on the meta device: instantiate, distributed.shard, pipeline stages, activation checkpointing, compile,
    the data-parallel wrap; then materialize: each rank allocates and fills only its own shards)
    -> the data checked against the model -> build_optimizer -> build_lr_scheduler -> the step and
    the checkpointer -> build_test_loader, build_evaluator -> hooks (timer, LR, eval, best
    checkpoint, periodic checkpoint, step-time spread, goodput, writers, progress bar, preemption)
    -> resume_or_load -> train() (build_train_loader)

A run survives what a long job meets (see the README's "Running long jobs"): it resumes by itself
from the newest intact checkpoint, saves and exits with `EXIT_PREEMPTED` on SIGTERM/SIGINT, stops
(or rolls back, ``train.on_divergence="rollback"``) after ``train.max_bad_steps`` non-finite steps
in a row, and when a collective times out (``dist.timeout``) names the ranks that never arrived.

The model is read only through the model contract (`libai_zoo.models.TrainableModel`): any model
that implements it trains at every layout.

Batch sizes: each process runs ``train.micro_batch_size`` samples per forward and accumulates
``global_batch_size / (micro_batch_size × dp)`` micro-batches per optimizer step.

``dataloader`` keys: ``train`` (a dataset recipe; a torch IterableDataset with state_dict() is read
as a stream: in order, each dp rank keeping its micro-batches of the global stream, its state saved
with every checkpoint), ``test`` (optional, for evaluation),
``num_workers`` (0), ``shuffle`` (True) and ``prefetch`` (2: batches a background thread reads
ahead of the step; 0 turns it off).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from libai_zoo import distributed
from libai_zoo.checkpoint import Checkpointer, commit
from libai_zoo.config import LazyConfig, instantiate, run_settings
from libai_zoo.data import MicroBatchSampler, Prefetcher, check_dataset, stream_micro_batches
from libai_zoo.hf import (HFWeightReader, apply_lora_config, check_hf_weights, load_hf_weights, load_peft_adapter,
                          read_peft_adapter)
from libai_zoo.layers import lora_layers
from libai_zoo.models import get_layer_stack
from libai_zoo.optim import build_optimizer
from libai_zoo.plan import agree_on_layout
from libai_zoo.parallel import (DataParallel, fsdp_param_dtype, Pipeline, check_pipeline_layout, layer_by_layer, materialize,
                                parallelize)
from libai_zoo.utils import peak_flops, seed_all, setup_logging

from . import hooks
from .evaluator import Evaluator, pipelined_forward, run_evaluation
from .events import ConsoleWriter, JSONWriter, TensorBoardWriter
from .faults import fault_injector
from .goodput import Goodput
from .heartbeat import Heartbeat
from .preemption import Preempted, Preemption
from .train_step import TrainStep
from .trainer_base import RolledBack, TrainerBase

logger = logging.getLogger("libai_zoo")


MAX_ROLLBACKS_TO_ONE_CHECKPOINT = 2


def _is_collective_failure(error: BaseException) -> bool:
    """A collective that timed out or lost a peer (gloo raises these; NCCL's watchdog aborts instead)."""
    text = str(error)
    return isinstance(error, dist.DistError) or any(
        word in text for word in ("Timed out", "timed out", "Connection closed", "Connection reset", "gloo", "NCCL"))


def _with(node: DictConfig, **given) -> dict:
    """A LazyCall config as a plain dict, plus arguments only the trainer has (model, optimizer, ...)."""
    return {**OmegaConf.to_container(node, resolve=True), **given}


@dataclass
class BuiltModel:
    """What `build_model` builds: the modules this rank trains, and what follows from them."""

    #: The whole model, or this rank's pipeline stages' parts (real modules with the full model's names).
    parts: list[nn.Module]
    #: The schedule that runs the parts under pipeline parallelism; None without it.
    pipeline: Pipeline | None
    #: FLOPs of one training token of the whole model (for MFU); None when the data has no sequence length.
    flops_per_token: float | None
    #: The whole model: `parts[0]` without pipeline stages, else still on the meta device (no memory):
    #: the names and shapes of every stage's parameters, which a checkpoint is checked against.
    whole: nn.Module


class DivergenceError(RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient norm."""


class DataPosition:
    """Where the training data stands beyond the step count (saved with every checkpoint, so a
    resumed run reads on from the same sample): the batches a rollback skipped and, for a stream,
    its state after the last micro-batch the run took, with the global samples read up to it (the
    same on every rank)."""

    def __init__(self, stream: dict | None = None):
        self.skipped_batches = 0
        self.stream = stream  # None: map-style data, whose position follows from the step count
        self.stream_samples = 0

    def state_dict(self) -> dict:
        return {"skipped_batches": self.skipped_batches, "stream": self.stream, "stream_samples": self.stream_samples}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_batches = state["skipped_batches"]
        if state.get("stream") is not None:
            self.stream, self.stream_samples = state["stream"], state["stream_samples"]


class DefaultTrainer(TrainerBase):
    """Builds everything a run needs from `cfg` (its keys: libai_zoo/config/schema.py)."""

    def __init__(self, cfg: DictConfig, *, fast_dev_run: bool = False):
        started_at = time.time()
        super().__init__()
        self.cfg, self.fast_dev_run = cfg, fast_dev_run
        train = cfg.train
        auto_layout = None
        if cfg.dist.get("auto", False):  # the planner picks dp, tp, pp, ZeRO, AC, SP, micro-batch, schedule
            overrides, auto_layout = agree_on_layout(cfg, timeout=cfg.dist.get("init_timeout"))
            LazyConfig.apply_overrides(cfg, overrides.split())
        # What can be refused without a process group is refused before one exists.
        dp, tp, pp = distributed.resolve_sizes(distributed.launched_world_size(), cfg.dist.dp, cfg.dist.tp, cfg.dist.pp)
        self.accumulation = self._accumulation(train, dp)
        self.amp_dtype = run_settings(cfg).amp_dtype
        self.on_divergence, self.max_bad_steps = self._on_divergence(train)
        self.check_layout(cfg, tp, pp, self.accumulation)
        self.ctx = distributed.init(dp=cfg.dist.dp, tp=cfg.dist.tp, pp=cfg.dist.pp,
                             sequence_parallel=cfg.dist.get("sequence_parallel", False),
                             timeout=cfg.dist.get("init_timeout"))
        self.output_dir = Path(train.output_dir)
        setup_logging(self.output_dir, self.ctx.rank)
        if auto_layout is not None:
            logger.info("dist.auto: %s", auto_layout)
        logger.info("%s; %d micro-batch(es) of %d per step, global batch %d", self.ctx, self.accumulation,
                    train.micro_batch_size, train.global_batch_size)
        self.heartbeat = Heartbeat(distributed.progress_store(), self.ctx.rank, self.ctx.world_size)
        seed_all(train.seed)
        self.data_parallel = DataParallel(
            self.ctx, train.zero_stage, offload=train.get("zero_offload", False),
            param_dtype=fsdp_param_dtype(self.amp_dtype, train.zero_stage))
        built = self.build_model(cfg)
        self.model_parts, self.pipeline, self.flops_per_token = built.parts, built.pipeline, built.flops_per_token
        self.whole_model = built.whole
        self.layers = [layer for part in self.model_parts for layer in get_layer_stack(part)]
        self.train_dataset = instantiate(cfg.dataloader.train)
        check_dataset(self.train_dataset, **self.whole_model.input_limits())
        self.optimizer = self.build_optimizer(cfg, self.model_parts)
        self.scheduler = self.build_lr_scheduler(cfg, self.optimizer)
        self.step = TrainStep(self.model_parts, self.optimizer, device=self.ctx.device, amp_dtype=self.amp_dtype,
                              clip_grad_norm=train.get("clip_grad_norm"), data_parallel=self.data_parallel,
                              pipeline=self.pipeline)
        self.data_position = DataPosition(self._stream_start(cfg))
        self.checkpointer = Checkpointer(self.output_dir, self.model_parts, self.optimizer,
                                         stateful={"scheduler": self.scheduler, "scaler": self.step.scaler,
                                                   "data": self.data_position},
                                         aliases=self.pipeline.tied_aliases() if self.pipeline else None,
                                         async_save=train.checkpoint.get("async_save", False),
                                         timeout=cfg.dist.get("timeout"))
        self.test_loader = self.build_test_loader(cfg)
        self.evaluator = self.build_evaluator(cfg)
        self.goodput = Goodput(self.output_dir, started_at) if self.ctx.is_main_process else None
        self.register_hooks(self.build_hooks())
        self._bad_steps: list[int] = []  # the iterations of the current run of non-finite steps
        self._rollbacks: dict[int, int] = {}  # checkpoint iteration -> rollbacks to it
        self._data_stack = ExitStack()
        self.resumes = True  # resume_or_load(resume=False) starts a new run over the directory
        if self.ctx.is_main_process:  # only a run that passed every check leaves more than its log
            LazyConfig.save(cfg, self.output_dir / "config.yaml")

    # ---------------------------------------------------------------------------------- checks
    @staticmethod
    def _accumulation(train: DictConfig, dp: int) -> int:
        per_step = train.micro_batch_size * dp
        if train.global_batch_size % per_step:
            raise ValueError(f"train.global_batch_size = {train.global_batch_size} is not a multiple of "
                             f"micro_batch_size × dp = {train.micro_batch_size} × {dp} = {per_step}: change one "
                             f"of them (the quotient is the number of accumulated micro-batches)")
        return train.global_batch_size // per_step

    @staticmethod
    def _on_divergence(train: DictConfig) -> tuple[str, int]:
        """(train.on_divergence, train.max_bad_steps), checked."""
        action, limit = train.get("on_divergence", "stop"), train.get("max_bad_steps", 5)
        if action not in ("stop", "rollback"):
            raise ValueError(f"train.on_divergence = {action!r} must be 'stop' or 'rollback'")
        if limit < 1:
            raise ValueError(f"train.max_bad_steps = {limit} must be at least 1")
        return action, limit

    @staticmethod
    def check_layout(cfg: DictConfig, tp: int, pp: int, num_micro_batches: int) -> None:
        """Refuse, before any process group exists, a model that cannot be split over tp or into pp
        stages (it is built on the meta device: no memory, nothing read but a config)."""
        with torch.device("meta"):
            model = instantiate(cfg.model)
        problems = distributed.tp_problems(model, tp) if tp > 1 else []
        if problems:
            raise ValueError(f"the model cannot be split over dist.tp = {tp}:\n  " + "\n  ".join(problems))
        if pp > 1:
            pipe = run_settings(cfg).pipeline
            check_pipeline_layout(len(get_layer_stack(model)), pp, schedule=pipe.schedule,
                                  num_micro_batches=num_micro_batches, virtual_stages=pipe.virtual_stages,
                                  boundaries=pipe.boundaries)

    # -------------------------------------------------------------------------------- builders
    def build_model(self, cfg: DictConfig) -> BuiltModel:
        """instantiate(cfg.model) on the meta device (a model, or a from_pretrained call: nothing is
        read yet; it implements the model contract), split over tp, cut into this rank's pipeline
        stages (pp > 1), with activation checkpointing and torch.compile per layer of the layer
        stack if asked, wrapped for data parallelism (ZeRO 0-3); then each rank allocates only its
        own shards and fills them (`materialize`: the checkpoint's slices, or fresh weights drawn
        alike at every layout from ``train.seed``); in train mode."""
        with torch.device("meta"):
            model = instantiate(cfg.model)
        logger.info("model: %s, %.2fM parameters", type(model).__name__,
                    sum(p.numel() for p in model.parameters()) / 1e6)
        self.add_lora(cfg, model)
        settings = run_settings(cfg)
        built = parallelize(model, self.ctx, self.data_parallel, num_micro_batches=self.accumulation,
                            pipeline=settings.pipeline,
                            activation_checkpoint=cfg.train.activation_checkpoint.enabled,
                            compile_with=cfg.train.get("compile", False))
        model, parts, pipeline = built.model, built.parts, built.pipeline
        seq_len = settings.seq_len  # MFU needs it; of the whole model, not of a pipeline stage
        flops_per_token = model.flops_per_token(seq_len) if seq_len else None
        aliases = pipeline.tied_aliases() if pipeline is not None else None
        start = time.perf_counter()
        # ZeRO offload keeps the shards in CPU memory: allocate them there (FSDP2 pins them)
        device = torch.device("cpu") if self.data_parallel.offload else self.ctx.device
        loaded = [materialize(part, device, seed=cfg.train.seed, model=model, aliases=aliases) for part in parts]
        logger.info("model materialised in %.1f s: %s", time.perf_counter() - start,
                    f"{sum(i['bytes_read'] for i in loaded) / 2**20:.2f} MiB read from {model.pretrained_source.path}"
                    if loaded[0] else f"fresh weights from seed {cfg.train.seed}")
        return BuiltModel([part.train() for part in parts], pipeline, flops_per_token, model)

    def add_lora(self, cfg: DictConfig, model: nn.Module) -> None:
        """``train.lora``: LoRA adapters on the (meta-built) model, the rest frozen (`apply_lora_config`).
        Started from a PEFT adapter, each adapted layer's rank and alpha are recorded in
        ``train.lora.layers``, so config.yaml rebuilds the model (a restart of the run, an export)
        without the adapter directory."""
        lora = cfg.train.get("lora") or {}
        saved = self.output_dir / "config.yaml"
        if lora.get("adapter") and not lora.get("layers") and saved.is_file():
            cfg.train.lora.layers = (LazyConfig.load(str(saved)).train.get("lora") or {}).get("layers")
        layers = apply_lora_config(model, lora)
        if lora.get("adapter") and not lora.get("layers"):
            if lora.get("rank"):
                logger.warning("train.lora.adapter is set: the adapter's ranks, alphas and layers are used, not "
                               "train.lora.rank/alpha/target_modules")
            cfg.train.lora.layers = {name: list(shape) for name, shape in layers.items()}
        adapted = lora_layers(model)
        if adapted:
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            total = sum(p.numel() for p in model.parameters())
            logger.info("LoRA on %d layers (%s): %.3fM of %.2fM parameters train (%.2f%%), the rest are frozen",
                        len(adapted), ", ".join(sorted({name.rpartition(".")[2] for name in adapted})),
                        trainable / 1e6, total / 1e6, 100 * trainable / total)

    def build_optimizer(self, cfg: DictConfig, model_parts: list[nn.Module]) -> torch.optim.Optimizer:
        """instantiate(cfg.optim) with its ``params`` built for the model parts (param_groups by default)."""
        return build_optimizer(cfg.optim, model_parts)

    def build_lr_scheduler(self, cfg: DictConfig, optimizer: torch.optim.Optimizer):
        return instantiate(_with(cfg.train.scheduler, optimizer=optimizer, max_iter=cfg.train.max_iter))

    def build_train_loader(self, cfg: DictConfig, consumed_samples: int = 0) -> DataLoader | Iterable:
        """The training data (`train_dataset`), resuming after `consumed_samples` (a global count).
        A stream (a torch IterableDataset) continues from the data position's state, skips on to
        `consumed_samples` (the batches a rollback skipped) and yields this rank's micro-batches,
        each with the stream's state after it (`stream_micro_batches`)."""
        dataset = self.train_dataset
        if isinstance(dataset, IterableDataset):
            skip = consumed_samples - self.data_position.stream_samples
            if skip < 0:
                raise ValueError(f"the stream's saved state is {-skip} samples past the step count's position "
                                 f"({consumed_samples} samples): a stream cannot go back; resume from the "
                                 f"checkpoint the state was saved with")
            dataset.load_state_dict(self.data_position.stream)
            return stream_micro_batches(dataset, cfg.train.micro_batch_size, dp_rank=self.ctx.dp_rank,
                                        dp_size=self.ctx.dp, skip=skip)
        sampler = MicroBatchSampler(len(dataset), cfg.train.micro_batch_size, dp_rank=self.ctx.dp_rank,
                                    dp_size=self.ctx.dp, shuffle=cfg.dataloader.get("shuffle", True),
                                    seed=cfg.train.seed, consumed_samples=consumed_samples,
                                    global_batch_size=cfg.train.global_batch_size)
        # Its own generator: starting an iterator draws a seed, which must not move the global RNG
        # (dropout) differently in a resumed run than in an uninterrupted one.
        generator = torch.Generator().manual_seed(cfg.train.seed + consumed_samples)
        return DataLoader(dataset, batch_sampler=sampler, num_workers=cfg.dataloader.get("num_workers", 0),
                          generator=generator)

    def build_test_loader(self, cfg: DictConfig) -> DataLoader | None:
        """The evaluation data in order; under pp in batches of all the micro-batches of a step (the
        pipeline splits them), dropping a last batch that does not fill them."""
        if cfg.dataloader.get("test") is None:
            return None
        pipelined = self.pipeline is not None
        if pipelined and not self.pipeline.evaluates:
            raise ValueError(f"dataloader.test is set but train.pipeline.schedule = {self.pipeline.schedule_name!r} "
                             f"cannot evaluate (torch has no forward-only schedule for its V-placed stages): use "
                             f"another schedule (zero_bubble, interleaved_1f1b), or set dataloader.test=null")
        batch_size = cfg.train.micro_batch_size * (self.accumulation if pipelined else 1)
        dataset = instantiate(cfg.dataloader.test)
        if isinstance(dataset, IterableDataset):
            raise ValueError("dataloader.test is a stream: an evaluation needs the same samples every time; build "
                             "the test set map-style (e.g. build_text_dataset(..., streaming=False))")
        check_dataset(dataset, **self.whole_model.input_limits())
        return DataLoader(dataset, batch_size=batch_size, shuffle=False, drop_last=pipelined)

    def build_evaluator(self, cfg: DictConfig) -> Evaluator:
        return instantiate(cfg.evaluator) if cfg.get("evaluator") is not None else Evaluator()

    def build_hooks(self) -> list[hooks.HookBase]:
        """The built-in hooks, then the config's own ``hooks`` list (LazyCalls of HookBase subclasses)."""
        train = self.cfg.train
        peak = peak_flops(self.ctx.device, self.amp_dtype or torch.float32)
        result = [hooks.IterationTimer(self.flops_per_token, peak, self.ctx.world_size),
                  fault_injector(self.ctx.rank, self.output_dir),  # inside the timed step: a slow rank shows
                  hooks.LRScheduler(self.optimizer, self.scheduler)]
        eval_period = train.eval.period
        if self.test_loader is not None:
            result.append(hooks.EvalHook(1 if self.fast_dev_run else eval_period, self.test))
            if train.get("best_metric"):
                result.append(hooks.BestCheckpointer(self.checkpointer, train.best_metric,
                                                     train.get("best_mode", "max")))
        if not self.fast_dev_run:
            result.append(hooks.PeriodicCheckpointer(self.checkpointer, train.checkpoint.period,
                                                     train.checkpoint.get("max_to_keep")))
        log_period = 1 if self.fast_dev_run else train.log_period
        result += [hooks.CheckpointCommitter(self.checkpointer),
                   hooks.StepTimeSpread(log_period, self.ctx.device) if self.ctx.world_size > 1 else None,
                   self.goodput]
        if self.ctx.is_main_process:
            writers = [ConsoleWriter(), JSONWriter(self.output_dir / "metrics.json")]
            if train.get("tensorboard", False):
                writers.append(TensorBoardWriter(self.output_dir / "tensorboard"))
            result += [hooks.PeriodicWriter(writers, log_period), hooks.ProgressBar()]
        result += [instantiate(hook) for hook in self.cfg.get("hooks") or []]
        return result + [Preemption(self._save_now, self.ctx.device)]  # last: every hook saw the step

    def _stream_start(self, cfg: DictConfig) -> dict | None:
        """The state a fresh run reads a stream (a torch IterableDataset as ``dataloader.train``)
        from; None for map-style data. A stream must tell where it stands (state_dict and
        load_state_dict) and is read in this process, in order (the prefetch thread reads ahead)."""
        dataset = self.train_dataset
        if not isinstance(dataset, IterableDataset):
            return None
        if not all(callable(getattr(dataset, name, None)) for name in ("state_dict", "load_state_dict")):
            raise ValueError(f"the training stream ({type(dataset).__name__}) has no state_dict() and "
                             f"load_state_dict(), so a resumed run could not continue where it stopped: use "
                             f"build_text_dataset(..., streaming=True), or give the stream both")
        workers = cfg.dataloader.get("num_workers", 0)
        if workers:
            raise ValueError(f"dataloader.num_workers = {workers}, but a stream is read in the training process "
                             f"(its exact position cannot be read back from workers): set dataloader.num_workers=0 "
                             f"(dataloader.prefetch reads ahead in a thread)")
        logger.info("training data: a stream, read in order (not shuffled); every dp rank reads all of it and "
                    "keeps its own micro-batches")
        return dataset.state_dict()

    # ------------------------------------------------------------------------------------ resume
    def resume_or_load(self, resume: bool = True) -> None:
        """With `resume` and a checkpoint in output_dir: restore everything from the newest intact
        one (a damaged one is skipped with a warning naming its bad file). Otherwise start at 0,
        from ``train.load_weight`` if set (a Hugging Face directory or a trainer checkpoint:
        weights only)."""
        self.resumes = resume
        self.checkpointer.remove_incomplete()
        path = self.checkpointer.find_resumable() if resume else None
        if path is None and resume and commit.resumable_candidates(self.output_dir):
            raise RuntimeError(f"every checkpoint in {self.output_dir} is damaged (see the warnings above): restore "
                               f"one, or start over with --no-resume (resume_or_load(resume=False))")
        if path is not None:
            self.start_iter = self.checkpointer.resume(path)
            logger.info("resumed from %s at iteration %d", path, self.start_iter)
            return
        if resume:
            logger.info("no checkpoint in %s: starting from scratch", self.output_dir)
        self.start_iter = 0
        weights = self.cfg.train.get("load_weight")
        if weights:
            self.load_weight(weights)
        adapter = (self.cfg.train.get("lora") or {}).get("adapter")
        if adapter:
            factors = read_peft_adapter(adapter, self.whole_model)  # read once for all of this rank's parts
            for part in self.model_parts:
                load_peft_adapter(part, adapter, factors)
            logger.info("LoRA adapters loaded from %s", adapter)

    def load_weight(self, path: str | Path) -> None:
        """Model weights only, from a Hugging Face directory or a trainer checkpoint (any layout)."""
        path = Path(path)
        if (path / "config.json").is_file():
            aliases = self.pipeline.tied_aliases() if self.pipeline is not None else None
            with HFWeightReader(path) as reader:
                check_hf_weights(self.whole_model, reader)  # every rank, every stage's names: all fail alike
                for part in self.model_parts:
                    load_hf_weights(part, reader, aliases=aliases)
        else:
            self.checkpointer.check_adapters(path, self.whole_model)
            self.checkpointer.load(path)
        logger.info("loaded weights from %s", path)

    # ------------------------------------------------------------------------------- the loop
    def train(self) -> None:
        """Train from `start_iter` (set by resume_or_load) to ``train.max_iter``. A collective that
        fails or times out is reported with the ranks it waited for (their last heartbeats)."""
        max_iter = self.start_iter + 2 if self.fast_dev_run else self.cfg.train.max_iter
        if self.start_iter >= max_iter:
            logger.info("the run is already at train.max_iter = %d: nothing to train (raise train.max_iter to go on, "
                        "or start over with --no-resume)", max_iter)
        with self._data_stack:
            self._open_data(self.start_iter)
            try:
                super().train(self.start_iter, max_iter)
            except (Preempted, DivergenceError, KeyboardInterrupt):
                raise
            except Exception as error:
                if self.ctx.world_size > 1 and _is_collective_failure(error):
                    self.heartbeat.report(error)
                raise

    def _open_data(self, iteration: int) -> None:
        """Read the training data from the batch of step `iteration` + 1 on (after the batches a
        rollback skipped); a thread reads ``dataloader.prefetch`` batches ahead (0: none)."""
        self._data_stack.close()
        samples = (iteration + self.data_position.skipped_batches) * self.cfg.train.global_batch_size
        loader = self.build_train_loader(self.cfg, samples)
        depth = self.cfg.dataloader.get("prefetch", 2)
        batches = iter(self._data_stack.enter_context(Prefetcher(loader, depth)) if depth else loader)
        if isinstance(self.train_dataset, IterableDataset):
            batches = self._follow_stream(batches, samples)
        self._data = batches

    def _follow_stream(self, items: Iterator[tuple[dict, dict]], samples: int) -> Iterator[dict]:
        """A stream's micro-batches; taking one moves the data position to the stream's state after
        it (read ahead by the prefetch thread, carried with the batch), so the checkpoint after a
        step holds the state after the step's last micro-batch."""
        chunk = self.cfg.train.micro_batch_size * self.ctx.dp
        for batch, state in items:
            samples += chunk
            self.data_position.stream, self.data_position.stream_samples = state, samples
            yield batch

    def run_step(self) -> None:
        step = self.iter + 1
        self.heartbeat.beat(step, "waiting for data")
        start = time.perf_counter()
        micro_batches = [next(self._data) for _ in range(self.accumulation)]
        data_time = time.perf_counter() - start
        self.heartbeat.beat(step, "forward, backward and optimizer step")
        metrics = self.step(micro_batches)
        self.storage.put_scalars(data_time=data_time, **metrics)
        if self.iter == self.start_iter and self.cfg.dist.get("timeout"):
            self.ctx.set_timeout(self.cfg.dist.timeout)  # start-up is done: the shorter bound from now on
        self._watch_divergence(metrics)
        self.heartbeat.beat(step, "hooks after the step (checkpoint, evaluation, logging)")

    def _watch_divergence(self, metrics: dict) -> None:
        """Count steps in a row whose loss or gradient norm was not finite (skipped on every rank);
        after ``train.max_bad_steps`` stop with an error, or roll back (``train.on_divergence``)."""
        if not metrics["diverged"]:
            self._bad_steps.clear()
            return
        self._bad_steps.append(self.iter)
        if len(self._bad_steps) < self.max_bad_steps:
            return
        first, last = self._bad_steps[0] + 1, self.iter + 1
        what = (f"steps {first}..{last} had a non-finite loss or gradient norm (last loss {metrics['loss']}, "
                f"gradient norm {metrics['grad_norm']}); parameters whose gradients were not finite on rank "
                f"{self.ctx.rank}: {', '.join(self.step.nonfinite_grads) or 'none (the loss itself)'}")
        if self.on_divergence == "rollback":
            self._roll_back(first - 1, what)
        raise DivergenceError(f"the run diverged: {what}. Lower optim.lr or raise the warm-up, look at the data "
                              f"of those steps, or set train.on_divergence=rollback to go back to the last good "
                              f"checkpoint and skip those batches")

    def _roll_back(self, good: int, what: str) -> None:
        """Restore the newest intact checkpoint of at most `good` steps, skip the data batches read
        since it (PaLM's recipe), and go on from there (raises `RolledBack`)."""
        path = self.checkpointer.find_resumable(at_most=good)
        if path is None:
            raise DivergenceError(f"the run diverged and there is no intact checkpoint of at most {good} steps to "
                                  f"roll back to: {what}. Lower optim.lr, or save more often "
                                  f"(train.checkpoint.period) and keep more (train.checkpoint.max_to_keep)")
        position = self.iter + 1 + self.data_position.skipped_batches  # the next batch of the data stream
        back_to = self.checkpointer.resume(path)
        self._rollbacks[back_to] = self._rollbacks.get(back_to, 0) + 1
        if self._rollbacks[back_to] > MAX_ROLLBACKS_TO_ONE_CHECKPOINT:
            raise DivergenceError(f"the run diverged again after {MAX_ROLLBACKS_TO_ONE_CHECKPOINT} rollbacks to "
                                  f"{path}: {what}. Lower optim.lr or look at the data")
        skipped = position - back_to - self.data_position.skipped_batches
        self.data_position.skipped_batches = position - back_to
        logger.warning("the run diverged (%s): rolled back to %s (after %d steps); skipping the %d data batches "
                       "read since it (steps %d..%d)", what, path, back_to, skipped, back_to + 1, self.iter + 1)
        # A restart from here on must find this state, the skipped batches included, and nothing newer.
        self.checkpointer.discard_after(back_to)
        self.checkpointer.save(path.name, back_to)
        self.checkpointer.wait()
        self._bad_steps.clear()
        self._open_data(back_to)
        if self.goodput is not None:
            self.goodput.rolled_back(back_to, self.iter + 1)
        raise RolledBack(back_to)

    def _save_now(self, done: int) -> Path:
        """Checkpoint the run after `done` steps unless that step's checkpoint exists; return it
        once committed (every rank calls this)."""
        path = self.output_dir / f"model_{done:07d}"
        if path not in (self.checkpointer.pending, self.checkpointer.last_committed):
            self.checkpointer.save(path.name, done)
        self.checkpointer.wait()
        if self.goodput is not None:
            self.goodput.checkpointed(done)
        return path

    def test(self) -> dict[str, float]:
        """Evaluate on the test loader (``train.eval.max_batches`` batches at most)."""
        if self.test_loader is None:
            raise ValueError("no test data: set dataloader.test in the config")
        max_batches = 2 if self.fast_dev_run else self.cfg.train.eval.get("max_batches")
        forward = pipelined_forward(self.pipeline, self.model_parts[0]) if self.pipeline is not None else self.model
        return run_evaluation(self.model_parts, self.test_loader, self.evaluator, forward, device=self.ctx.device,
                              amp_dtype=self.amp_dtype, max_batches=max_batches)

    # ------------------------------------------------------------------------------- the model
    @property
    def model(self) -> nn.Module:
        """The whole model, when this rank holds it (no pipeline parallelism)."""
        if self.pipeline is not None:
            raise AttributeError("this rank holds pipeline stages, not the whole model: use trainer.model_parts")
        return self.model_parts[0]

    @contextmanager
    def generation_model(self) -> Iterator[tuple[nn.Module, torch.device] | None]:
        """(the model ready for `generate`, in eval mode inside the block, gathering at most one layer at a
        time under ZeRO (`parallel.layer_by_layer`); the device its inputs go to), or None when this
        rank holds pipeline stages."""
        if self.pipeline is not None:
            yield None
            return
        model = self.model
        was_training = model.training
        model.eval()
        try:
            with layer_by_layer(model, self.data_parallel) as generating:
                yield generating, self.ctx.device
        finally:
            model.train(was_training)
