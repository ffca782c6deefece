"""How a checkpoint becomes visible only once it is complete.

    output_dir/model_0000500.tmp/   written first (every rank writes its files here)
    output_dir/model_0000500/       the same directory, renamed when all of it is written
    output_dir/last_checkpoint      then names it (itself written under a temporary name and renamed)

A run killed at any point leaves either the previous checkpoint named by `last_checkpoint`, or the
new one complete; an interrupted ``.tmp`` directory is removed on resume.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

POINTER = "last_checkpoint"

logger = logging.getLogger("libai_zoo")


def staging_dir(final: Path) -> Path:
    """Where checkpoint `final` is written before it is complete."""
    return final.with_name(f"{final.name}.tmp")


def start(final: Path) -> Path:
    """An empty staging directory for checkpoint `final` (one process creates it)."""
    staged = staging_dir(final)
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    return staged


def finish(final: Path, *, pointer: bool = True) -> None:
    """Rename the complete staging directory to `final` (replacing an older one of that name) and,
    with `pointer`, make `last_checkpoint` name it (one process, after every writer is done)."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging_dir(final), final)
    if pointer:
        tmp = final.parent / f"{POINTER}.tmp"
        tmp.write_text(final.name)
        os.replace(tmp, final.parent / POINTER)


def pointed_to(output_dir: Path) -> Path | None:
    """The checkpoint `last_checkpoint` names, or None when there is none yet."""
    pointer = output_dir / POINTER
    if not pointer.is_file():
        return None
    return output_dir / pointer.read_text().strip()


def remove_incomplete(output_dir: Path) -> None:
    """Delete the staging directories of interrupted writes (one process)."""
    if output_dir.is_dir():
        for staged in output_dir.glob("*.tmp"):
            logger.warning("removing %s: an interrupted checkpoint write", staged)
            shutil.rmtree(staged, ignore_errors=True) if staged.is_dir() else staged.unlink()
