"""Train (or evaluate) a model described by a LazyConfig file.

    python tools/train.py projects/gpt2_pretrain/config.py
    python tools/train.py CONFIG.py train.max_iter=100 optim.lr=3e-4 dist.tp=2
    torchrun --nproc_per_node=2 tools/train.py CONFIG.py dist.tp=2
    torchrun --nproc_per_node=4 tools/train.py CONFIG.py --auto-layout         # the planner picks the layout
    torchrun --nproc_per_node=8 --max-restarts=3 tools/train.py CONFIG.py dist.tp=8    # survives lost ranks

A run resumes by itself from the newest intact checkpoint in train.output_dir (a first start has
none and starts fresh), so a restarted or requeued job simply runs the same command again;
`--resume` insists on a checkpoint (an error if there is none), `--no-resume` starts over.
Exit codes: 0 done; 75 (EX_TEMPFAIL) stopped by SIGTERM/SIGINT after saving a checkpoint: run it
again to resume (under torchrun each worker exits 75 and torchrun itself non-zero); 2 the config,
or a file it names, is wrong (the one line printed says which key and the fix); 1 anything else
(with several processes the process exits at once, without the teardown a dead peer could hang,
so torchrun can restart the job).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from pathlib import Path

# torch, transformers and the zoo are imported once the arguments are read: --help answers at once


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tools/train.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="a LazyConfig .py (or a saved config.yaml) with model, optim, dataloader, "
                                       "train and dist")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. train.max_iter=100 optim.lr=1e-3; a key that does not exist "
                             "is an error (prefix it with + to add one to model, optim or a key of your own; train, "
                             "dist and dataloader hold only the schema's keys)")
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true",
                        help="continue from the newest intact checkpoint in train.output_dir, and fail if there is "
                             "none (LiBai's and detectron2's flag; without it a run also resumes, but starts fresh "
                             "when the directory holds no checkpoint)")
    resume.add_argument("--no-resume", action="store_true",
                        help="start from scratch (or train.load_weight) even if train.output_dir holds checkpoints "
                             "(the new run writes its own over them; every torchrun restart would start over too); "
                             "by default a run continues from the newest intact checkpoint there (model, optimizer, "
                             "schedule, loss scale, RNG and data position)")
    parser.add_argument("--auto-layout", action="store_true",
                        help="let the layout planner (tools/plan.py) pick dist.dp/tp/pp, sequence parallelism, ZeRO, "
                             "recomputation (train.activation_checkpoint: full, selective, block), micro-batch size "
                             "and pipeline schedule for the launched "
                             "world size (same as dist.auto=true); the log says what it chose and why")
    parser.add_argument("--eval-only", action="store_true",
                        help="evaluate on dataloader.test (the newest checkpoint, or train.load_weight) and exit")
    parser.add_argument("--fast-dev-run", action="store_true",
                        help="smoke test: 2 training steps from the start (the recipe's weights), logging every "
                             "step, 2 evaluation batches, no checkpoints, everything in train.output_dir/fast_dev_run "
                             "(emptied first; the run's own files are neither read nor written)")
    args = parser.parse_intermixed_args(argv)
    if args.fast_dev_run and (args.resume or args.eval_only):
        parser.error("--fast-dev-run starts from the recipe's weights in a folder of its own: it resumes and "
                     "evaluates no checkpoint (drop --resume / --eval-only)")
    return args


def require_checkpoint(output_dir: Path) -> None:
    """`--resume`: refuse to start when `output_dir` holds no committed checkpoint (before any process
    group or model is built)."""
    from libai_zoo.checkpoint import commit
    from libai_zoo.config import ConfigError
    if not commit.resumable_candidates(output_dir):
        raise ConfigError(f"--resume: {output_dir} holds no checkpoint to resume from (no {commit.POINTER} "
                          f"naming one): check train.output_dir, or start fresh by running without --resume "
                          f"(or with --no-resume to start over a directory that holds checkpoints)")


def main(argv: list[str] | None = None) -> dict | None:
    return run(parse_args(argv))


def run(args: argparse.Namespace) -> dict | None:
    """Train (or evaluate) as `args` say; the results of an evaluation."""
    from libai_zoo import distributed
    from libai_zoo.config import LazyConfig
    from libai_zoo.engine import DefaultTrainer, Preempted
    cfg = LazyConfig.apply_overrides(LazyConfig.load(args.config), args.overrides)
    if args.auto_layout:
        cfg.dist["auto"] = True
    if args.resume:
        require_checkpoint(Path(cfg.train.output_dir))
    trainer = DefaultTrainer(cfg, fast_dev_run=args.fast_dev_run)
    try:
        trainer.resume_or_load(resume=not args.no_resume)
        if args.eval_only:
            results = trainer.test()
            logging.getLogger("libai_zoo").info("evaluation: %s", results)
            distributed.destroy()
            return results
        trainer.train()
    except BaseException as error:
        if distributed.launched_world_size() == 1 or isinstance(error, Preempted):
            distributed.destroy()  # with several processes a dead or hung peer could block the teardown
        raise
    distributed.destroy()
    return None


def is_config_error(error: BaseException) -> bool:
    """A `ConfigError` about the config or the files it names, whose message is all a user needs;
    not one wrapping a bug in code the config called (every error of its chain is a ConfigError
    or an OSError), whose traceback is wanted."""
    from libai_zoo.config import ConfigError
    chain = error
    while chain is not None:
        if not isinstance(chain, (ConfigError, OSError)):
            return False
        chain = chain.__cause__
    return isinstance(error, ConfigError)


if __name__ == "__main__":
    arguments = parse_args()  # --help and a usage error answer here, before the imports and the handling below
    try:
        run(arguments)
    except BaseException as error:
        from libai_zoo import distributed
        from libai_zoo.engine import Preempted
        if isinstance(error, Preempted):
            sys.exit(error.exit_code)
        alone = distributed.launched_world_size() == 1
        if is_config_error(error):
            if os.environ.get("LOCAL_RANK", "0") == "0":  # the ranks refuse alike: one message a node
                rank = os.environ.get("RANK", "0")
                print(f"tools/train.py: error{'' if rank == '0' else f' (rank {rank})'}: {error}", file=sys.stderr)
            code = 2
        elif alone:
            raise
        else:
            traceback.print_exc()
            code = 1
        for handler in logging.getLogger("libai_zoo").handlers:
            handler.flush()
        sys.stderr.flush()
        if alone:
            sys.exit(code)
        os._exit(code)  # skip interpreter teardown: threads waiting on a dead peer would keep the process alive
