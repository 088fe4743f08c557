"""The Criteo TSV format, for the built-in ``ctr`` job: checking files and reading them.

One example per line, 40 tab-separated cells, as in the public Criteo click logs (Kaggle
Display Advertising Challenge, Criteo 1TB): the label (0 or 1), 13 integer features
``I1``-``I13`` (counts; may be negative) and 26 categorical features ``C1``-``C26`` as
hexadecimal ids. Any feature cell may be empty. Files may be gzipped (``*.gz``).

Every file is read in full on the coordinator before training (cached per glob), so a bad
line is one :class:`~cluster.errors.ConfigError` naming the file, the line and the column.
The model input is one int64 vector of 39 per example: the 13 integers (an empty cell is 0)
then the 26 ids hashed into a table of ``rows`` rows: ``to_hash_bucket_fast("C<j>:" + id)``,
so equal ids of different features land on different rows, and an empty cell is one
"missing" id per feature. Sharding over workers is as for CSV files (coordinator/data.py).
"""

from __future__ import annotations

import gzip
import io
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from psctl.cluster.errors import ConfigError
from psctl.coordinator.data import expand
from psctl.coordinator.dynamic import KEY_SPACE

if TYPE_CHECKING:
    from psctl.coordinator.job import DataContext

# What jobs use (``from psctl.job import criteo``): the format, the check, the reader.
__all__ = [
    "COLUMNS",
    "KEY_SPACE",
    "NUM_DENSE",
    "NUM_INPUTS",
    "NUM_SPARSE",
    "TsvFiles",
    "check_files",
    "format_line",
    "hash_ids",
    "make_dataset",
    "parse_lines",
]

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_CELLS = 1 + NUM_DENSE + NUM_SPARSE
NUM_INPUTS = NUM_DENSE + NUM_SPARSE  # the model input: 13 integers, then 26 table rows
COLUMNS = ("label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27)))
DEFAULT_SHUFFLE_BUFFER = 10_000  # lines per worker
FIX = "write the label (0 or 1), 13 integers and 26 hexadecimal ids, tab-separated (or remove it)"

_INT = rb"-?[0-9]{1,18}"  # at most 18 digits: always fits int64
_HEX = rb"[0-9a-fA-F]{1,16}"
_LINE = re.compile(rb"[01]" + (rb"\t(?:" + _INT + rb")?") * 13 + (rb"\t(?:" + _HEX + rb")?") * 26)


@dataclass(frozen=True)
class TsvFiles:
    """A checked glob of Criteo TSV files."""

    pattern: str
    paths: tuple[str, ...]  # as the glob gave them (for messages), sorted
    files: tuple[str, ...]  # absolute, same order (for TensorFlow, on every worker)
    records_per_file: tuple[int, ...]
    positives: int  # lines with label 1

    @property
    def num_records(self) -> int:
        return sum(self.records_per_file)

    @property
    def compressed(self) -> bool:
        return self.files[0].endswith(".gz")


_cache: dict[str, TsvFiles] = {}
_cache_lock = threading.Lock()


@tf.autograph.experimental.do_not_convert
def check_files(pattern: str, *, field: str = "--data") -> TsvFiles:
    """Expand ``pattern`` (a glob, a file or a directory) and check every line of every file;
    cached per glob. Raises ConfigError (``field``: the flag) naming the file and line."""
    with _cache_lock:
        found = _cache.get(pattern)
        if found is None:
            found = _cache[pattern] = _scan(pattern, field)
    return found


def clear_cache() -> None:
    with _cache_lock:
        _cache.clear()


def _expand(pattern: str, field: str) -> list[str]:
    """The files of a glob (coordinator/data.py's rules), all gzipped or all plain."""
    paths = expand(pattern, field)
    gzipped = {p.endswith(".gz") for p in paths}
    if len(gzipped) > 1:
        raise ConfigError(
            field, "the glob matches gzipped and plain files", "give one kind per glob"
        )
    return paths


def _open(path: str) -> gzip.GzipFile | io.BufferedReader:
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _scan(pattern: str, field: str) -> TsvFiles:
    paths = _expand(pattern, field)
    counts = []
    positives = 0
    for path in paths:
        count = 0
        try:
            with _open(path) as lines:
                for count, raw in enumerate(lines, 1):
                    line = raw.rstrip(b"\n")
                    if line.endswith(b"\r"):  # TextLineDataset drops it too
                        line = line[:-1]
                    if _LINE.fullmatch(line) is None:
                        raise ConfigError(field, _what_is_wrong(line, path, count), FIX)
                    positives += line[0] == ord("1")
        except (OSError, EOFError) as err:  # unreadable, or a broken gzip stream
            raise ConfigError(
                field, f"{path} after line {count}: cannot read it ({err})", "give a readable file"
            ) from None
        if count == 0:
            raise ConfigError(field, f"{path} is empty", "write examples into it, or remove it")
        counts.append(count)
    return TsvFiles(
        pattern=pattern,
        paths=tuple(paths),
        files=tuple(os.path.abspath(p) for p in paths),
        records_per_file=tuple(counts),
        positives=positives,
    )


def _what_is_wrong(line: bytes, path: str, line_no: int) -> str:
    """The problem of a line that does not match, as ``path line N[, column C]: ...``."""
    where = f"{path} line {line_no}"
    if not line.strip():
        return f"{where} is blank"
    cells = line.split(b"\t")
    if len(cells) != NUM_CELLS:
        hint = " (the Criteo challenge's test files have no label column)" * (len(cells) == 39)
        return (
            f"{where}: {len(cells)} tab-separated cells, the Criteo format has {NUM_CELLS} "
            f"(label, I1-I13, C1-C26){hint}"
        )
    for column, cell in zip(COLUMNS, cells, strict=True):
        if column == "label":
            ok = cell in (b"0", b"1")
            want = "0 or 1"
        elif column.startswith("I"):
            ok = not cell or re.fullmatch(_INT, cell) is not None
            too_big = re.fullmatch(rb"-?[0-9]+", cell) is not None
            want = "an integer of at most 18 digits" if too_big else "an integer (or empty)"
        else:
            ok = not cell or re.fullmatch(_HEX, cell) is not None
            want = "a hexadecimal id of up to 16 digits (or empty)"
        if not ok:
            shown = cell.decode("utf-8", errors="replace")
            shown = f"{shown[:40]}..." if len(shown) > 40 else shown
            return f"{where}, column {column}: {shown!r} is not {want}"
    return f"{where}: not a Criteo line"  # unreachable: some cell fails above


# -- datasets ---------------------------------------------------------------------------------


def hash_ids(ids: Any, rows: int) -> Any:
    """Categorical cells (strings ``[batch, 26]``, C1 first) -> table rows ``[0, rows)``
    (``rows=KEY_SPACE``: the keys of a dynamic table)."""
    prefixes = tf.constant([f"C{i}:" for i in range(1, NUM_SPARSE + 1)])
    keys = tf.strings.join([tf.broadcast_to(prefixes, tf.shape(ids)), ids])
    return tf.strings.to_hash_bucket_fast(keys, rows)


def parse_lines(lines: Any, rows: int) -> tuple[Any, Any]:
    """A batch of checked lines -> (x int64 ``[batch, 39]``, label float32 ``[batch, 1]``)."""
    defaults: list[Any] = [tf.constant([], tf.int64)]
    defaults += [tf.constant([0], tf.int64)] * NUM_DENSE
    defaults += [tf.constant([""])] * NUM_SPARSE
    cells = tf.io.decode_csv(lines, defaults, field_delim="\t", use_quote_delim=False)
    dense = tf.stack(cells[1 : 1 + NUM_DENSE], axis=1)
    ids = hash_ids(tf.stack(cells[1 + NUM_DENSE :], axis=1), rows)
    label = tf.cast(cells[0], tf.float32)[:, None]
    return tf.concat([dense, ids], axis=1), label


@tf.autograph.experimental.do_not_convert
def make_dataset(
    info: TsvFiles,
    ctx: DataContext,
    *,
    rows: int,
    training: bool,
    shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER,
) -> tf.data.Dataset:
    """Batches of (x, y) from checked files, this worker's part (``ctx.worker_index``).

    ``training``: shuffled, repeated, full batches only (with ``ctx.one_pass``: one pass,
    the last batch partial). Otherwise every line of this worker's part once, in order.
    With at least as many files as workers, worker i reads files i, i + n, ...; with fewer,
    every worker reads them all and keeps lines i, i + n, ...
    """
    workers = int(ctx.num_workers)
    by_file = workers > 1 and len(info.files) >= workers
    by_record = workers > 1 and not by_file
    files = tf.data.Dataset.from_tensor_slices(tf.constant(list(info.files)))
    if by_file:
        files = files.shard(workers, ctx.worker_index)
    if training and not by_record:
        files = files.shuffle(len(info.files), seed=ctx.seed, reshuffle_each_iteration=True)
    compression = "GZIP" if info.compressed else ""

    def read(path: Any) -> tf.data.Dataset:
        return tf.data.TextLineDataset(path, compression_type=compression)

    if by_record:  # the same line order on every worker, or the shards would overlap
        lines = files.flat_map(read).shard(workers, ctx.worker_index)
    else:
        lines = files.interleave(
            read,
            cycle_length=max(1, min(len(info.files), 8)),
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=not training,
        )
    endless = training and not ctx.one_pass
    if training:
        lines = lines.shuffle(shuffle_buffer, seed=ctx.seed)
    if endless:
        lines = lines.repeat()
    return (
        lines.batch(ctx.batch_size, drop_remainder=endless)
        .map(
            lambda batch: parse_lines(batch, rows),
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=not training,
        )
        .prefetch(tf.data.AUTOTUNE)
    )


# -- writing ----------------------------------------------------------------------------------


def format_line(label: int, dense: Sequence[int | None], ids: Sequence[str | None]) -> str:
    """One line (no newline): ``None`` cells are written empty."""
    if len(dense) != NUM_DENSE or len(ids) != NUM_SPARSE:
        raise ValueError(f"{len(dense)} integers and {len(ids)} ids; the format has 13 and 26")
    cells = [str(int(label))]
    cells += ["" if v is None else str(int(v)) for v in dense]
    cells += ["" if v is None else v for v in ids]
    return "\t".join(cells)
