"""Does the data fit the model? Checked once before the first training step, so that a token id past
the vocabulary or a sample longer than the position table is one clear error naming the file and
the fix, not `IndexError: index out of range in self` at the embedding, possibly hours later.

    check_dataset(train_dataset, **model.input_limits())   # {"vocab_size": ..., "max_positions": ...}

A dataset takes part by offering `TokenDataset`'s three members (the zoo's token datasets do);
`datasets.Dataset`s with an input_ids column are read through Arrow (their target token ids too: a
reply's labels, shift_labels); blends, ConcatDataset and
Subset are checked part by part (a Subset as its whole dataset); others (images) hold no token ids
and are skipped. A dataset that knows its tokenizer (`tokenizer_vocab_size`, `tokenizer_dir`: those
of `build_text_dataset`) has the tokenizer's vocabulary checked first; a stream is checked that way
only, never scanned. A `datasets.Dataset` with a `seq_len` attribute is named by that argument in a
length error (else by max_length).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

from torch.utils.data import ConcatDataset, Dataset, Subset

from .blending import BlendedDataset

if TYPE_CHECKING:
    import datasets

#: columns of target token ids (a sequence-to-sequence reply, a shifted LM target), checked as input_ids are
TARGET_COLUMNS = ("labels", "shift_labels")


class TokenIdRange(NamedTuple):
    """The smallest and largest token id that one source puts in a dataset's samples."""

    source: str  # where they come from, as a person finds it: a file, "the [CLS]... tokens", ...
    low: int
    high: int


@runtime_checkable
class TokenDataset(Protocol):
    """What `check_dataset` reads of a dataset whose samples hold token ids (input_ids)."""

    #: Tokens in a sample's input_ids: the dataset's `seq_len` argument.
    seq_len: int
    #: What the samples are made of (a file), for error messages.
    source: str

    def token_id_ranges(self) -> list[TokenIdRange]:
        """The range of the token ids of each source of the samples (the data file, tokens the
        dataset adds); it may read the whole data once (the docstring says what it costs)."""


class _Inputs(NamedTuple):
    source: str
    seq_len: int
    seq_len_key: str  # the argument that sets seq_len, named in the fix
    ranges: Callable[[], list[TokenIdRange]]  # called only when the vocabulary is checked


def check_dataset(dataset: Dataset | datasets.Dataset, *, vocab_size: int | None, max_positions: int | None) -> None:
    """Raise a ValueError naming every way `dataset`'s samples do not fit a model that embeds
    `vocab_size` token ids at `max_positions` learned positions (None: no such limit; the model
    says both in `input_limits()`), with the file and the fix.

    Cost: the sequence lengths are free; the token ids are read once when vocab_size is given:
    every token of a Megatron .bin (cached in the dataset's cache_dir, see
    `index_cache.cached_token_range`), the tokens of a `PackedTokenDataset`'s samples, the input_ids
    column of a `datasets.Dataset`: a vectorized min/max, about as fast as the data is read."""
    if vocab_size is None and max_positions is None:
        return
    problems = []
    for part in _parts(dataset):
        inputs = _inputs(part)
        if inputs is None:
            continue
        if max_positions is not None and inputs.seq_len > max_positions:
            key = inputs.seq_len_key
            problems.append(f"{inputs.source} makes samples of {key} = {inputs.seq_len} tokens, but the model's "
                            f"learned position embeddings hold {max_positions} positions (GPT-2's n_positions, "
                            f"BERT's max_position_embeddings), so the first step would index past them: set the "
                            f"dataset's {key} to at most {max_positions} (e.g. dataloader.train.{key}="
                            f"{max_positions}), or use a model with max_position_embeddings >= {inputs.seq_len}")
        if vocab_size is None:
            continue
        tokenizer_size = getattr(part, "tokenizer_vocab_size", None)
        if tokenizer_size is not None and tokenizer_size > vocab_size:  # then the ids past it are no news
            problems.append(f"{inputs.source}: the tokenizer {part.tokenizer_dir} has a vocabulary of "
                            f"{tokenizer_size} tokens, but the model's has {vocab_size}, so a token id >= "
                            f"{vocab_size} would fail at its embedding: use the model's own tokenizer, or resize "
                            f"the model's embedding (model.config.vocab_size >= {tokenizer_size})")
            continue
        for source, low, high in inputs.ranges():
            if high >= vocab_size:
                problems.append(f"{source} holds token ids up to {high}, but the model's vocabulary has {vocab_size} "
                                f"(ids 0..{vocab_size - 1}), so its embedding would fail at the first step: "
                                f"re-tokenize the data with the model's tokenizer, or set model.config.vocab_size "
                                f">= {high + 1}")
            if low < 0:
                problems.append(f"{source} holds the token id {low}, and ids are never negative: the data is "
                                f"damaged or was written with a dtype too narrow for its ids; tokenize it again "
                                f"(tools/preprocess_data.py for .bin/.idx)")
    problems = list(dict.fromkeys(problems))  # a file blended twice is one problem
    if len(problems) == 1:
        raise ValueError(problems[0])
    if problems:
        raise ValueError(f"the data does not fit the model ({len(problems)} problems):\n- " + "\n- ".join(problems))


def _parts(dataset: Dataset) -> Iterator[Dataset]:
    """The datasets that make samples inside blends, concatenations and subsets."""
    if isinstance(dataset, BlendedDataset | ConcatDataset):
        for part in dataset.datasets:
            yield from _parts(part)
    elif isinstance(dataset, Subset):
        yield from _parts(dataset.dataset)
    else:
        yield dataset


def _inputs(dataset: Dataset) -> _Inputs | None:
    """What `dataset` feeds a model's embeddings, None when it holds no token ids."""
    if isinstance(dataset, TokenDataset):
        return _Inputs(dataset.source, dataset.seq_len, "seq_len", dataset.token_id_ranges)
    # a datasets.Dataset exists only where its library is loaded: a run that reads none never imports it (1 s)
    hf_datasets = sys.modules.get("datasets")
    if hf_datasets is not None and isinstance(dataset, hf_datasets.Dataset) and "input_ids" in dataset.column_names:
        import pyarrow as pa
        import pyarrow.compute as pc

        column = dataset.data.column("input_ids")  # every row of the table, also those a select() left out
        source = dataset.info.description or ", ".join(f["filename"] for f in dataset.cache_files) \
            or f"the datasets.Dataset of {dataset.num_rows} rows"

        def ranges() -> list[TokenIdRange]:
            found = []
            for name in ("input_ids", *TARGET_COLUMNS):
                if name in dataset.column_names and pa.types.is_list(dataset.data.column(name).type):
                    ids = pc.list_flatten(dataset.data.column(name))
                    ids = ids.filter(pc.greater_equal(ids, 0))  # IGNORE_INDEX scores nothing
                    low_high = pc.min_max(ids).as_py()
                    if low_high["min"] is not None:
                        what = source if name == "input_ids" else f"the {name} of {source}"
                        found.append(TokenIdRange(what, low_high["min"], low_high["max"]))
            return found

        key = "seq_len" if hasattr(dataset, "seq_len") else "max_length"  # the builder's argument
        return _Inputs(source, pc.max(pc.list_value_length(column)).as_py() or 0, key, ranges)
    return None
