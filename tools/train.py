"""Train (or evaluate) a model described by a LazyConfig file.

    python tools/train.py projects/gpt2_pretrain/config.py
    python tools/train.py CONFIG.py train.max_iter=100 optim.lr=3e-4 dist.tp=2
    torchrun --nproc_per_node=2 tools/train.py CONFIG.py dist.tp=2
"""

from __future__ import annotations

import argparse
import logging

from libai_zoo import dist
from libai_zoo.config import LazyConfig
from libai_zoo.engine import DefaultTrainer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tools/train.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="a LazyConfig .py (or a saved config.yaml) with model, optim, dataloader, "
                                       "train and dist")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. train.max_iter=100 optim.lr=1e-3; a key that does not exist "
                             "is an error (prefix it with + to add it)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in train.output_dir (model, optimizer, "
                             "schedule, loss scale, RNG and data position); starts fresh if there is none")
    parser.add_argument("--eval-only", action="store_true",
                        help="evaluate on dataloader.test (after --resume or train.load_weight) and exit")
    parser.add_argument("--fast-dev-run", action="store_true",
                        help="smoke test: 2 training steps, logging every step, 2 evaluation batches, "
                             "no checkpoints")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    cfg = LazyConfig.apply_overrides(LazyConfig.load(args.config), args.overrides)
    trainer = DefaultTrainer(cfg, fast_dev_run=args.fast_dev_run)
    trainer.resume_or_load(resume=args.resume)
    try:
        if args.eval_only:
            results = trainer.test()
            logging.getLogger("libai_zoo").info("evaluation: %s", results)
            return results
        trainer.train()
    finally:
        dist.destroy()
    return None


if __name__ == "__main__":
    main()
