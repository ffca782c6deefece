"""Tokenize text, JSON lines or parquet files into Megatron-LM's indexed format (.bin + .idx), which
libai_zoo's indexed datasets (libai_zoo.data.build_indexed_gpt_dataset / build_indexed_mlm_dataset)
and Megatron-LM read.

    python tools/preprocess_data.py --input data/corpus/python_docs.txt --tokenizer data/tokenizer \\
        --output-prefix output/python_docs --workers 2
    # -> output/python_docs_text_document.bin and .idx
    python tools/preprocess_data.py --input shard-*.jsonl --json-key content --tokenizer TOKENIZER_DIR \\
        --output-prefix out/code --workers 8
    # -> out/code_content_document.bin and .idx

Each document is tokenized without special tokens and, by default, followed by the tokenizer's eos
token (Megatron's --append-eod), and written as one sequence. The files are read with
`datasets.load_dataset(..., streaming=True)`, in the order given; documents are tokenized in chunks
by a pool of worker processes and written in input order, so the output is the same byte for byte
whatever the number of workers. Documents that tokenize to nothing are skipped.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from libai_zoo.data.indexed_dataset import DTYPE_CODES, IndexedDatasetWriter, best_fitting_dtype, data_path, index_path

FORMATS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".ndjson": "json",
           ".parquet": "parquet"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4")
BLANK_LINES = re.compile(r"\n\s*\n")
READ_BATCH = 1000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    dtypes = ["auto"] + [np.dtype(d).name for d in DTYPE_CODES.values() if np.issubdtype(d, np.integer)]
    parser = argparse.ArgumentParser(prog="tools/preprocess_data.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help="input file(s), read in the order given into one output. By extension (after an "
                             "optional .gz/.bz2/.xz/.zst): .txt = one document per blank-line-separated block "
                             "(or per line with --split-lines); .jsonl/.json/.ndjson = JSON lines (or a JSON "
                             "array), the document in the field --json-key; .parquet = the column --json-key")
    parser.add_argument("--input-format", choices=["auto", "text", "json", "parquet"], default="auto",
                        help="read every input as this format instead of guessing it from the extension "
                             "(default: auto)")
    parser.add_argument("--split-lines", action="store_true",
                        help="text input: every non-empty line is a document (default: blank-line-separated "
                             "blocks, stripped)")
    parser.add_argument("--json-key", default="text", metavar="KEY",
                        help="the JSON field / parquet column holding the document text; it also names the output "
                             "(PREFIX_KEY_document). Default: text")
    parser.add_argument("--tokenizer", required=True, metavar="DIR",
                        help="a Hugging Face tokenizer directory (tokenizer.json or the slow tokenizer's files, "
                             "loaded with AutoTokenizer), e.g. data/tokenizer")
    parser.add_argument("--output-prefix", required=True, metavar="PREFIX",
                        help="where to write: PREFIX_KEY_document.bin and .idx (KEY = --json-key; 'text' for "
                             "text input), as Megatron-LM names them; pass PREFIX_KEY_document to the datasets")
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="tokenizing processes (default 1: in this process); the output does not depend on it")
    parser.add_argument("--chunk-size", type=int, default=256, metavar="DOCS",
                        help="documents a worker tokenizes per task (default 256)")
    parser.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                        help="end every document with the tokenizer's eos token, the separator GPT training "
                             "sees between documents (default: on; --no-append-eod for none)")
    parser.add_argument("--dtype", choices=dtypes, default="auto",
                        help="token dtype in the .bin; auto = uint16 when the vocabulary has fewer than 65500 ids, "
                             "else int32 (Megatron's rule)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.chunk_size < 1:
        parser.error(f"--workers ({args.workers}) and --chunk-size ({args.chunk_size}) must be >= 1")
    return args


def input_format(path: str, forced: str) -> str:
    """text, json or parquet for `path`: `forced` unless it is auto, else from the extension."""
    if forced != "auto":
        return forced
    name = path.lower()
    for compression in COMPRESSIONS:
        if name.endswith(compression):
            name = name[: -len(compression)]
    suffix = os.path.splitext(name)[1]
    if suffix not in FORMATS:
        raise SystemExit(f"error: cannot tell the format of {path} from its extension {suffix!r}; name it "
                         f"{'/'.join(FORMATS)} or pass --input-format text|json|parquet")
    return FORMATS[suffix]


def read_documents(path: str, fmt: str, key: str, split_lines: bool) -> Iterator[str]:
    """The documents of one input file, in file order, streamed through `datasets`."""
    from datasets import load_dataset

    if fmt == "text":
        dataset = load_dataset("text", data_files=[path], split="train", streaming=True,
                               sample_by="line" if split_lines else "paragraph")
        for batch in dataset.iter(batch_size=READ_BATCH):
            for text in batch["text"]:
                # datasets splits paragraphs at "\n\n" only; also split at blank lines holding spaces.
                pieces = [text] if split_lines else BLANK_LINES.split(text)
                yield from (piece.strip() for piece in pieces if piece.strip())
        return
    dataset = load_dataset(fmt, data_files=[path], split="train", streaming=True)
    for batch in dataset.iter(batch_size=READ_BATCH):
        if key not in batch:
            raise SystemExit(f"error: {path} has no field {key!r} (it has {sorted(batch)}); pass --json-key with "
                             f"the one that holds the text")
        for text in batch[key]:
            if text is None:
                continue
            if not isinstance(text, str):
                raise SystemExit(f"error: field {key!r} of {path} holds {type(text).__name__}, not text; pass "
                                 f"--json-key with the field that holds the document text")
            yield text


def chunks(documents: Iterator[str], size: int) -> Iterator[list[str]]:
    chunk = []
    for document in documents:
        chunk.append(document)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


# -------------------------------------------------------------------------- tokenizing (in workers)
_WORKER: dict = {}


def load_tokenizer(tokenizer_dir: str):
    from transformers import AutoTokenizer

    if not Path(tokenizer_dir).is_dir():
        raise SystemExit(f"error: no tokenizer directory {tokenizer_dir}; pass a Hugging Face tokenizer directory "
                         f"such as data/tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.model_max_length = sys.maxsize  # documents are longer than any model input; no warning
    return tokenizer


def init_worker(tokenizer_dir: str, eod: int | None, dtype: str) -> None:
    _WORKER.update(tokenizer=load_tokenizer(tokenizer_dir), eod=eod, dtype=np.dtype(dtype))


def encode(documents: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The chunk's token ids (each document + eod when set) concatenated, and each document's length."""
    tokenizer, eod, dtype = _WORKER["tokenizer"], _WORKER["eod"], _WORKER["dtype"]
    ids = tokenizer(documents, add_special_tokens=False)["input_ids"]
    if eod is not None:
        ids = [d + [eod] if d else d for d in ids]
    lengths = np.array([len(d) for d in ids], dtype=np.int64)
    flat = np.fromiter((t for d in ids for t in d), dtype=np.int64, count=int(lengths.sum()))
    limits = np.iinfo(dtype)
    if flat.size and (flat.min() < limits.min or flat.max() > limits.max):
        raise ValueError(f"token ids up to {flat.max()} do not fit --dtype {dtype.name}; use --dtype int32")
    return flat.astype(dtype), lengths


