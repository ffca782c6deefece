"""`DefaultTrainer(cfg)`: the standard recipe around the loop, every part overridable (the
`build_*` methods). docs/design.md §5 follows one step through it; docs/long_jobs.md says what a run
survives (resume, preemption, divergence, a timed-out collective).

Batch sizes: each process runs ``train.micro_batch_size`` samples per forward and accumulates
``global_batch_size / (micro_batch_size × dp)`` micro-batches per optimizer step.

The ``dataloader`` keys (the datasets, workers, shuffling, prefetch): `DataLoaderConfig` in
libai_zoo/config/schema.py.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from libai_zoo import distributed
from libai_zoo.checkpoint import Checkpointer, CheckpointManager
from libai_zoo.config import LazyConfig, instantiate, run_settings, typed
from libai_zoo.data import MicroBatchSampler, check_dataset, stream_micro_batches
from libai_zoo.hf import HFWeightReader, apply_lora_config, load_hf_parts, load_peft_adapter, read_peft_adapter
from libai_zoo.layers import lora_adapters
from libai_zoo.layers.recomputed import set_elementwise_recompute
from libai_zoo.models import TransformersModel, all_layers, instantiate_model
from libai_zoo.optim import ConfiguredSettings, build_optimizer
from libai_zoo.parallel import (
    DataParallel,
    Parallelized,
    fsdp_param_dtype,
    layer_by_layer,
    materialize,
    parallelize,
    residual_dtype,
)
from libai_zoo.plan import agree_on_layout
from libai_zoo.utils import peak_flops, seed_all, setup_logging

from . import hooks
from .checks import accumulation_steps, check_layout
from .divergence import DivergenceError, DivergenceWatch
from .evaluator import Evaluation, Evaluator, context_parallel_forward, pipelined_forward, run_evaluation
from .events import ConsoleWriter, JSONWriter, TensorBoardWriter
from .faults import fault_injector
from .goodput import Goodput
from .heartbeat import Heartbeat
from .preemption import Preempted, Preemption
from .train_step import StepResult, TrainStep
from .trainer_base import RolledBack, TrainerBase
from .training_data import TrainingData

logger = logging.getLogger("libai_zoo")


def _is_collective_failure(error: BaseException) -> bool:
    """A collective that timed out or lost a peer (gloo raises these; NCCL's watchdog aborts instead)."""
    text = str(error)
    return isinstance(error, dist.DistError) or any(
        word in text for word in ("Timed out", "timed out", "Connection closed", "Connection reset", "gloo", "NCCL"))


def _with(node: DictConfig, **given) -> dict:
    """A LazyCall config as a plain dict, plus arguments only the trainer has (model, optimizer, ...)."""
    return {**OmegaConf.to_container(node, resolve=True), **given}


class DefaultTrainer(TrainerBase):
    """Builds everything a run needs from `cfg` (its keys: libai_zoo/config/schema.py)."""

    def __init__(self, cfg: DictConfig, *, fast_dev_run: bool = False):
        started_at = time.time()
        super().__init__()
        cfg = typed(cfg)  # a config built by hand gets every key of the schema too
        self.cfg, self.fast_dev_run = cfg, fast_dev_run
        auto_layout = None
        if cfg.dist.auto:  # the planner picks dp, tp, pp, ZeRO, AC, SP, micro-batch, schedule
            overrides, auto_layout = agree_on_layout(cfg, timeout=cfg.dist.init_timeout)
            LazyConfig.apply_overrides(cfg, overrides.split())
        self.settings = run_settings(cfg)  # what the config means, read once: the run reads it, not cfg's keys
        train, layout = self.settings.train, self.settings.dist
        # What can be refused without a process group is refused before one exists (checks.py).
        # (every refusal is a ConfigError naming the fix: tools/train.py prints it as one line)
        dp, _, _ = distributed.resolve_sizes(distributed.launched_world_size(), layout.dp, layout.tp, layout.pp,
                                             layout.ep, layout.cp)
        self.accumulation = accumulation_steps(train, dp)
        self.amp_dtype = self.settings.amp_dtype
        self.divergence = DivergenceWatch(train.on_divergence, train.max_bad_steps)
        meta_model = self.build_meta_model(cfg)
        check_layout(meta_model, self.settings, self.accumulation)
        self.ctx = distributed.init(dp=layout.dp, tp=layout.tp, pp=layout.pp, ep=layout.ep, cp=layout.cp,
                                    sequence_parallel=layout.sequence_parallel, timeout=layout.init_timeout)
        # a smoke test writes nowhere a real run reads: its own directory, emptied at each start
        self.output_dir = Path(train.output_dir) / "fast_dev_run" if fast_dev_run else Path(train.output_dir)
        if fast_dev_run:
            if self.ctx.is_main_process:
                shutil.rmtree(self.output_dir, ignore_errors=True)
            self.ctx.barrier()  # emptied before any rank writes its log there
        setup_logging(self.output_dir, self.ctx.rank)
        if fast_dev_run:
            logger.info("--fast-dev-run: 2 steps from the start, into %s (%s itself is not read or written)",
                        self.output_dir, train.output_dir)
        if auto_layout is not None:
            logger.info("dist.auto: %s", auto_layout)
        logger.info("%s; %d micro-batch(es) of %d per step, global batch %d", self.ctx, self.accumulation,
                    train.micro_batch_size, train.global_batch_size)
        self.heartbeat = Heartbeat(distributed.progress_store(), self.ctx.rank, self.ctx.world_size)
        seed_all(train.seed)
        self.data_parallel = DataParallel(self.ctx, train.zero_stage, offload=train.zero_offload,
                                          param_dtype=fsdp_param_dtype(self.amp_dtype))
        built = self.build_model(cfg, meta_model)
        self.model_parts, self.pipeline, self.flops_per_token = built.parts, built.pipeline, built.flops_per_token
        self.whole_model = built.model
        self.layers = [layer for part in self.model_parts for layer in all_layers(part)]
        self.train_dataset = instantiate(cfg.dataloader.train)
        check_dataset(self.train_dataset, **self.whole_model.input_limits())
        self.optimizer = self.build_optimizer(cfg, self.model_parts)
        self.scheduler = self.build_lr_scheduler(cfg, self.optimizer)
        self.configured = ConfiguredSettings(self.optimizer, self.scheduler)  # what a resume keeps of the config
        self.train_step = TrainStep(self.model_parts, self.optimizer, ctx=self.ctx, amp_dtype=self.amp_dtype,
                                    clip_grad_norm=train.clip_grad_norm, data_parallel=self.data_parallel,
                                    pipeline=self.pipeline, expert_bias_update_rate=train.expert_bias_update_rate)
        self.data = TrainingData(self.train_dataset, lambda samples: self.build_train_loader(self.cfg, samples),
                                 global_batch_size=train.global_batch_size, micro_batches=self.accumulation,
                                 samples_per_read=train.micro_batch_size * self.ctx.dp,
                                 prefetch=cfg.dataloader.prefetch, num_workers=cfg.dataloader.num_workers)
        checkpointer = Checkpointer(self.output_dir, self.model_parts, self.optimizer,
                                    stateful={"scheduler": self.scheduler, "scaler": self.train_step.scaler,
                                              "data": self.data.position},
                                    aliases=self.pipeline.tied.aliases() if self.pipeline else None,
                                    async_save=train.checkpoint.async_save, record=LazyConfig.to_yaml(cfg),
                                    model=self.whole_model,
                                    timeout=layout.timeout, group=self.ctx.world_group)
        self.checkpoint_manager = CheckpointManager(checkpointer,
                                                    period=None if fast_dev_run else train.checkpoint.period,
                                                    max_to_keep=train.checkpoint.max_to_keep,
                                                    best_metric=train.best_metric, best_mode=train.best_mode,
                                                    on_restore=self.configured.reapply)  # the config's settings win
        self.preemption = Preemption(self.ctx.device, self.ctx.world_group)
        self.test_loader = self.build_test_loader(cfg)
        self.evaluator = self.build_evaluator(cfg)
        self.started_at = started_at
        self.goodput: Goodput | None = None  # build_hooks makes it (the main process's time account)
        self.last_evaluation: Evaluation | None = None  # the latest evaluation (`complete_step`)
        self.register_hooks(self.build_hooks())
        self.resumes = True  # resume_or_load(resume=False) starts a new run over the directory

    @property
    def checkpointer(self) -> Checkpointer:
        """What writes and reads this run's checkpoints (`checkpoint_manager` decides when and what to keep)."""
        return self.checkpoint_manager.checkpointer

    # -------------------------------------------------------------------------------- builders
    def build_meta_model(self, cfg: DictConfig) -> nn.Module:
        """instantiate(cfg.model) on the meta device: a model, or a from_pretrained call (nothing is
        read yet; it implements the model contract). Built once: the layout checks and
        `build_model` read the same one."""
        with torch.device("meta"):
            return instantiate_model(cfg.model)

    def build_model(self, cfg: DictConfig, model: nn.Module) -> Parallelized:
        """The meta-built `model` with LoRA if asked (`add_lora`), `parallelize`d; then each rank
        allocates only its own shards and fills them (`materialize`: the checkpoint's slices, or fresh
        weights drawn alike at every layout from ``train.seed``); in train mode."""
        logger.info("model: %s, %.2fM parameters", type(model).__name__,
                    sum(p.numel() for p in model.parameters()) / 1e6)
        if isinstance(model, TransformersModel):
            logger.info("%s is transformers' own model, made trainable: %s", type(model).__name__, model.describe())
        self.add_lora(cfg, model)
        set_elementwise_recompute(model, self.settings.elementwise_recompute)
        built = parallelize(model, self.ctx, self.data_parallel, num_micro_batches=self.accumulation,
                            pipeline=self.settings.pipeline,
                            activation_checkpoint=self.settings.activation_checkpoint,
                            compile_with=self.settings.train.compile,
                            residual=residual_dtype(self.amp_dtype, self.settings.train.amp.fp32_residual),
                            float8=self.settings.fp8)
        model, parts, pipeline = built.model, built.parts, built.pipeline
        seq_len = self.settings.seq_len  # MFU needs it; of the whole model, not of a pipeline stage
        aliases = pipeline.tied.aliases() if pipeline is not None else None
        start = time.perf_counter()
        # ZeRO offload keeps the shards in CPU memory: allocate them there (FSDP2 pins them)
        device = torch.device("cpu") if self.data_parallel.offload else self.ctx.device
        loaded = [materialize(part, device, seed=self.settings.train.seed, model=model, aliases=aliases) for part in parts]
        logger.info("model materialised in %.1f s: %s", time.perf_counter() - start,
                    f"{sum(i['bytes_read'] for i in loaded) / 2**20:.2f} MiB read from {model.pretrained_source.path}"
                    if loaded[0] else f"fresh weights from seed {self.settings.train.seed}")
        return dataclasses.replace(built, parts=[part.train() for part in parts],
                                   flops_per_token=model.flops_per_token(seq_len) if seq_len else None)

    def add_lora(self, cfg: DictConfig, model: nn.Module) -> None:
        """``train.lora``: LoRA adapters on the (meta-built) model, the rest frozen (`apply_lora_config`).
        Started from a PEFT adapter, each adapted layer's rank and alpha are recorded in
        ``train.lora.layers``, so config.yaml rebuilds the model (a restart of the run, an export)
        without the adapter directory."""
        lora = cfg.train.lora
        saved = self.output_dir / "config.yaml"
        if lora.adapter and not lora.layers and saved.is_file():
            cfg.train.lora.layers = LazyConfig.load(str(saved)).train.lora.layers
        layers = apply_lora_config(model, lora)
        if lora.adapter and not lora.layers:
            if lora.rank:
                logger.warning("train.lora.adapter is set: the adapter's ranks, alphas and layers are used, not "
                               "train.lora.rank/alpha/target_modules")
            cfg.train.lora.layers = {name: list(shape) for name, shape in layers.items()}
        adapted = lora_adapters(model)
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
        return instantiate(_with(cfg.train.scheduler, optimizer=optimizer, max_iter=self.settings.train.max_iter))

    def build_train_loader(self, cfg: DictConfig, consumed_samples: int = 0) -> DataLoader | Iterable:
        """The training data (`train_dataset`), resuming after `consumed_samples` (a global count).
        A stream (a torch IterableDataset) continues from the data position's state, skips on to
        `consumed_samples` (the batches a rollback skipped) and yields this rank's micro-batches,
        each with the stream's state after it (`stream_micro_batches`)."""
        dataset = self.train_dataset
        if isinstance(dataset, IterableDataset):
            position = self.data.position
            skip = consumed_samples - position.stream_samples
            if skip < 0:
                raise ValueError(f"the stream's saved state is {-skip} samples past the step count's position "
                                 f"({consumed_samples} samples): a stream cannot go back; resume from the "
                                 f"checkpoint the state was saved with")
            dataset.load_state_dict(position.stream)
            return stream_micro_batches(dataset, self.settings.train.micro_batch_size, dp_rank=self.ctx.dp_rank,
                                        dp_size=self.ctx.dp, skip=skip)
        sampler = MicroBatchSampler(len(dataset), self.settings.train.micro_batch_size, dp_rank=self.ctx.dp_rank,
                                    dp_size=self.ctx.dp, shuffle=cfg.dataloader.shuffle,
                                    seed=self.settings.train.seed, consumed_samples=consumed_samples,
                                    global_batch_size=self.settings.train.global_batch_size)
        # Its own generator: starting an iterator draws a seed, which must not move the global RNG
        # (dropout) differently in a resumed run than in an uninterrupted one.
        generator = torch.Generator().manual_seed(self.settings.train.seed + consumed_samples)
        return DataLoader(dataset, batch_sampler=sampler, num_workers=cfg.dataloader.num_workers,
                          generator=generator)

    def build_test_loader(self, cfg: DictConfig) -> DataLoader | None:
        """The evaluation data in order; under pp in batches of all the micro-batches of a step (the
        pipeline splits them), dropping a last batch that does not fill them."""
        if cfg.dataloader.test is None:
            return None
        pipelined = self.pipeline is not None
        if pipelined and not self.pipeline.evaluates:
            raise ValueError(f"dataloader.test is set but train.pipeline.schedule = {self.pipeline.schedule_name!r} "
                             f"cannot evaluate (torch has no forward-only schedule for its V-placed stages): use "
                             f"another schedule (zero_bubble, interleaved_1f1b), or set dataloader.test=null")
        batch_size = self.settings.train.micro_batch_size * (self.accumulation if pipelined else 1)
        dataset = instantiate(cfg.dataloader.test)
        if isinstance(dataset, IterableDataset):
            raise ValueError("dataloader.test is a stream: an evaluation needs the same samples every time; build "
                             "the test set map-style (e.g. build_text_dataset(..., streaming=False))")
        check_dataset(dataset, **self.whole_model.input_limits())
        return DataLoader(dataset, batch_size=batch_size, shuffle=False, drop_last=pipelined)

    def build_evaluator(self, cfg: DictConfig) -> Evaluator:
        return instantiate(cfg.evaluator) if cfg.get("evaluator") is not None else Evaluator()

    def build_hooks(self) -> list[hooks.HookBase]:
        """The built-in hooks, then the config's own ``hooks`` list (LazyCalls of HookBase subclasses).
        They observe the step and the trainer's records (`complete_step` has evaluated and saved by
        then) and the writers write in report_step, after every hook recorded, so their order does
        not matter."""
        train = self.settings.train
        log_period = 1 if self.fast_dev_run else train.log_period
        peak = peak_flops(self.ctx.device, self.amp_dtype or torch.float32)
        built = [hooks.IterationTimer(self.flops_per_token, peak, self.ctx.world_size),
                 fault_injector(self.ctx.rank, self.output_dir)]
        if self.ctx.world_size > 1:
            built.append(hooks.StepTimeSpread(log_period, self.ctx.device, self.ctx.world_group))
        if self.ctx.is_main_process:
            self.goodput = Goodput(self.output_dir, self.started_at)
            writers = [ConsoleWriter(), JSONWriter(self.output_dir / "metrics.json")]
            if train.tensorboard:
                writers.append(TensorBoardWriter(self.output_dir / "tensorboard"))
            built += [self.goodput, hooks.PeriodicWriter(writers, log_period), hooks.ProgressBar()]
        return built + [instantiate(hook) for hook in self.cfg.get("hooks") or []]

    def complete_step(self) -> None:
        """After the step, before the hooks observe it: the learning rate it used is recorded and the
        schedule advances; the test set is evaluated every ``train.eval.period`` steps and after the
        last (`last_evaluation`; the checkpoint manager keeps the best); the checkpoint manager saves
        when a save is due (its `last_saved`) and commits a finished background write."""
        done = self.iter + 1
        self.storage.put_scalar("lr", self.optimizer.param_groups[0]["lr"])
        self.scheduler.step()
        period = 1 if self.fast_dev_run else self.settings.train.eval.period
        if self.test_loader is not None and ((period and done % period == 0) or done == self.max_iter):
            start = time.perf_counter()
            results = self.test()
            self.last_evaluation = Evaluation(done, results, time.perf_counter() - start)
            self.storage.put_scalar("eval_s", self.last_evaluation.seconds)
            self.storage.put_scalars(**{f"eval/{name}": value for name, value in results.items()})
            logger.info("evaluation after %d steps: %s", done,
                        ", ".join(f"{name} = {value:.4f}" for name, value in results.items()))
            self.checkpoint_manager.evaluated(done, results)
        saved = self.checkpoint_manager.after_step(done, last=done == self.max_iter)
        if saved is not None:
            self.storage.put_scalar("checkpoint_s", saved.stall_s)

    def complete_train(self) -> None:
        """Every step ran: the last background checkpoint write is committed."""
        self.checkpoint_manager.finish()

    # ------------------------------------------------------------------------------------ resume
    def resume_or_load(self, resume: bool = True) -> None:
        """With `resume` and a checkpoint in output_dir: restore everything from the newest intact
        one (a damaged one is skipped with a warning naming its bad file). Otherwise start at 0,
        from ``train.load_weight`` if set (a Hugging Face directory or a trainer checkpoint:
        weights only)."""
        self.resumes = resume
        restored = self.checkpoint_manager.start(resume)
        if restored is not None:
            path, self.start_iter = restored
            logger.info("resumed from %s at iteration %d", path, self.start_iter)
            self.train_step.refresh_float8_scales()
            return
        if resume:
            logger.info("no checkpoint in %s: starting from scratch", self.output_dir)
        self.start_iter = 0
        weights = self.settings.train.load_weight
        if weights:
            self.load_weight(weights)
        adapter = self.settings.train.lora.adapter
        if adapter:
            factors = read_peft_adapter(adapter, self.whole_model)  # read once for all of this rank's parts
            for part in self.model_parts:
                load_peft_adapter(part, adapter, factors)
            logger.info("LoRA adapters loaded from %s", adapter)

    def load_weight(self, path: str | Path) -> None:
        """Model weights only, from a Hugging Face directory or a trainer checkpoint (any layout)."""
        path = Path(path)
        if (path / "config.json").is_file():
            aliases = self.pipeline.tied.aliases() if self.pipeline is not None else None
            with HFWeightReader(path) as reader:
                load_hf_parts(self.whole_model, self.model_parts, reader, aliases=aliases)
        else:
            self.checkpointer.load(path)  # refuses another model's checkpoint, adapters included
        self.train_step.refresh_float8_scales()
        logger.info("loaded weights from %s", path)

    # ------------------------------------------------------------------------------- the loop
    def train(self) -> None:
        """Train from `start_iter` (set by resume_or_load) to ``train.max_iter``. A collective that
        fails or times out is reported with the ranks it waited for (their last heartbeats)."""
        max_iter = self.start_iter + 2 if self.fast_dev_run else self.settings.train.max_iter
        if self.start_iter >= max_iter:  # no hook runs: the run's records stay those of what trained
            logger.info("the run is already at train.max_iter = %d: nothing to train (raise train.max_iter to go on, "
                        "or start over with --no-resume)", max_iter)
            return
        if self.ctx.is_main_process:  # the record of what trains, as each checkpoint keeps it
            (self.output_dir / "config.yaml").write_text(self.checkpointer.record)
        try:
            self.data.open(self.start_iter)
            with self.preemption.catching():
                super().train(self.start_iter, max_iter)
        except (Preempted, DivergenceError, KeyboardInterrupt):
            raise
        except Exception as error:
            if self.ctx.world_size > 1 and _is_collective_failure(error):
                self.heartbeat.report(error)
            raise
        finally:
            self.data.close()

    def run_step(self) -> StepResult | RolledBack:
        """One step: its micro-batches, `TrainStep`, then the divergence watch (a rollback restores
        an earlier checkpoint and returns `RolledBack`)."""
        step = self.iter + 1
        self.heartbeat.beat(step, "waiting for data")
        start = time.perf_counter()
        micro_batches = self.data.next_step()
        data_time = time.perf_counter() - start
        self.heartbeat.beat(step, "forward, backward and optimizer step")
        result = self.train_step(micro_batches)
        self.storage.put_scalars(data_time=data_time, **result.scalars())
        if self.iter == self.start_iter and self.settings.dist.timeout:
            self.ctx.set_timeout(self.settings.dist.timeout)  # start-up is done: the shorter bound from now on
        self.heartbeat.beat(step, "after the step (evaluation, checkpoint, hooks)")
        if self.divergence.rollback_due(self.iter, result, self.train_step.nonfinite_grads, self.ctx.rank):
            back_to = self.divergence.roll_back(self.iter, self.checkpoint_manager, self.data.position)
            self.train_step.refresh_float8_scales()
            self.data.open(back_to)
            if self.goodput is not None:
                self.goodput.rolled_back(back_to, self.iter + 1)
            return RolledBack(back_to)
        return result

    def end_step(self) -> None:
        """Every rank agrees whether a SIGTERM/SIGINT arrived on any; if one did, every rank saves
        and the run stops (`Preempted`: exit code 75)."""
        signum = self.preemption.agreed()
        if signum is None:
            return
        done = self.iter + 1
        path = self.checkpoint_manager.save_now(done)
        if self.goodput is not None:
            self.goodput.checkpointed(done)
        raise Preempted(f"stopped on {signum.name} after {done} steps; checkpoint {path} is saved: run the same "
                        f"command again to resume")

    def test(self) -> dict[str, float]:
        """Evaluate on the test loader (``train.eval.max_batches`` batches at most)."""
        if self.test_loader is None:
            raise ValueError("no test data: set dataloader.test in the config")
        max_batches = 2 if self.fast_dev_run else self.settings.train.eval.max_batches
        forward = pipelined_forward(self.pipeline, self.model_parts[0]) if self.pipeline is not None else self.model
        if self.ctx.context_parallel is not None:
            forward = context_parallel_forward(forward, self.model_parts[0], self.ctx.context_parallel)
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
        rank holds pipeline stages. The block autocasts as the training forward does (``train.amp``).
        Under context parallelism each cp rank generates the whole sequence itself, and under sequence
        parallelism each tp rank (`distributed.whole_sequences`: new tokens come one at a time): a
        prompt and its tokens are short, and a KV cache split over cp would be another design."""
        if self.pipeline is not None:
            yield None
            return
        model = self.model
        was_training = model.training
        model.eval()
        try:
            with distributed.whole_sequences(model), layer_by_layer(model, self.data_parallel) as generating, \
                    torch.autocast(self.ctx.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                yield generating, self.ctx.device
        finally:
            model.train(was_training)
