"""Pick a layout for a config at a world size, or dry-run one at any scale without GPUs.

    python tools/plan.py projects/gpt2_pretrain/config.py --world-size 4 --device cpu
    python tools/plan.py CONFIG.py --world-size 1024 --device h100 --json
    python tools/plan.py CONFIG.py --world-size 512 --dry-run dist.dp=8 dist.tp=8 dist.pp=8 train.zero_stage=3

The config's model, sequence length (dataloader.train's seq_len or max_length), global batch,
precision (train.amp) and optimizer are the input; overrides work as in tools/train.py. The
planner enumerates every layout the model admits (dp × cp × tp × pp, for a Mixture of Experts ep,
ZeRO 0-3, recomputation: none, full, selective (train.activation_checkpoint.modules: layernorm and
mlp_act) or Megatron's block method (num_layers: half of each stage), sequence parallelism,
micro-batch size, pipeline schedule),
drops those that do not fit in memory and ranks the rest by predicted step time: compute measured
on this machine's device (cached in ~/.cache/libai_zoo/planner.json) or, for another device, its
roofline; the collectives of an alpha-beta model (NVLink/InfiniBand presets, or a gloo sweep on a
CPU). An MoE model's routing is a stated assumption (--routing-imbalance; balanced by default).

--dry-run builds the config's own layout on the meta device under a fake process group of
--world-size ranks (no processes, no memory), through the trainer's own sharding, stage cutting
and FSDP wrapping, and prints each pipeline stage's bytes beside the planner's prediction.
"""

from __future__ import annotations

import argparse
import json
import sys

from libai_zoo.config import LazyConfig
from libai_zoo.plan import DEVICES, Layout, ModelTable, OptimizerState, dry_run, format_table, plan, state_bytes
from libai_zoo.plan.memory import GiB


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tools/plan.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="a LazyConfig .py (or a saved config.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as in tools/train.py")
    parser.add_argument("--world-size", type=int, required=True, help="number of processes (GPUs) of the run")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="processes per node: tp stays inside one (default 8; with --device cpu the whole "
                             "world runs on this machine)")
    parser.add_argument("--device", choices=sorted(DEVICES), default=None,
                        help="the device to plan for (default: this machine's); measured when it is this "
                             "machine's, else a roofline of its stated peak FLOP/s and bandwidth")
    parser.add_argument("--memory", type=float, default=None, metavar="GiB",
                        help="memory per rank (default: the device's; on CPU this machine's RAM / processes)")
    parser.add_argument("--overhead", type=float, default=None, metavar="GiB",
                        help="fixed bytes per rank outside the model's tensors (default 2 on a GPU, 0 on a CPU)")
    parser.add_argument("--routing-imbalance", type=float, default=1.0, metavar="F",
                        help="Mixture of Experts: the most loaded rank of an expert group receives F times its "
                             "share of the routed tokens (default 1.0: balanced routing), in its activations, "
                             "compute and all-to-all")
    parser.add_argument("--seq-len", type=int, default=None, metavar="N",
                        help="plan for sequences of N tokens (default: the config's training data's); long ones "
                             "bring context parallelism (cp) into the picks")
    parser.add_argument("--top", type=int, default=10, help="rows of the table (default 10)")
    parser.add_argument("--json", action="store_true", help='print {"candidates": [...]} best first')
    parser.add_argument("--dry-run", action="store_true",
                        help="build the config's layout (its dist and train keys) under a fake process group of "
                             "--world-size ranks and compare each stage's bytes with the planner's")
    return parser.parse_intermixed_args(argv)


def run_dry_run(cfg, world_size: int, as_json: bool) -> bool:
    """Print the dry run of the config's layout beside the prediction; True when they are equal."""
    layout = Layout.from_config(cfg, world_size)
    table = ModelTable.from_config(cfg.model, cfg.train.lora)
    optimizer = OptimizerState.probe(cfg.optim)
    rows = []
    for measured in dry_run(cfg, layout):
        predicted = state_bytes(table, layout, measured.pp_rank, measured.dp_rank, optimizer)
        rows.append({"rank": measured.rank, "pp_rank": measured.pp_rank, "dp_rank": measured.dp_rank,
                     "dry_run": {"params": measured.params, "grads": measured.grads, "optimizer": measured.optimizer},
                     "planner": {"params": predicted.params, "grads": predicted.grads,
                                 "optimizer": predicted.optimizer}})
    equal = all(row["dry_run"] == row["planner"] for row in rows)
    if as_json:
        print(json.dumps({"layout": layout.overrides(), "world_size": world_size, "ranks": rows, "equal": equal},
                         indent=1))
        return equal
    unit, name = (GiB, "GiB") if rows[0]["dry_run"]["params"] >= GiB / 8 else (2**20, "MiB")
    print(f"dry run of {layout.short()} on {world_size} ranks ({table.model_type}, "
          f"{table.total_parameters / 1e6:,.1f}M parameters): bytes each rank holds between steps")
    print(f"{'rank':>6} {'pp':>3} {'dp' if layout.cp == 1 else 'dpcp':>4}  {'params ' + name:>11} {'grads ' + name:>10} "
          f"{'optim ' + name:>10}  planner")
    for row in rows:
        got = row["dry_run"]
        same = "equal to the byte" if got == row["planner"] else f"DIFFERS: {row['planner']}"
        print(f"{row['rank']:>6} {row['pp_rank']:>3} {row['dp_rank']:>4}  {got['params'] / unit:11.3f} "
              f"{got['grads'] / unit:10.3f} {got['optimizer'] / unit:10.3f}  {same}")
    return equal


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done (a dry run equal to the prediction); 1 nothing fits, or a dry run that
    differs; 2 a layout or config that cannot run (the message on stderr, no traceback)."""
    args = parse_args(argv)
    try:
        return run(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    cfg = LazyConfig.apply_overrides(LazyConfig.load(args.config), args.overrides)
    if args.dry_run:
        return 0 if run_dry_run(cfg, args.world_size, args.json) else 1
    gpus_per_node = args.gpus_per_node or (args.world_size if args.device == "cpu" else 8)
    result = plan(cfg, args.world_size, gpus_per_node=gpus_per_node, device=args.device,
                  memory_bytes=int(args.memory * GiB) if args.memory is not None else None,
                  overhead_bytes=int(args.overhead * GiB) if args.overhead is not None else None,
                  routing_imbalance=args.routing_imbalance, seq_len=args.seq_len)
    if args.json:
        print(json.dumps({"considered": result.considered, "too_big": result.too_big,
                          "memory_limit_bytes": result.memory_limit, "timing": result.timing, "notes": result.notes,
                          "candidates": [c.as_json() for c in result.candidates[:args.top]]}, indent=1))
    else:
        print(format_table(result, args.top))
    return 0 if result.candidates else 1


if __name__ == "__main__":
    sys.exit(main())
