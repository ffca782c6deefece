"""The planner's predicted peak memory of one process against what a training step really holds:
each activation-checkpointing choice the planner knows at one process, the loss whole or in chunks,
at several micro-batch sizes; prints predicted, measured and their ratio.

The layouts are the planner's own: every layout `enumerate_layouts` gives at world size 1 for a
micro-batch size (no recomputation, full, and whatever choice `train.activation_checkpoint` grows,
as the planner enumerates it), each run through the overrides `Layout.overrides` writes, so a new
recomputation choice is measured here with no change to this script (the run's meta lists the
schema's `ActivationCheckpointConfig` fields it ran with). The loss runs in chunks when its float32
logits pass `LMHead.chunk_bytes` (the layer and the planner read the same attribute): each
`--loss-chunks` value sets it (MiB; 0: the loss whole).

On a GPU the measured figure is `torch.cuda.max_memory_allocated` over a step (after a warm-up step
that allocates the optimizer state); on a CPU it is the parameters and optimizer state held before
the step plus the peak bytes the tensors made inside it held (`TensorMemoryPeak`, slow: small
models). The prediction is `libai_zoo.plan.rank_memory` for that device, without the fixed overhead.

    python benchmarks/bench_planner_memory.py                                   # CPU: a small Llama, fp32
    python benchmarks/bench_planner_memory.py --preset 1b --amp --micro-batches 1,4 --loss-chunks 0,256  # GPU
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import io
import logging
import sys
import tempfile

import torch

from bench_common import run_meta, write_json
from libai_zoo import distributed
from libai_zoo.config import LazyConfig, run_settings
from libai_zoo.config.schema import ActivationCheckpointConfig
from libai_zoo.engine import DefaultTrainer
from libai_zoo.layers import LMHead
from libai_zoo.plan import Layout, ModelTable, OptimizerState, enumerate_layouts, rank_memory
from libai_zoo.utils import TensorMemoryPeak, optimizer_state_bytes, parameter_bytes

CONFIG = "projects/llama_finetune/config.py"
PRESETS = {  # Llama shapes: (hidden, ffn, layers, heads, kv heads, vocabulary, sequence)
    "tiny": (64, 176, 2, 4, 2, 8192, 128),  # a quick check of this script (benchmarks/gpu_suite.sh --cpu)
    "small": (256, 688, 4, 8, 4, 8192, 256),
    "1b": (2048, 5632, 22, 32, 4, 32000, 2048),  # TinyLlama 1.1B
}
WHOLE_LOSS = sys.maxsize  # LMHead.chunk_bytes that never chunks


def config(preset: str, micro_batch: int, amp: bool, output_dir: str):
    hidden, ffn, layers, heads, kv, vocab, seq = PRESETS[preset]
    cfg = LazyConfig.load(CONFIG)
    cfg.model = LazyConfig.load("projects/layout_planning/llama_70b.py").model
    return LazyConfig.apply_overrides(cfg, [
        f"model.config.hidden_size={hidden}", f"model.config.intermediate_size={ffn}",
        f"model.config.num_hidden_layers={layers}", f"model.config.num_attention_heads={heads}",
        f"model.config.num_key_value_heads={kv}", f"model.config.vocab_size={vocab}",
        f"model.config.max_position_embeddings={seq}", f"dataloader.train.seq_len={seq}", "dataloader.test=null",
        f"train.micro_batch_size={micro_batch}", f"train.global_batch_size={micro_batch}",
        f"train.amp.enabled={str(amp).lower()}", "train.amp.dtype=bf16", f"train.output_dir={output_dir}",
        "train.checkpoint.period=0", "train.eval.period=0", "hooks=[]"])


def one_process_layouts(cfg) -> list[Layout]:
    """The planner's layouts of one process at the config's micro-batch size: its recomputation choices."""
    run = run_settings(cfg)
    table = ModelTable.from_config(cfg.model)
    found = enumerate_layouts(table, 1, run.train.micro_batch_size, seq_len=run.seq_len)
    return list(dict.fromkeys(layout for layout in found if layout.micro_batch_size == run.train.micro_batch_size))


def measure(cfg) -> int:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = DefaultTrainer(cfg)
    logging.getLogger("libai_zoo").setLevel(logging.WARNING)
    loader = iter(trainer.build_train_loader(cfg))
    trainer.train_step([next(loader)])  # the optimizer state exists from here on
    batch = [next(loader)]
    if trainer.ctx.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        trainer.train_step(batch)
        measured = torch.cuda.max_memory_allocated()
    else:
        before = sum(map(parameter_bytes, trainer.model_parts)) + optimizer_state_bytes(trainer.optimizer)
        with TensorMemoryPeak() as peak:
            trainer.train_step(batch)
        measured = before + peak.bytes
    distributed.destroy()
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--micro-batches", default="1,2,4")
    parser.add_argument("--loss-chunks", default="0",
                        help="LMHead.chunk_bytes of each run in MiB, comma-separated (0: the loss whole)")
    parser.add_argument("--amp", action="store_true", help="bf16 autocast")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    recompute_keys = [f.name for f in dataclasses.fields(ActivationCheckpointConfig)]
    print(f"{device}; train.activation_checkpoint keys: {', '.join(recompute_keys)}", flush=True)
    rows = []
    for micro_batch in [int(m) for m in args.micro_batches.split(",")]:
        with tempfile.TemporaryDirectory() as output_dir:
            layouts = one_process_layouts(config(args.preset, micro_batch, args.amp, output_dir))
        for layout in layouts:
            for chunk_mib in [int(c) for c in args.loss_chunks.split(",")]:
                LMHead.chunk_bytes = chunk_mib * 2**20 if chunk_mib else WHOLE_LOSS
                with tempfile.TemporaryDirectory() as output_dir:
                    cfg = LazyConfig.apply_overrides(config(args.preset, micro_batch, args.amp, output_dir),
                                                     layout.overrides().split())
                    run = run_settings(cfg)
                    ran = Layout.from_config(cfg, 1)  # what the trainer runs: the overrides' round trip
                    predicted = rank_memory(ModelTable.from_config(cfg.model), ran, seq_len=run.seq_len,
                                            global_batch_size=micro_batch, amp_dtype=run.amp_dtype,
                                            optimizer=OptimizerState.probe(cfg.optim), device=device)
                    measured = measure(cfg)
                ratio = predicted.total / measured
                loss = f"loss in {chunk_mib} MiB chunks" if chunk_mib else "loss whole"
                recompute = " ".join(o.removeprefix("train.activation_checkpoint.")
                                     for o in layout.overrides().split() if o.startswith("train.activation_checkpoint"))
                rows.append({"micro_batch": micro_batch, "layout": ran.short(), "overrides": layout.overrides(),
                             "loss_chunk_mib": chunk_mib, "predicted": predicted.as_dict(), "measured": measured,
                             "ratio": ratio})
                terms = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in predicted.as_dict().items() if k != "total")
                print(f"mb{micro_batch} {recompute:<16} {loss:<22} predicted {predicted.total / 2**20:9.1f} MiB  "
                      f"measured {measured / 2**20:9.1f} MiB  predicted / measured {ratio:.3f}  ({terms} MiB)",
                      flush=True)
    if args.out:
        meta = run_meta(device, preset=args.preset, amp=args.amp, activation_checkpoint_keys=recompute_keys)
        write_json(args.out, meta, {"rows": rows})


if __name__ == "__main__":
    main()
