"""Pre-training data from any `datasets` source: documents tokenized with the model's tokenizer, eos
after each, and the token stream cut into consecutive windows of seq_len tokens.

    dataset = build_text_dataset("corpus.jsonl", "data/tokenizer", seq_len=1024)        # map-style
    dataset[0]  # {"input_ids": LongTensor[1024], "labels": LongTensor[1024]}; models shift labels themselves
    stream = build_text_dataset("corpus.jsonl", "data/tokenizer", seq_len=1024, streaming=True)  # endless

Map-style, two `Dataset.map` passes that `datasets` caches (a second call with the same source,
tokenizer and arguments reads their cache files instead of tokenizing again): tokenize (batched,
``num_proc`` processes), then pack: window k is tokens [k·seq_len, (k+1)·seq_len) of the whole
stream, so a window may span documents and the tail that fills no window is left out, as in
`PackedTokenDataset`. The windows are stored once; a transform hands out input_ids and labels as
torch tensors (storing labels too would double the cache). Streaming: `PackedTextStream`.
"""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
from datasets.fingerprint import Hasher

from .hf_source import load_source, require_columns
from .index_cache import file_fingerprint
from .streaming import PackedTextStream
from .tokenizer import load_tokenizer

CACHE_FORMAT = "text-windows-v1"  # change it when the cached columns change, so old caches are not reused
TOKENIZE_BATCH = 1000  # documents per Dataset.map batch
TOKENS = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"))})


def build_text_dataset(path: str, tokenizer_dir: str, seq_len: int, *, text_column: str = "text",
                       split: str = "train", name: str | None = None, data_files=None, num_proc: int | None = None,
                       streaming: bool = False, cache_dir: str | None = None,
                       **load_kwargs) -> datasets.Dataset | PackedTextStream:
    """The documents in `text_column` of `path` (anything `load_source` reads) as seq_len-token
    samples {"input_ids", "labels"}: a `datasets.Dataset` of the packed windows (see the module
    docstring), or with ``streaming=True`` an endless, exactly resumable `PackedTextStream` (read in
    order, not shuffled). `cache_dir` holds datasets' prepared source and the tokenized windows
    (default: datasets' cache; beside the files of a save_to_disk directory). `num_proc` processes
    tokenize a map-style source. Empty documents are skipped."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    tokenizer = load_tokenizer(tokenizer_dir)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer in {tokenizer_dir} has no eos_token; set it in its tokenizer_config.json")
    described = f"{path} (tokenized with {tokenizer_dir})"
    source = load_source(path, name=name, split=split, data_files=data_files, streaming=streaming,
                         cache_dir=cache_dir, **load_kwargs)
    require_columns(source, [text_column], path)
    if streaming:
        return PackedTextStream(source, tokenizer, seq_len, text_column=text_column, source=described,
                                tokenizer_dir=tokenizer_dir)

    # Our own fingerprints: what decides the result, not a hash of the tokenizer object by dill.
    tokenized_key = Hasher.hash([CACHE_FORMAT, source._fingerprint, text_column, tokenizer.eos_token_id,
                                 file_fingerprint(Path(tokenizer_dir) / "tokenizer.json")])
    tokens = source.map(_tokenize, batched=True, batch_size=TOKENIZE_BATCH, num_proc=num_proc,
                        remove_columns=source.column_names, features=TOKENS, new_fingerprint=tokenized_key,
                        cache_file_name=_cache_file(cache_dir, "tokens", tokenized_key), desc="tokenizing",
                        fn_kwargs=dict(tokenizer=tokenizer, column=text_column))
    lengths = pc.list_value_length(tokens.data.column("input_ids")).to_numpy()
    ends = np.cumsum(lengths, dtype=np.int64)
    total = int(ends[-1]) if len(ends) else 0
    if total < seq_len:
        raise ValueError(f"{described} gives {total} tokens, fewer than one sample of seq_len {seq_len}; use more "
                         f"text or a shorter seq_len (or check text_column={text_column!r})")
    windows_key = Hasher.hash([tokenized_key, seq_len])
    windows = tokens.with_format("arrow").map(
        _Windows(tokens, ends, seq_len), batched=True, batch_size=TOKENIZE_BATCH, with_indices=True,
        num_proc=num_proc, remove_columns=tokens.column_names, features=TOKENS, new_fingerprint=windows_key,
        cache_file_name=_cache_file(cache_dir, "windows", windows_key), desc=f"packing {seq_len}-token samples")
    windows.info.description = described  # names it in check_dataset's errors
    samples = windows.with_transform(_as_samples)
    # What check_dataset reads besides the table: the tokenizer, and the argument that sets the length
    samples.tokenizer_dir, samples.tokenizer_vocab_size, samples.seq_len = str(tokenizer_dir), len(tokenizer), seq_len
    return samples


def _cache_file(cache_dir: str | None, what: str, key: str) -> str | None:
    """Where a map pass caches its result: in cache_dir when given, else where datasets puts it."""
    return None if cache_dir is None else str(Path(cache_dir) / f"text-{what}-{key}.arrow")


def _tokenize(batch: dict, *, tokenizer, column: str) -> dict:
    """Dataset.map: each non-empty document's token ids, eos after them."""
    texts = [text for text in batch[column] if text]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []  # transformers refuses []
    return {"input_ids": [ids + [tokenizer.eos_token_id] for ids in encoded]}


class _Windows:
    """Dataset.map over the tokenized documents, with their indices: the windows that start inside
    a batch's documents, read whole from the token column (a window may end in later documents)."""

    def __init__(self, tokens: datasets.Dataset, ends: np.ndarray, seq_len: int):
        self.tokens, self.ends, self.seq_len = tokens, ends, seq_len
        self.count = int(ends[-1]) // seq_len

    def __call__(self, batch, indices: list[int]) -> dict:
        size, ends = self.seq_len, self.ends
        begin = int(ends[indices[0] - 1]) if indices[0] else 0
        first = -(-begin // size)
        stop = min(-(-int(ends[indices[-1]]) // size), self.count)
        if stop <= first:
            return {"input_ids": np.zeros((0, size), dtype=np.int32)}
        low = int(np.searchsorted(ends, first * size, side="right"))  # the documents holding the windows
        high = int(np.searchsorted(ends, stop * size - 1, side="right")) + 1
        flat = pc.list_flatten(self.tokens.data.slice(low, high - low).column("input_ids")).to_numpy()
        offset = int(ends[low - 1]) if low else 0
        return {"input_ids": flat[first * size - offset: stop * size - offset].reshape(-1, size)}


def _as_samples(batch: dict) -> dict[str, torch.Tensor]:
    """The transform: windows as int64 tensors, labels a copy of input_ids."""
    input_ids = torch.tensor(batch["input_ids"], dtype=torch.long)
    return {"input_ids": input_ids, "labels": input_ids.clone()}
