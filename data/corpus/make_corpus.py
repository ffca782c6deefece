"""Build the English text corpus from the docstrings of the installed Python standard library.

    /work/venv/bin/python data/corpus/make_corpus.py            # writes python_docs{,_valid}.txt here

One document per docstring: each public module's own, then those of the public classes (and their
public methods and properties) and functions it exposes, in sorted module and name order; modules
outside the interpreter's own stdlib directory (setuptools' distutils shim, anything from
site-packages) are skipped. The docstrings come to ~1.3 MB only, so the help() topics of
`pydoc_data.topics` (the language reference's text, also PSF-licensed) follow as one document each.
Each document: doctest paragraphs (``>>>``) removed, whitespace runs collapsed to one space;
exact duplicates and documents under MIN_WORDS words dropped. Documents are separated by a blank
line; every VALID_EVERY-th goes to the held-out file instead of the training file. The output
depends only on the interpreter that runs this (README.md names the one used).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import os
import pkgutil
import re
import sys
import warnings
from pathlib import Path

MIN_WORDS = 5
VALID_EVERY = 50  # documents 49, 99, 149, ... (0-based) are held out

# Packages that open windows or browsers, print on import, or are tests and demos rather than docs.
# distutils: deprecated, and with setuptools installed `import distutils` gives setuptools' copy.
# pydoc_data: its topics are added whole by build_documents, not as docstrings.
SKIP_TOP_LEVEL = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3",
                  "ensurepip", "pydoc_data", "distutils", "msilib", "msvcrt", "winreg", "winsound", "nturl2path"}
SKIP_COMPONENTS = {"test", "tests", "idle_test"}
STDLIB_DIR = Path(os.__file__).resolve().parent


def module_names() -> list[str]:
    """Public stdlib modules and their public submodules, sorted."""
    names: set[str] = set()
    for top in sorted(sys.stdlib_module_names):
        if top.startswith("_") or top in SKIP_TOP_LEVEL:
            continue
        module = _import(top)
        if module is None:
            continue
        names.add(top)
        with _quiet():
            submodules = list(pkgutil.walk_packages(getattr(module, "__path__", []), prefix=f"{top}.",
                                                    onerror=lambda _: None))
        for info in submodules:
            parts = info.name.split(".")
            if not any(p.startswith("_") or p in SKIP_COMPONENTS for p in parts):
                names.add(info.name)
    return sorted(names)


@contextlib.contextmanager
def _quiet():
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _import(name: str):
    """The module, or None when it fails to import (platform-specific, missing C extension, ...) or
    does not come from the stdlib directory."""
    with _quiet():
        try:
            module = importlib.import_module(name)
        except BaseException:  # SystemExit and friends included: a module may bail out on import
            return None
    file = getattr(module, "__file__", None)  # None: built into the interpreter
    if file is not None and (STDLIB_DIR not in Path(file).resolve().parents or "site-packages" in Path(file).parts):
        return None
    return module


def docstrings(module) -> list[str]:
    """The module's docstring, then those of its own public classes, functions and methods."""
    found = [module.__doc__]
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_"):
            continue
        if inspect.isclass(obj):
            found.append(obj.__doc__)
            for attr, member in sorted(vars(obj).items()):
                if attr.startswith("_"):
                    continue
                if isinstance(member, staticmethod | classmethod):
                    member = member.__func__
                if inspect.isroutine(member) or isinstance(member, property):
                    found.append(member.__doc__)
        elif inspect.isroutine(obj):
            found.append(obj.__doc__)
    return [d for d in found if isinstance(d, str)]


def normalise(doc: str) -> str:
    """One line of text: doctest paragraphs dropped, all whitespace runs made one space."""
    paragraphs = re.split(r"\n\s*\n", inspect.cleandoc(doc))
    kept = [p for p in paragraphs if not any(line.lstrip().startswith(">>>") for line in p.splitlines())]
    return " ".join(" ".join(kept).split())


def build_documents() -> list[str]:
    from pydoc_data.topics import topics

    with _quiet():  # some imports print; typing.io and friends warn when touched
        raw = [doc for name in module_names() if (module := _import(name)) is not None for doc in docstrings(module)]
    raw += [topics[key] for key in sorted(topics)]
    documents, seen = [], set()
    for doc in raw:
        text = normalise(doc)
        if len(text.split()) >= MIN_WORDS and text not in seen and text.isprintable():
            seen.add(text)
            documents.append(text)
    return documents


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args()
    documents = build_documents()
    valid = [d for i, d in enumerate(documents) if i % VALID_EVERY == VALID_EVERY - 1]
    train = [d for i, d in enumerate(documents) if i % VALID_EVERY != VALID_EVERY - 1]
    for file, docs in (("python_docs.txt", train), ("python_docs_valid.txt", valid)):
        path = args.out_dir / file
        path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
        print(f"{path}: {len(docs)} documents, {sum(len(d.split()) for d in docs)} words, "
              f"{path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
