"""Any `datasets` source, as the recipes name it: local files, a `save_to_disk` directory, or a
dataset name where a hub is reachable.

    load_source("corpus.jsonl")                          # json/jsonl/parquet/csv/arrow/txt by suffix
    load_source("saved_dir/")                            # what Dataset(Dict).save_to_disk wrote
    load_source("imdb", split="train")                   # anything datasets.load_dataset takes
    load_source("corpus.jsonl", streaming=True)          # a datasets.IterableDataset
    require_columns(dataset, ["messages"], "corpus.jsonl", argument="messages_column")

The recipes that tokenize (`build_text_dataset`, `build_chat_dataset`) take these arguments and
pass them here, so every source reads the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import datasets

# datasets' packaged builder for each file suffix
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow",
                 ".txt": "text"}


def load_source(path: str, *, name: str | None = None, split: str = "train", data_files=None,
                streaming: bool = False, **load_kwargs) -> datasets.Dataset | datasets.IterableDataset:
    """One split of a `datasets` source: a data file (its builder chosen by suffix), a directory
    `save_to_disk` wrote (`load_from_disk`), or whatever `datasets.load_dataset(path, name,
    data_files=..., split=...)` takes. ``streaming=True`` gives a `datasets.IterableDataset`. An
    empty split is refused, naming the source (a stream's first example is read to know)."""
    local = Path(path)
    if local.is_dir() and ((local / "dataset_info.json").is_file() or (local / "dataset_dict.json").is_file()):
        saved = datasets.load_from_disk(str(local))
        if isinstance(saved, datasets.DatasetDict):
            if split not in saved:
                raise ValueError(f"{path} holds the splits {sorted(saved)}, not {split!r}: pass split=one of them")
            saved = saved[split]
        dataset = saved.to_iterable_dataset() if streaming else saved
    elif local.suffix in FILE_BUILDERS and data_files is None:
        if not local.is_file():
            raise FileNotFoundError(f"no data file {path}: pass a json/jsonl/parquet/csv/arrow/txt file, a directory "
                                    f"written by save_to_disk, or a dataset name")
        if local.stat().st_size == 0:  # datasets' builders fail on one with a bare StopIteration
            raise ValueError(f"the data file {path} is empty: there is nothing to train on")
        with _refusing_empty(path, split):
            dataset = datasets.load_dataset(FILE_BUILDERS[local.suffix], data_files=str(local), split=split,
                                            streaming=streaming, **load_kwargs)
    else:
        with _refusing_empty(path, split):
            dataset = datasets.load_dataset(path, name, data_files=data_files, split=split, streaming=streaming,
                                            **load_kwargs)
    empty = len(dataset) == 0 if isinstance(dataset, datasets.Dataset) else next(iter(dataset.take(1)), None) is None
    if empty:
        raise ValueError(_empty(path, split))
    return dataset


def _empty(path: str, split: str) -> str:
    return f"the {split!r} split of {path} is empty: there is nothing to train on"


@contextmanager
def _refusing_empty(path: str, split: str) -> Iterator[None]:
    """datasets' own error for a split without rows, said as ours."""
    try:
        yield
    except ValueError as error:
        if "corresponds to no data" not in str(error):
            raise
        raise ValueError(_empty(path, split)) from error


def require_columns(dataset: datasets.Dataset | datasets.IterableDataset, columns: list[str], source: str, *,
                    argument: str = "text_column") -> None:
    """Refuse a dataset that lacks one of `columns`, naming the columns it has and the recipe's
    `argument` that names the column."""
    present = list(dataset.column_names or [])
    if not present and isinstance(dataset, datasets.IterableDataset):  # a stream may not know them before reading
        present = list(next(iter(dataset.take(1)), {}).keys())
    missing = [column for column in columns if column not in present]
    if missing:
        raise ValueError(f"{source} has no column {', '.join(repr(c) for c in missing)}; its columns are "
                         f"{present}: name the right one with {argument}=...")
