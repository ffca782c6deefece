"""The shipped corpus format: a text file of documents separated by blank lines."""

from __future__ import annotations

import re
from pathlib import Path


def read_documents(text_file: str | Path) -> list[str]:
    """The documents of a text file: its blank-line-separated blocks, stripped, empty ones dropped."""
    path = Path(text_file)
    if not path.is_file():
        raise FileNotFoundError(f"no text file {path}; the shipped corpus is data/corpus/python_docs.txt "
                                f"(run from the repository root or pass an absolute path)")
    return [doc.strip() for doc in re.split(r"\n\s*\n", path.read_text(encoding="utf-8")) if doc.strip()]
