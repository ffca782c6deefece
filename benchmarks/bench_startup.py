"""Start-up peak memory per rank against its shard, and start-up time, for a 1B-class Llama.

Each layout runs `DefaultTrainer(cfg)` (build on meta, split, cut, shard, then allocate and draw
only this rank's part) on 4 freshly spawned gloo processes on the CPU. Per rank it reports the
peak resident memory the constructor added (VmHWM, reset before it, minus VmRSS before it), the
bytes of the parameters the rank holds (its shard), the largest single parameter, and the
constructor's time. The limit of issue 11: peak <= 1.15 × shard + largest tensor + a fixed overhead.

    python benchmarks/bench_startup.py                                   # tp4, pp2×tp2, dp4 ZeRO-3
    python benchmarks/bench_startup.py --layers 4 --layouts tp4          # smaller and quicker
    python benchmarks/bench_startup.py --out benchmarks/results/bench_startup_2026-11-23_cpu2.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

LAYOUTS = {
    "tp4": ["dist.tp=4", "train.micro_batch_size=4"],
    "pp2_tp2": ["dist.pp=2", "dist.tp=2", "train.micro_batch_size=2"],
    "dp4_zero3": ["dist.dp=4", "train.zero_stage=3", "train.micro_batch_size=1"],
}

CONFIG = Path(__file__).resolve().parent / "configs/startup_llama.py"


def _memory_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _rank(rank: int, world: int, config_file: str, overrides: list[str], out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
                                         world_size=world)
    from libai_zoo import distributed
    from libai_zoo.config import LazyConfig
    from libai_zoo.engine import DefaultTrainer
    from libai_zoo.utils import parameter_bytes

    cfg = LazyConfig.apply_overrides(LazyConfig.load(config_file), [
        f"train.output_dir={out_dir}/run", "train.global_batch_size=16", *overrides])
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _memory_kib("VmRSS")
    start = time.perf_counter()
    trainer = DefaultTrainer(cfg)
    seconds = time.perf_counter() - start
    peak = _memory_kib("VmHWM") - before
    params = [p for part in trainer.model_parts for p in part.parameters()]
    result = {"rank": rank, "peak_mib": peak / 1024, "seconds": seconds,
              "shard_mib": sum(map(parameter_bytes, trainer.model_parts)) / 2**20,
              "largest_mib": max(p.numel() * p.element_size() for p in params) / 2**20}
    distributed.destroy()
    torch.distributed.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def run_layout(config_file: str, overrides: list[str], world: int = 4) -> list[dict]:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank, args=(world, config_file, overrides, out_dir), nprocs=world, start_method="spawn")
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {list(LAYOUTS)}")
    parser.add_argument("--overhead-mib", type=float, default=64.0,
                        help="the fixed overhead the limit allows (allocator, gloo buffers)")
    parser.add_argument("--out", help="also write the figures to this JSON file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        from libai_zoo.config import LazyConfig, instantiate

        config_file = Path(tmp, "config.yaml")
        cfg = LazyConfig.apply_overrides(LazyConfig.load(str(CONFIG)), [
            f"model.config.vocab_size={args.vocab}", f"model.config.hidden_size={args.hidden}",
            f"model.config.intermediate_size={args.ffn}", f"model.config.num_hidden_layers={args.layers}",
            f"model.config.num_attention_heads={args.heads}", f"model.config.num_key_value_heads={args.kv_heads}",
            f"dataloader.train.cache_dir={tmp}/cache"])
        instantiate(cfg.dataloader.train)  # the token cache, filled once here: the ranks read it
        LazyConfig.save(cfg, config_file)
        from libai_zoo.models import LlamaConfig, LlamaForCausalLM

        with torch.device("meta"):
            whole = LlamaForCausalLM(LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                                 intermediate_size=args.ffn, num_hidden_layers=args.layers,
                                                 num_attention_heads=args.heads, num_key_value_heads=args.kv_heads))
        total = sum(p.numel() for p in whole.parameters())
        print(f"Llama {total / 1e9:.2f}B parameters ({total * 4 / 2**20:.0f} MiB fp32), 4 ranks, CPU gloo")
        print(f"{'layout':<10} {'rank':>4} {'peak MiB':>9} {'shard MiB':>9} {'largest':>8} {'peak/shard':>10} "
              f"{'(peak-largest)/shard':>20} {'start s':>8} {'within limit':>12}")
        results = {}
        for name in args.layouts.split(","):
            ranks = run_layout(str(config_file), LAYOUTS[name])
            for r in ranks:
                peak, shard, largest = r["peak_mib"], r["shard_mib"], r["largest_mib"]
                r["within_limit"] = peak <= 1.15 * shard + largest + args.overhead_mib
                print(f"{name:<10} {r['rank']:>4} {peak:>9.0f} {shard:>9.0f} {largest:>8.0f} {peak / shard:>10.2f} "
                      f"{(peak - largest) / shard:>20.2f} {r['seconds']:>8.1f} {str(r['within_limit']):>12}")
            results[name] = ranks
    if args.out:
        Path(args.out).write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "device": f"cpu ({os.cpu_count()} cores)",
            "torch": torch.__version__, "python": platform.python_version(), "parameters": total,
            "model": vars(args), "layouts": results}, indent=1))


if __name__ == "__main__":
    main()
