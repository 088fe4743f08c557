"""Input files of ``--train-data`` / ``--eval-data`` / ``psctl check-data``: listing a glob,
cutting files into pieces at line starts, and checking the pieces in parallel processes.

One implementation for every format (CSV and TFRecord in coordinator/data.py, Criteo TSV in
coordinator/criteo.py, their checks in coordinator/checks.py). Nothing here imports
TensorFlow: ``psctl check-data`` of CSV or Criteo files never loads it.
"""

from __future__ import annotations

import glob as globlib
import multiprocessing
import os
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar

from psctl.cluster.errors import ConfigError

PIECE_BYTES = 32 << 20  # a plain text file is checked in pieces of about this size
# Below this many bytes in all, checking in this process beats starting processes (each
# costs about 0.3 s, more if it must import TensorFlow).
PARALLEL_BYTES = 64 << 20

T = TypeVar("T")


def expand(pattern: str, field: str) -> list[str]:
    """The regular files a glob (or a directory: every file in it) names, sorted."""
    if not pattern.strip():
        raise ConfigError(field, "is empty", "give a file or a glob such as 'data/train-*.csv'")
    expanded = os.path.expanduser(pattern)
    if os.path.isdir(expanded):
        expanded = os.path.join(expanded, "*")
    paths = sorted(p for p in globlib.glob(expanded) if os.path.isfile(p))
    if not paths:
        raise ConfigError(
            field,
            f"no files match {pattern!r}",
            "check the path (quote a glob so the shell leaves it to psctl)",
        )
    return paths


def absolute(path: str) -> str:
    """The path every worker opens (workers may run in another directory)."""
    return os.path.abspath(path)


def size_of(path: str) -> int:
    return os.path.getsize(path)


def open_bytes(path: str) -> BinaryIO:
    return open(path, "rb")


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, end)`` of file ``file`` (its index in the glob's sorted list), cut
    at line starts; ``end == -1``: to the end of the file. A file's pieces are in order."""

    path: str
    file: int
    start: int = 0
    end: int = -1
    last: bool = True  # the file's last piece


def cut(
    paths: Sequence[str], *, splittable: bool, piece_bytes: int = PIECE_BYTES
) -> tuple[list[Piece], int]:
    """Every file as pieces (whole files unless ``splittable``: plain text, cut after a
    newline near every ``piece_bytes``), and the bytes of all files."""
    pieces: list[Piece] = []
    total = 0
    for index, path in enumerate(paths):
        size = size_of(path)
        total += size
        if not splittable or size <= piece_bytes:
            pieces.append(Piece(path, index))
            continue
        starts = [0]
        with open_bytes(path) as handle:
            for guess in range(piece_bytes, size, piece_bytes):
                if guess <= starts[-1]:
                    continue
                handle.seek(guess - 1)
                handle.readline()  # the rest of the line the guess falls in
                start = handle.tell()
                if start < size:
                    starts.append(start)
        ends = [*starts[1:], -1]
        pieces += [
            Piece(path, index, start, end, last=end == -1)
            for start, end in zip(starts, ends, strict=True)
        ]
    return pieces, total


def read_piece(piece: Piece) -> bytes:
    with open_bytes(piece.path) as handle:
        handle.seek(piece.start)
        return handle.read() if piece.end < 0 else handle.read(piece.end - piece.start)


def default_jobs() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def in_order(
    check: Callable[[Piece], T], pieces: Sequence[Piece], *, jobs: int, total_bytes: int
) -> Generator[T, None, None]:
    """``check(piece)`` of every piece, yielded in order. With ``jobs`` above 1, at least two
    pieces and at least PARALLEL_BYTES (or ``jobs`` given explicitly, ``total_bytes=-1``),
    the pieces run in up to ``jobs`` processes; when the caller stops early (the first bad
    piece), the pieces not started are dropped. ``check`` must be a module-level function
    (or a functools.partial of one) with arguments that pickle."""
    parallel = jobs > 1 and len(pieces) > 1 and (total_bytes < 0 or total_bytes >= PARALLEL_BYTES)
    if not parallel:
        for piece in pieces:
            yield check(piece)
        return
    # spawn, not fork: the calling process may hold TensorFlow's and gRPC's threads.
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=min(jobs, len(pieces)), mp_context=context)
    futures: list[Future[Any]] = []
    try:
        futures = [pool.submit(check, piece) for piece in pieces]
        for future in futures:
            yield future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
