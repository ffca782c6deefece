"""The run: `train` (loop, precision, memory, checkpoints, evaluation) and `dist` (the layout).

    cfg = get_config("common/train.py")         # keys: train, dist
    python tools/train.py RECIPE.py train.max_iter=100 train.amp.enabled=true dist.tp=2
"""

from libai_zoo.config import LazyCall

train = dict(
    output_dir="output",            # checkpoints, logs and the run's config.yaml go here
    max_iter=1000,                  # optimizer steps in the run
    seed=42,
    micro_batch_size=8,             # samples in one forward/backward on one dp rank
    global_batch_size=8,            # samples per optimizer step over all dp ranks:
                                    # micro_batch_size × dp × gradient-accumulation steps
    amp=dict(enabled=False, dtype="bf16"),       # autocast forward; dtype "bf16" or "fp16"
    activation_checkpoint=dict(enabled=False),   # recompute layer activations in backward to save memory
    zero_stage=0,                   # ZeRO: 0 off; 1 shards optimizer state, 2 + gradients, 3 + parameters
    zero_offload=False,             # keep the sharded state in CPU memory
    compile=False,                  # torch.compile each transformer layer (True: inductor; or a backend name)
    log_period=10,                  # iterations between metric logs
    # Save every `period` iterations; None keeps all. async_save: write in the background (the loop
    # waits only while the state is copied; the checkpoint counts once every rank has written it).
    checkpoint=dict(period=500, max_to_keep=None, async_save=False),
    eval=dict(period=0, max_batches=None),           # eval every `period` iterations (0: no periodic
                                                     # eval); None: the whole eval set
    clip_grad_norm=1.0,             # clip the global gradient norm to this; None: no clipping
    # A step whose loss or gradient norm is not finite is skipped on every rank; after max_bad_steps
    # such steps in a row the run stops with an error ("stop"), or ("rollback") reloads the newest
    # checkpoint from before them and skips the data batches read since it.
    max_bad_steps=5,
    on_divergence="stop",
    load_weight=None,               # a checkpoint or Hugging Face directory to start from; None: fresh init
    # LoRA (rank 0: full fine-tuning): a low-rank adapter on each target Linear (default: the attention and
    # MLP projections: qkv, out, gate, up, down), split as its layer is split over tp; every other parameter
    # is frozen (no gradient, no optimizer state). adapter: a PEFT adapter directory to start the adapters from
    # (its layers, ranks and alphas replace rank/alpha/target_modules; the run records them in layers).
    lora=dict(rank=0, alpha=16.0, dropout=0.0, target_modules=None, adapter=None, layers=None),
    # The LR schedule; the trainer fills in the optimizer and the run length when it builds it.
    # Also in libai_zoo.optim: WarmupLinearLR, ConstantLR.
    scheduler=LazyCall("libai_zoo.optim.WarmupCosineLR")(warmup_iters=0, min_lr_ratio=0.0),
    tensorboard=False,              # also write TensorBoard event files under output_dir
    best_metric=None,               # an eval metric (e.g. "accuracy") whose best checkpoint is kept; None: none
    best_mode="max",                # "max" or "min": which way best_metric improves
    # Pipeline parallelism (dist.pp > 1): the schedule ("gpipe", "1f1b", "interleaved_1f1b",
    # "zero_bubble", "zbv"), stages per rank (>= 2 for the interleaved ones) and, optionally, the
    # first layer of each stage after the first. The micro-batches a step pipelines are
    # global_batch_size / (micro_batch_size × dp).
    pipeline=dict(schedule="1f1b", virtual_stages=1, boundaries=None),
)

# Parallel layout, read by distributed.init: data × tensor × pipeline = number of processes
# (dp=-1 infers dp from the world size). sequence_parallel splits norms and dropout over the
# sequence inside the tp group. Timeouts in seconds: init_timeout bounds forming the process group
# and every collective until the first step is done; timeout every collective after it (a rank
# that waits longer names the ranks that did not arrive and exits non-zero, so torchrun restarts).
# auto=True (tools/train.py --auto-layout): the layout planner (libai_zoo.plan, tools/plan.py) picks
# dp, tp, pp, sequence_parallel, train.zero_stage, train.activation_checkpoint, train.micro_batch_size
# and train.pipeline for the launched world size at start-up, and logs what it chose and why.
dist = dict(dp=1, tp=1, pp=1, sequence_parallel=False, init_timeout=600, timeout=300, auto=False)
