"""The commands the documentation gives, read from the files themselves: the shell blocks of the
READMEs (```bash fences) and the indented command lines of the recipes' docstrings
(projects/**/*.py). A block is the commands of one fence or one docstring, in their order: a
later command may continue an earlier one (resume it, convert its checkpoint, load its adapter).

    python tests/documented_commands.py      # lists them, block by block
"""

from __future__ import annotations

import ast
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/*.md", "projects/*/README.md", "tools/README.md")
DOCSTRINGS = ("projects/*/*.py",)
#: what a documented command starts with (after VAR=value assignments)
PROGRAMS = ("python", "python3", "torchrun", "accelerate", "pytest", "ruff", "bash")


@dataclass(frozen=True)
class Command:
    """One documented command: `text` as written (continuations joined, comment dropped), where."""

    text: str
    source: str
    line: int

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text)


@dataclass(frozen=True)
class Block:
    """The commands of one fence or docstring, in order."""

    source: str
    line: int
    commands: tuple[Command, ...]

    @property
    def name(self) -> str:
        return f"{self.source}:{self.line}"


def _is_command(text: str) -> bool:
    words = text.split()
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]
    return bool(words) and words[0] in PROGRAMS


def _commands(lines: list[tuple[int, str]], source: str) -> tuple[Command, ...]:
    """The commands among numbered `lines`: a command line and its backslash continuations, its
    trailing comment dropped."""
    commands, pending, start = [], "", 0
    for number, raw in lines:
        text = raw.strip()
        if not pending and not _is_command(text):
            continue
        start = start if pending else number
        pending += " " + text
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        words = shlex.split(pending, comments=True)
        commands.append(Command(shlex.join(words), source, start))
        pending = ""
    return tuple(commands)


def _markdown_blocks(path: Path) -> list[Block]:
    source, blocks, fence = str(path.relative_to(ROOT)), [], None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):  # a fence, also indented under a list item
            if fence is None:
                fence = (number, line.strip()[3:].strip(), [])
            else:
                if fence[1] in ("bash", "sh", "shell"):
                    commands = _commands(fence[2], source)
                    if commands:
                        blocks.append(Block(source, fence[0], commands))
                fence = None
        elif fence is not None:
            fence[2].append((number, line))
    return blocks


def _docstring_block(path: Path) -> list[Block]:
    module = ast.parse(path.read_text())
    docstring = ast.get_docstring(module, clean=False)
    if not docstring:
        return []
    source = str(path.relative_to(ROOT))
    first = module.body[0].lineno
    lines = [(first + index, line) for index, line in enumerate(docstring.splitlines())]
    commands = _commands([(number, line) for number, line in lines if line.startswith("    ")], source)
    return [Block(source, first, commands)] if commands else []


def documented_blocks() -> list[Block]:
    """Every block of documented commands, file by file."""
    blocks = []
    for pattern in DOCS:
        for path in sorted(ROOT.glob(pattern)):
            blocks += _markdown_blocks(path)
    for pattern in DOCSTRINGS:
        for path in sorted(ROOT.glob(pattern)):
            blocks += _docstring_block(path)
    return blocks


if __name__ == "__main__":
    for block in documented_blocks():
        print(f"== {block.name}")
        for command in block.commands:
            print(f"   {command.text}")
