"""The Criteo TSV format, for the built-in ``ctr`` job: checking files and reading them.

One example per line, 40 tab-separated cells, as in the public Criteo click logs (Kaggle
Display Advertising Challenge, Criteo 1TB): the label (0 or 1), 13 integer features
``I1``-``I13`` (counts; may be negative) and 26 categorical features ``C1``-``C26`` as
hexadecimal ids. Any feature cell may be empty. Files may be gzipped (``*.gz``).

Every file is read in full on the coordinator before training (cached per glob;
coordinator/checks.py, in parallel processes for large inputs), so a bad line is one
:class:`~cluster.errors.ConfigError` naming the file, the line and the column. The model
input is one int64 vector of 39 per example: the 13 integers (an empty cell is 0) then the
26 ids hashed into a table of ``rows`` rows: ``to_hash_bucket_fast("C<j>:" + id)``, so equal
ids of different features land on different rows, and an empty cell is one "missing" id per
feature. Sharding over workers is as for CSV files (coordinator/data.py).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from psctl.coordinator.checks import (
    COLUMNS,
    CRITEO_FIX,
    NUM_CELLS,
    NUM_DENSE,
    NUM_SPARSE,
    TsvFiles,
    scan_criteo,
)
from psctl.coordinator.data import read_batches
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

NUM_INPUTS = NUM_DENSE + NUM_SPARSE  # the model input: 13 integers, then 26 table rows
DEFAULT_SHUFFLE_BUFFER = 10_000  # lines per worker
FIX = CRITEO_FIX

_cache: dict[str, TsvFiles] = {}
_cache_lock = threading.Lock()


@tf.autograph.experimental.do_not_convert
def check_files(pattern: str, *, field: str = "--data") -> TsvFiles:
    """Expand ``pattern`` (a glob, a file or a directory) and check every line of every file
    (coordinator/checks.py); cached per glob. Raises ConfigError (``field``: the flag) naming
    the file and line."""
    with _cache_lock:
        found = _cache.get(pattern)
        if found is None:
            found = _cache[pattern] = scan_criteo(pattern, field=field)
    return found


def clear_cache() -> None:
    with _cache_lock:
        _cache.clear()


# -- datasets ---------------------------------------------------------------------------------


def hash_ids(ids: Any, rows: int) -> Any:
    """Categorical cells (strings ``[batch, 26]``, C1 first) -> table rows ``[0, rows)``
    (``rows=KEY_SPACE``: the keys of a dynamic table)."""
    prefixes = tf.constant([f"C{i}:" for i in range(1, NUM_SPARSE + 1)])
    keys = tf.strings.join([tf.broadcast_to(prefixes, tf.shape(ids)), ids])
    return tf.strings.to_hash_bucket_fast(keys, rows)


def parse_lines(lines: Any, rows: int) -> tuple[Any, Any]:
    """A batch of checked lines -> (x int64 ``[batch, 39]``, label float32 ``[batch, 1]``).

    A line of fewer than 40 cells (trailing empty cells trimmed) reads the missing ones as
    empty, as the check accepts it (coordinator/checks.py); more than 40 is an error."""
    split = tf.strings.split(lines, "\t")
    too_many = tf.debugging.assert_less_equal(
        split.row_lengths(),
        tf.constant(NUM_CELLS, tf.int64),
        message=f"a Criteo line of more than {NUM_CELLS} tab-separated cells",
    )
    with tf.control_dependencies([too_many]):
        cells = split.to_tensor(default_value="", shape=[None, NUM_CELLS])
    counts = cells[:, 1 : 1 + NUM_DENSE]
    dense = tf.strings.to_number(tf.where(counts == "", "0", counts), tf.int64)
    ids = hash_ids(cells[:, 1 + NUM_DENSE :], rows)
    label = tf.strings.to_number(cells[:, 0], tf.float32)[:, None]
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
    compression = "GZIP" if info.compressed else ""

    def read(path: Any) -> tf.data.Dataset:
        return tf.data.TextLineDataset(path, compression_type=compression)

    return read_batches(
        info.files,
        read,
        lambda batch: parse_lines(batch, rows),
        ctx,
        training=training,
        shuffle_buffer=shuffle_buffer,
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
