"""How a checkpoint becomes visible only once it is complete, and how it proves it is intact.

    output_dir/model_0000500.tmp/   written first (every rank writes its files here; rank 0 adds
                                    manifest.json once every rank has reported what it wrote)
    output_dir/model_0000500/       the same directory, renamed when all of it is written
    output_dir/last_checkpoint      then names it (itself written under a temporary name and renamed)

A run killed at any point leaves either the previous checkpoint named by `last_checkpoint`, or the
new one complete; an interrupted ``.tmp`` directory is removed on resume.

``manifest.json`` lists every file the writers produced with its size in bytes and its CRC-32
(zlib's, streamed in 4 MiB chunks: about 2.8 GB/s on one core, so checking costs a fraction of
writing, and it catches the truncations, torn writes and flipped bits of a disk or a copy; it is
no defence against deliberate tampering). The rename and the pointer stay the commit marker: the
manifest is written before them, so a committed checkpoint always has it. `resumable_candidates`
lists what a resume may use, newest first; `check_file` compares one file with its record. A
checkpoint without its manifest is damaged: nothing vouches for its files.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import zlib
from pathlib import Path

POINTER = "last_checkpoint"
MANIFEST = "manifest.json"
CONFIG = "config.yaml"  # the config of the run that wrote the checkpoint
MANIFEST_FORMAT = "libai_zoo checkpoint manifest 1"
METADATA = ".metadata"
CHUNK_BYTES = 4 << 20

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
        for staged in output_dir.glob("model_*.tmp"):
            logger.warning("removing %s: an interrupted checkpoint write", staged)
            shutil.rmtree(staged, ignore_errors=True) if staged.is_dir() else staged.unlink()


# ----------------------------------------------------------------------------------- manifest
def checksum(path: Path) -> str:
    """The CRC-32 of a file as 8 hex digits, read in chunks (a shard may be larger than memory allows twice)."""
    crc = 0
    with open(path, "rb") as file:
        while chunk := file.read(CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def files_of_rank(staged: Path, rank: int) -> list[Path]:
    """The files rank `rank` wrote into a checkpoint directory: its torch.distributed.checkpoint
    shards (``__{rank}_*.distcp``), its trainer state, and on rank 0 the checkpoint's ``.metadata``
    and the config of the run that wrote it."""
    files = sorted(staged.glob(f"__{rank}_*.distcp"))
    files += [file for file in [staged / f"trainer_state_rank{rank}.pt"] if file.is_file()]
    if rank == 0:
        files += [staged / METADATA, *[file for file in [staged / CONFIG] if file.is_file()]]
    return files


def record_files(staged: Path, rank: int) -> dict[str, dict]:
    """{file name: {"size", "crc32", "rank"}} of what rank `rank` wrote into `staged`."""
    return {file.name: {"size": file.stat().st_size, "crc32": checksum(file), "rank": rank}
            for file in files_of_rank(staged, rank)}


def write_manifest(staged: Path, files: dict[str, dict], *, iteration: int, world_size: int) -> None:
    """Write ``manifest.json`` (the records of every rank's files) into the staging directory, durably
    (temporary name, fsync, rename), before the checkpoint is committed."""
    manifest = {"format": MANIFEST_FORMAT, "iteration": iteration, "world_size": world_size, "checksum": "crc32",
                "files": dict(sorted(files.items()))}
    tmp = staged / f"{MANIFEST}.tmp"
    with open(tmp, "w") as file:
        json.dump(manifest, file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, staged / MANIFEST)


def read_manifest(checkpoint: Path) -> dict:
    """The manifest of a checkpoint. Raises ValueError when it is missing or unreadable."""
    path = checkpoint / MANIFEST
    if not path.is_file():
        raise ValueError(f"{MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {manifest.get('format')!r}")
        return manifest
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        raise ValueError(f"{MANIFEST} is unreadable ({error})") from error


def check_file(checkpoint: Path, name: str, record: dict) -> str | None:
    """What differs between file `name` of `checkpoint` and its manifest record, or None when it matches."""
    path = checkpoint / name
    if not path.is_file():
        return f"{name} is missing"
    size = path.stat().st_size
    if size != record["size"]:
        return f"{name} has {size} bytes, the manifest says {record['size']}"
    crc = checksum(path)
    if crc != record["crc32"]:
        return f"{name} has CRC-32 {crc}, the manifest says {record['crc32']}"
    return None


def iteration_of(checkpoint: Path) -> int | None:
    """The iteration of a periodic checkpoint (``model_0000500`` -> 500); None for other names."""
    digits = checkpoint.name.removeprefix("model_")
    return int(digits) if checkpoint.name.startswith("model_") and digits.isdigit() else None


def resumable_candidates(output_dir: Path, at_most: int | None = None) -> list[Path]:
    """The checkpoints a run may resume from, in the order to try them: the one `last_checkpoint`
    names, then the periodic ones before it (complete: renamed, with ``.metadata``), newest first.
    `at_most` keeps only those of at most that iteration. Empty when nothing was committed yet."""
    named = pointed_to(output_dir)
    if named is None:
        return []
    newest = iteration_of(named)
    older = sorted((iteration_of(path), path) for path in output_dir.glob("model_*")
                   if iteration_of(path) is not None and path != named and (path / METADATA).is_file()
                   and (newest is None or iteration_of(path) < newest))
    candidates = [named] + [path for _, path in reversed(older)]
    if at_most is None:
        return candidates
    return [path for path in candidates if (iteration_of(path) is not None and iteration_of(path) <= at_most)]
