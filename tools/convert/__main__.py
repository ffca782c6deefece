"""Convert checkpoints between Hugging Face, libai_zoo's sharded checkpoints and Megatron-LM.

    python tools/convert hf-to-zoo HF_DIR OUT_DIR [--dp N --tp N --pp N]
    python tools/convert zoo-to-hf CHECKPOINT_DIR OUT_DIR [--max-shard-size 5GB] [--adapter]
    python tools/convert megatron-to-hf MEGATRON_DIR OUT_DIR [--vocab-size N]
    python tools/convert megatron-to-zoo MEGATRON_DIR OUT_DIR [--dp N --tp N --pp N]
    python tools/convert hf-to-megatron HF_DIR OUT_DIR [--make-vocab-size-divisible-by 128]
    python tools/convert zoo-to-megatron CHECKPOINT_DIR OUT_DIR
    python tools/convert inspect PATH

Megatron-LM: Megatron-Core GPT, Llama, Qwen2/3 and Mistral models in the torch_dist format (read and written) or
per-rank torch files (read), and legacy GPT checkpoints (language_model names, read).

libai_zoo checkpoints (torch.distributed.checkpoint) keep every tensor's global shape, so a
checkpoint written at one layout loads at any other: conversions run in one process, and a run
started from a converted checkpoint reads only its own shards (train.load_weight=OUT_DIR/model_0000000).
Untrusted files are read through safetensors or torch.load(weights_only=True).
"""

from __future__ import annotations

import argparse
import re
import sys

# Heavy imports (torch, transformers) wait until a command runs, so --help answers at once.

PROG = "python tools/convert"


