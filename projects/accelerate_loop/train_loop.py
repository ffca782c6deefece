"""A zoo causal LM (GPT-2, Llama/Qwen2, GPT-NeoX, ...) trained by your own loop under Hugging Face accelerate.

    python tools/make_tiny_hf_model.py llama output/tiny_llama      # or any causal LM directory the zoo loads
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 projects/accelerate_loop/train_loop.py \
        --model output/tiny_llama                        # gloo; on GPUs: without ACCELERATE_USE_CPU=1 (NCCL)
    python projects/accelerate_loop/train_loop.py --model output/tiny_llama         # one process

The data are the shipped corpus cut into --seq-len token windows. Each step takes
--micro-batch-size samples per process and --grad-accum micro-batches, so the global batch is
micro-batch × processes × grad-accum: the steps of tools/train.py with dist.dp=N
train.micro_batch_size=MB train.global_batch_size=MB×N×ACCUM, the same sample order, and, from
the same directory with dropout off, the same losses (tests/test_accelerate.py). The defaults
are projects/llama_finetune's recipe.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

from libai_zoo.data import MicroBatchSampler, build_gpt_dataset
from libai_zoo.models import AutoModelForCausalLM
from libai_zoo.optim import WarmupCosineLR, param_groups


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Hugging Face directory of a causal LM the zoo has "
                                                       "(GPT-2, Llama, Qwen2, GPT-NeoX, ...)")
    parser.add_argument("--text", default="data/corpus/python_docs.txt", help="training text (blank-line documents)")
    parser.add_argument("--tokenizer", default="data/tokenizer", help="the model's tokenizer directory")
    parser.add_argument("--cache-dir", default="output/cache", help="where the tokenized text is cached")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=8, help="samples per process and micro-batch")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=30, help="warmup steps before the cosine decay")
    parser.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine ends at lr × this")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--clip-grad-norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=42, help="seeds the RNGs and the sample order")
    parser.add_argument("--save", default=None, help="write the trained model here (a Hugging Face directory)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum)
    if accelerator.num_processes != int(os.environ.get("WORLD_SIZE", "1")):  # every process finds it: one says it
        if os.environ.get("RANK", "0") == "0":
            print("accelerate runs each launched process alone on a machine without GPUs unless told to use the CPU: "
                  "launch with ACCELERATE_USE_CPU=1", file=sys.stderr)
        raise SystemExit(1)
    set_seed(args.seed)

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="float32")
    model.train()  # from_pretrained returns it in eval mode, as transformers does
    dataset = build_gpt_dataset(args.text, args.tokenizer, args.seq_len, cache_dir=args.cache_dir)
    # The global order of micro-batches (one shuffled permutation per epoch); the prepared loader
    # gives process r the micro-batches r, r + N, r + 2N, ...: tools/train.py's order at dp=N.
    global_batch = args.micro_batch_size * accelerator.num_processes * args.grad_accum
    sampler = MicroBatchSampler(len(dataset), args.micro_batch_size, seed=args.seed, global_batch_size=global_batch)
    loader = DataLoader(dataset, batch_sampler=sampler)
    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    # Not passed to prepare(): accelerate would step it once per process at every step.
    scheduler = WarmupCosineLR(optimizer, max_iter=args.steps, warmup_iters=args.warmup,
                               min_lr_ratio=args.min_lr_ratio)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    batches = iter(loader)
    for step in range(1, args.steps + 1):
        loss_sum = torch.zeros((), device=accelerator.device)
        for _ in range(args.grad_accum):
            with accelerator.accumulate(model):  # syncs gradients on the step's last micro-batch
                loss = model(**next(batches), return_logits=False).loss  # labels shift inside
                accelerator.backward(loss)  # divided by grad_accum; DDP averages over processes
                loss_sum += loss.detach() / args.grad_accum
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
                optimizer.step()  # only once gradients are synced
                optimizer.zero_grad()
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        loss = accelerator.reduce(loss_sum, "mean").item()
        accelerator.print(f"step {step}/{args.steps}  loss {loss:.6f}  grad_norm {grad_norm.item():.4f}  lr {lr:.3e}")

    if args.save and accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(args.save)
    accelerator.wait_for_everyone()
    # Free the DDP model before its process group: a gloo group whose last owner is DDP's reducer is
    # destroyed holding the GIL, which can deadlock at exit (pytorch/pytorch#56297).
    del model
    accelerator.free_memory()
    accelerator.end_training()


if __name__ == "__main__":
    main()