def encoded_chunks(documents: Iterator[list[str]], workers: int, tokenizer_dir: str, eod: int | None,
                   dtype: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """encode() of every chunk, in input order; with workers > 1 a pool works on a bounded window of
    chunks ahead (the input is not read faster than it is written)."""
    if workers == 1:
        init_worker(tokenizer_dir, eod, dtype)
        yield from map(encode, documents)
        return
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism; no Rust threads per worker
    with multiprocessing.Pool(workers, initializer=init_worker, initargs=(tokenizer_dir, eod, dtype)) as pool:
        pending: collections.deque = collections.deque()
        for chunk in documents:
            pending.append(pool.apply_async(encode, (chunk,)))
            if len(pending) >= 4 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# ------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    formats = [input_format(path, args.input_format) for path in args.input]
    for path in args.input:
        if not os.path.isfile(path):
            raise SystemExit(f"error: no input file {path}")
    tokenizer = load_tokenizer(args.tokenizer)
    eod = None
    if args.append_eod:
        eod = tokenizer.eos_token_id
        if eod is None:
            raise SystemExit(f"error: the tokenizer in {args.tokenizer} has no eos_token to end documents with; set "
                             f"eos_token in its tokenizer_config.json or pass --no-append-eod")
    dtype = np.dtype(best_fitting_dtype(len(tokenizer)) if args.dtype == "auto" else args.dtype)
    key = "text" if all(fmt == "text" for fmt in formats) else args.json_key
    prefix = f"{args.output_prefix}_{key}_document"

    def documents() -> Iterator[str]:
        for path, fmt in zip(args.input, formats):
            yield from read_documents(path, fmt, args.json_key, args.split_lines)

    from tqdm import tqdm

    start = time.perf_counter()
    tokens = written = skipped = 0
    with IndexedDatasetWriter(prefix, dtype) as writer, \
            tqdm(desc="tokenizing", unit=" docs", disable=args.quiet, dynamic_ncols=True) as progress:
        for flat, lengths in encoded_chunks(chunks(documents(), args.chunk_size), args.workers, args.tokenizer,
                                            eod, dtype.name):
            offset = 0
            for length in lengths.tolist():
                if length:
                    writer.add_document(flat[offset: offset + length])
                    written += 1
                else:
                    skipped += 1
                offset += length
            tokens += int(lengths.sum())
            progress.update(len(lengths))
            progress.set_postfix(tokens=f"{tokens:,}", refresh=False)
    seconds = time.perf_counter() - start
    print(f"wrote {data_path(prefix)} and {index_path(prefix)}: {written:,} documents, {tokens:,} tokens "
          f"({dtype.name}){f', {skipped} empty documents skipped' if skipped else ''} in {seconds:.1f} s "
          f"({tokens / max(seconds, 1e-9):,.0f} tokens/s, {args.workers} worker(s))")
    return {"prefix": prefix, "documents": written, "tokens": tokens, "skipped": skipped, "seconds": seconds,
            "dtype": dtype.name}


if __name__ == "__main__":
    main()