def _size(text: str) -> int | str:
    """--max-shard-size: bytes, or a number with KB/MB/GB/TB (decimal units, as save_pretrained takes them)."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]B)", text, flags=re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use bytes or a number with KB, MB, GB or TB "
                                         f"(e.g. 500MB, 5GB)")
    return match[1] + match[2].upper()


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


DTYPES = ("float32", "float16", "bfloat16")


def _output(parser: argparse.ArgumentParser, *, max_shard_size: bool) -> None:
    """OUT_DIR, --max-shard-size (commands that write safetensors) and --overwrite."""
    parser.add_argument("out_dir", metavar="OUT_DIR", help="new (or empty) output directory")
    if max_shard_size:
        parser.add_argument("--max-shard-size", type=_size, default="5GB", metavar="SIZE",
                            help="split the safetensors above this size, with an index (default 5GB)")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty OUT_DIR")


def _layout(parser: argparse.ArgumentParser) -> None:
    """--dp, --tp, --pp: the layout a written libai_zoo checkpoint is checked against."""
    for name, what in (("dp", "data"), ("tp", "tensor"), ("pp", "pipeline")):
        parser.add_argument(f"--{name}", type=_positive, default=1, metavar="N",
                            help=f"{what}-parallel size of the target run (default 1)")


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=raw)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser(
        "hf-to-zoo", formatter_class=raw, help="Hugging Face directory -> libai_zoo checkpoint for a dp/tp/pp layout",
        description="Write a Hugging Face model as a libai_zoo checkpoint (one process; the checkpoint is sharded\n"
                    "on load by whatever layout reads it). The layout is checked against the model up front\n"
                    "(what its layers need divisible by tp: heads, KV heads, MLP size, vocabulary; layers >= pp)\n"
                    "and recorded in OUT_DIR/config.yaml.\n\n"
                    "    OUT_DIR/model_0000000/   the checkpoint (a run starts from it with\n"
                    "                             train.load_weight=OUT_DIR/model_0000000), and its config.yaml\n"
                    "    OUT_DIR/last_checkpoint  names it\n"
                    "    OUT_DIR/config.yaml      the model (libai_zoo class + config) and the target layout\n"
                    "    OUT_DIR/hf_config.json   the source's config.json")
    p.add_argument("hf_dir", metavar="HF_DIR", help="Hugging Face model directory (config.json + safetensors)")
    _output(p, max_shard_size=False)
    _layout(p)
    p.add_argument("--model-class", help="libai_zoo class to load (default: from config.json's model_type and "
                                         "architectures), e.g. BertForSequenceClassification")
    p.add_argument("--dtype", choices=DTYPES, help="store the weights in this dtype (default: as in HF_DIR)")

    p = commands.add_parser(
        "zoo-to-hf", formatter_class=raw,
        help="libai_zoo checkpoint (any layout, ZeRO or not) -> Hugging Face directory",
        description="Write a libai_zoo checkpoint as a Hugging Face directory that transformers loads. The model is\n"
                    "rebuilt from the config.yaml the checkpoint keeps and read whole in one process,\n"
                    "whatever dp/tp/pp/ZeRO layout wrote it. A LoRA run's adapters are merged into the weights,\n"
                    "or with --adapter written alone as a PEFT adapter directory (adapter_config.json +\n"
                    "adapter_model.safetensors) that peft.PeftModel.from_pretrained(base_model, OUT_DIR) loads.")
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR",
                   help="a model_XXXXXXX directory, or a run's output_dir (its last_checkpoint is used)")
    p.add_argument("--adapter", action="store_true", help="write only the LoRA adapters, as PEFT names them")
    _output(p, max_shard_size=True)

    megatron_reads = (
        "Reads Megatron-LM checkpoints (the root with latest_checkpointed_iteration.txt, or one iteration\n"
        "directory) at any tp/pp:\n"
        "  - Megatron-Core GPTModel, torch_dist format (iter_XXXXXXX/.metadata, common.pt) or per-rank torch\n"
        "    files (mp_rank_TT[_PPP]/model_optim_rng.pt with decoder.layers... names):\n"
        "      GPT family   LayerNorm, GELU, biases, tied or untied head: learned positions -> GPT-2,\n"
        "                   RoPE (any rotary percent, linear scaling) -> GPT-NeoX (sequential residual)\n"
        "      Llama family RoPE (base, llama3 or linear scaling), RMSNorm, SwiGLU, grouped-query\n"
        "                   attention, untied or tied head, biases: none, all, or q/k/v (Qwen2) -> Llama;\n"
        "                   --qk-layernorm -> Qwen3; --window-size -> Mistral, or skipped on some layers\n"
        "                   (--window-attn-skip-freq) Qwen2/Qwen3\n"
        "  - legacy GPT (language_model.encoder names, torch files) -> GPT-2 (megatron-to-hf only)\n"
        "The architecture comes from the args saved with the checkpoint and is checked against the\n"
        "tensors; every mismatch is named in one error. Tensors are read through\n"
        "torch.distributed.checkpoint and torch.load(weights_only=True); no pickle runs code.")

    def megatron_source(p: argparse.ArgumentParser) -> None:
        p.add_argument("megatron_dir", metavar="MEGATRON_DIR",
                       help="checkpoint root (with latest_checkpointed_iteration.txt) or one iteration directory")

    def megatron_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--vocab-size", type=_positive, metavar="N",
                       help="keep only this many vocabulary rows (the tokenizer's size; Megatron pads the vocabulary "
                            "to a multiple of 128 x tp); default: args.vocab_size if saved, else all padded rows")
        p.add_argument("--dtype", choices=DTYPES, help="write the weights in this dtype (default: as saved)")
        p.add_argument("--allow-numpy", action="store_true",
                       help="also unpickle numpy arrays (Megatron's saved RNG state) as data; nothing else is allowed")

    p = commands.add_parser(
        "megatron-to-hf", formatter_class=raw,
        help="Megatron-LM checkpoint (any tp/pp) -> Hugging Face GPT-2 / GPT-NeoX / Llama",
        description="Write a Megatron-LM checkpoint as a Hugging Face directory (through libai_zoo's model, whose\n"
                    "save_pretrained writes it; transformers loads it).\n\n" + megatron_reads)
    megatron_source(p)
    _output(p, max_shard_size=True)
    megatron_options(p)
    p.add_argument("--num-attention-heads", type=_positive, metavar="N",
                   help="only for legacy checkpoints saved without args")

    p = commands.add_parser(
        "megatron-to-zoo", formatter_class=raw,
        help="Megatron-Core checkpoint (any tp/pp) -> libai_zoo checkpoint for a dp/tp/pp layout",
        description="Write a Megatron-Core checkpoint as a libai_zoo checkpoint (OUT_DIR/model_0000000, as hf-to-zoo\n"
                    "writes one): a run starts from it with train.load_weight=OUT_DIR/model_0000000, each rank\n"
                    "reading only its shards.\n\n" + megatron_reads)
    megatron_source(p)
    _output(p, max_shard_size=False)
    _layout(p)
    megatron_options(p)

    hf_families = "Hugging Face GPT-2, GPT-NeoX, Llama, Qwen2, Qwen3 or Mistral directory"
    for name, source, what in (("hf-to-megatron", "hf_dir", hf_families),
                               ("zoo-to-megatron", "checkpoint", "libai_zoo checkpoint (any layout)")):
        p = commands.add_parser(
            name, formatter_class=raw, help=f"{what} -> Megatron-Core torch_dist checkpoint",
            description=f"Write a {what} as a Megatron-Core checkpoint, torch_dist format:\n\n"
                        "  OUT_DIR/latest_checkpointed_iteration.txt  \"release\"\n"
                        "  OUT_DIR/release/.metadata, __0_0.distcp     the weights (Megatron-Core names)\n"
                        "  OUT_DIR/release/common.pt                   args (the architecture) and the source's\n"
                        "                                              config.json (megatron-to-hf gives it back)\n"
                        "  OUT_DIR/release/metadata.json               the format, as Megatron-Core writes it\n\n"
                        "Megatron-LM loads it with --load OUT_DIR (weights only: a release checkpoint has no\n"
                        "optimizer or RNG state) and the architecture flags of its args (inspect OUT_DIR), at any\n"
                        "tp/pp. The vocabulary is padded to a multiple of --make-vocab-size-divisible-by\n"
                        "(Megatron-LM pads to make_vocab_size_divisible_by x tp: pass that product) by repeating\n"
                        "the last row, as Megatron-LM's own converter does. LoRA adapters are merged. A model\n"
                        "Megatron-Core cannot express (parallel residual, scaled embeddings or logits, soft-caps,\n"
                        "(1 + w) or post norms, NoPE layers, ...) is refused with everything missing named.")
        p.add_argument(source, metavar="HF_DIR" if source == "hf_dir" else "CHECKPOINT_DIR",
                       help="Hugging Face model directory" if source == "hf_dir"
                       else "a model_XXXXXXX directory, or a run's output_dir (its last_checkpoint is used)")
        _output(p, max_shard_size=False)
        p.add_argument("--make-vocab-size-divisible-by", type=_positive, default=128, metavar="N",
                       help="pad the vocabulary to a multiple of N (default 128; use 128 x the Megatron run's tp)")
        p.add_argument("--dtype", choices=DTYPES, help="write the weights in this dtype (default: as stored)")

    p = commands.add_parser(
        "inspect", formatter_class=raw, help="print a checkpoint's tensors, shapes, dtypes and layout",
        description="Print what a checkpoint holds: a Hugging Face directory (tensors, shapes, dtypes), a libai_zoo\n"
                    "checkpoint or run output_dir (global shapes and the chunks each tensor was saved in, which\n"
                    "show the layout; trainer state; last_checkpoint), or a Megatron-LM checkpoint (iteration,\n"
                    "tp/pp, args, tensors of every shard).")
    p.add_argument("path", metavar="PATH", help="the checkpoint directory")
    p.add_argument("--allow-numpy", action="store_true", help="Megatron files: also unpickle numpy arrays as data")
    return parser


def run(args: argparse.Namespace) -> str:
    """Carry out one parsed command; return what to print."""
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    if args.command == "inspect":
        from libai_zoo.convert import describe

        return describe(args.path, allow_numpy=args.allow_numpy)
    if args.command == "hf-to-zoo":
        from libai_zoo.convert import hf_to_zoo

        checkpoint = hf_to_zoo(args.hf_dir, args.out_dir, dp=args.dp, tp=args.tp, pp=args.pp,
                               model_class=args.model_class, dtype=args.dtype, overwrite=args.overwrite)
        world = args.dp * args.tp * args.pp
        return (f"wrote libai_zoo checkpoint {checkpoint} for dp={args.dp} tp={args.tp} pp={args.pp} "
                f"({world} process{'es' if world > 1 else ''})\n"
                f"start a run from it with train.load_weight={checkpoint}")
    if args.command == "zoo-to-hf":
        from libai_zoo.convert import zoo_to_hf

        checkpoint, model = zoo_to_hf(args.checkpoint, args.out_dir, max_shard_size=args.max_shard_size,
                                      overwrite=args.overwrite, adapter=args.adapter)
        what = "PEFT LoRA adapter of" if args.adapter else "Hugging Face"
        return f"wrote {what} {type(model).__name__} to {args.out_dir} from {checkpoint}"
    if args.command in ("hf-to-megatron", "zoo-to-megatron"):
        from libai_zoo.convert import hf_to_megatron, zoo_to_megatron

        convert = hf_to_megatron if args.command == "hf-to-megatron" else zoo_to_megatron
        directory, model = convert(args.hf_dir if args.command == "hf-to-megatron" else args.checkpoint,
                                   args.out_dir, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                                   dtype=args.dtype, overwrite=args.overwrite)
        return (f"wrote Megatron-Core torch_dist checkpoint {directory} ({type(model).__name__}, "
                f"{model.config.num_hidden_layers} layers)\nload it in Megatron-LM with --load {args.out_dir} and the "
                f"architecture flags of its args (python tools/convert inspect {args.out_dir})")
    if args.command == "megatron-to-zoo":
        from libai_zoo.convert import megatron_to_zoo

        source, checkpoint = megatron_to_zoo(args.megatron_dir, args.out_dir, dp=args.dp, tp=args.tp, pp=args.pp,
                                             vocab_size=args.vocab_size, dtype=args.dtype,
                                             allow_numpy=args.allow_numpy, overwrite=args.overwrite)
        return (f"wrote libai_zoo checkpoint {checkpoint} from {source.directory} ({source.format} format, "
                f"tp={source.tp}, pp={source.pp}) for dp={args.dp} tp={args.tp} pp={args.pp}\n"
                f"start a run from it with train.load_weight={checkpoint}")
    from libai_zoo.convert import megatron_to_hf
    from libai_zoo.convert.hf_zoo import check_output_dir

    check_output_dir(args.out_dir, args.overwrite)
    source, config = megatron_to_hf(args.megatron_dir, args.out_dir, vocab_size=args.vocab_size,
                                    num_attention_heads=args.num_attention_heads, dtype=args.dtype,
                                    max_shard_size=args.max_shard_size, allow_numpy=args.allow_numpy)
    return (f"wrote Hugging Face {config.model_type} ({config.num_hidden_layers} layers, hidden {config.hidden_size}, "
            f"vocabulary {config.vocab_size}) to {args.out_dir} from {source.directory} (tp={source.tp}, "
            f"pp={source.pp})")


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (1 with a one-line error for a bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        print(run(args))
    except (OSError, ValueError) as error:
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
