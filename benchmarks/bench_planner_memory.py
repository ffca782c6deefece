"""The planner's predicted peak memory of one process against what a training step really holds,
at several micro-batch sizes.

On a GPU the measured figure is `torch.cuda.max_memory_allocated` over a step (after a warm-up step
that allocates the optimizer state); on a CPU it is the parameters and optimizer state held before
the step plus the peak bytes the tensors made inside it held (`TensorMemoryPeak`, slow: small
models). The prediction is `libai_zoo.plan.rank_memory` without the fixed overhead.

    python benchmarks/bench_planner_memory.py                                   # CPU: a small Llama, fp32
    python benchmarks/bench_planner_memory.py --preset 1b --amp --micro-batches 1,2,4,8   # on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import tempfile

import torch
from bench_common import run_meta, write_json

from libai_zoo import distributed
from libai_zoo.config import LazyConfig, run_settings
from libai_zoo.engine import DefaultTrainer
from libai_zoo.plan import Layout, ModelTable, OptimizerState, rank_memory
from libai_zoo.utils import TensorMemoryPeak, optimizer_state_bytes, parameter_bytes

CONFIG = "projects/llama_finetune/config.py"
PRESETS = {  # Llama shapes: (hidden, ffn, layers, heads, kv heads, vocabulary, sequence)
    "small": (256, 688, 4, 8, 4, 8192, 256),
    "1b": (2048, 5632, 22, 32, 4, 32000, 2048),  # TinyLlama 1.1B
}


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


def measure(cfg) -> int:
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = DefaultTrainer(cfg)
    logging.getLogger("libai_zoo").setLevel(logging.WARNING)
    loader = iter(trainer.build_train_loader(cfg))
    trainer.step([next(loader)])  # the optimizer state exists from here on
    batch = [next(loader)]
    if trainer.ctx.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        trainer.step(batch)
        measured = torch.cuda.max_memory_allocated()
    else:
        before = sum(map(parameter_bytes, trainer.model_parts)) + optimizer_state_bytes(trainer.optimizer)
        with TensorMemoryPeak() as peak:
            trainer.step(batch)
        measured = before + peak.bytes
    distributed.destroy()
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--micro-batches", default="1,2,4")
    parser.add_argument("--amp", action="store_true", help="bf16 autocast")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for micro_batch in [int(m) for m in args.micro_batches.split(",")]:
        with tempfile.TemporaryDirectory() as output_dir:
            cfg = config(args.preset, micro_batch, args.amp, output_dir)
            table, run = ModelTable.from_config(cfg.model), run_settings(cfg)
            predicted = rank_memory(table, Layout(1, 1, 1, micro_batch_size=micro_batch),
                                    seq_len=run.seq_len, global_batch_size=micro_batch,
                                    amp_dtype=run.amp_dtype, optimizer=OptimizerState.probe(cfg.optim),
                                    device=device)
            measured = measure(cfg)
        error = predicted.total / measured - 1
        rows.append({"micro_batch": micro_batch, "predicted": predicted.as_dict(), "measured": measured,
                     "error": error})
        terms = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in predicted.as_dict().items() if k != "total")
        print(f"micro-batch {micro_batch}: predicted {predicted.total / 2**20:9.1f} MiB  measured "
              f"{measured / 2**20:9.1f} MiB  error {100 * error:+.1f}%  ({terms} MiB)", flush=True)
    if args.out:
        write_json(args.out, run_meta(device, preset=args.preset, amp=args.amp), {"rows": rows})


if __name__ == "__main__":
    main()
