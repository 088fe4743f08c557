"""The Criteo TSV format, for the built-in ``ctr`` job: checking files and reading them.

One example per line, 40 tab-separated cells, as in the public Criteo click logs (Kaggle
Display Advertising Challenge, Criteo 1TB): the label (0 or 1), 13 integer features
``I1``-``I13`` (counts; may be negative) and 26 categorical features ``C1``-``C26`` as
hexadecimal ids. Any feature cell may be empty. Files may be gzipped (``*.gz``).

An input of up to ``--full-check-mb`` (256 MB) is read in full on the coordinator before
training (cached per glob; coordinator/data/checks.py, in parallel processes), so a bad line
is one :class:`~cluster.errors.ConfigError` naming the file, the line and the column. A
larger one is checked there only in its first lines, and the workers check every line as
they read it: a bad one ends the job with the same error (exit 78;
coordinator/data/bad_records.py), or with ``--bad-records skip`` is dropped and logged by
the worker. The model input is one int64 vector of 39 per example: the 13 integers (an empty
cell is 0) then the 26 ids hashed into a table of ``rows`` rows:
``to_hash_bucket_fast("C<j>:" + id)``, so equal ids of different features land on different
rows, and an empty cell is one "missing" id per feature. Sharding over workers is as for CSV
files (coordinator/data/readers.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from psctl.coordinator.data import bad_records
from psctl.coordinator.data.checks import (
    COLUMNS,
    CRITEO_FIX,
    CRITEO_LINE_RE2,
    FULL_CHECK_BYTES,
    NUM_CELLS,
    NUM_DENSE,
    NUM_SPARSE,
    TsvFiles,
    scan_criteo,
)
from psctl.coordinator.data.readers import read_batches
from psctl.coordinator.embeddings.dynamic import KEY_SPACE

if TYPE_CHECKING:
    from psctl.coordinator.data.context import DataContext

log = logging.getLogger(__name__)

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
def check_files(
    pattern: str, *, field: str = "--data", full_below: int = FULL_CHECK_BYTES
) -> TsvFiles:
    """Expand ``pattern`` (a glob, a file or a directory) and check its lines
    (coordinator/data/checks.py): every line of an input up to ``full_below`` bytes (pass
    ``ctx.full_check_bytes``: ``--full-check-mb``), the first lines of a larger one (the
    workers check the rest as they read it, ``make_dataset``); cached per glob. Raises
    ConfigError (``field``: the flag) naming the file and line."""
    with _cache_lock:
        found = _cache.get(pattern)
        if found is None:
            found = scan_criteo(pattern, field=field, full_below=full_below)
            _cache[pattern] = found
            if not found.complete:
                log.info(
                    "%s: %.1f GB in %d file(s), over --full-check-mb: their first lines "
                    "checked; the workers check every line as they read it",
                    field,
                    found.total_bytes / 1e9,
                    len(found.paths),
                )
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
    empty, as the check accepts it (coordinator/data/checks.py); more than 40 is an
    error."""
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

    if info.complete:  # every line was checked before training
        return read_batches(
            info.files,
            read,
            lambda batch: parse_lines(batch, rows),
            ctx,
            training=training,
            shuffle_buffer=shuffle_buffer,
        )

    def read_numbered(path: Any) -> tf.data.Dataset:
        # (file, line number from 1, line): a bad line is named where it is found.
        return read(path).enumerate(start=1).map(lambda number, line: (path, number, line))

    skip = ctx.bad_records == "skip"
    return read_batches(
        info.files,
        read_numbered,
        # tf.data passes a batch of (file, number, line) as three arguments.
        lambda paths, numbers, lines: parse_lines(
            checked_lines(paths, numbers, lines, field=info.field, skip=skip), rows
        ),
        ctx,
        training=training,
        shuffle_buffer=shuffle_buffer,
    )


def checked_lines(paths: Any, numbers: Any, lines: Any, *, field: str, skip: bool) -> Any:
    """The lines of a batch that are Criteo lines (as the full check accepts them). A bad
    one fails the batch with the reader's assertion (coordinator/data/bad_records.py: the
    job ends with one error naming its file and line, exit 78); with ``skip`` bad lines are
    dropped and the worker logs each (its file and line)."""
    good = tf.strings.regex_full_match(lines, CRITEO_LINE_RE2)
    if not skip:
        first = tf.argmin(tf.cast(good, tf.int32))
        named = [bad_records.MARKER, field, "criteo", paths[first], numbers[first]]
        with tf.control_dependencies([tf.debugging.Assert(tf.reduce_all(good), named)]):
            return tf.identity(lines)
    bad = tf.logical_not(good)

    def report() -> Any:
        where = tf.strings.join(
            [tf.boolean_mask(paths, bad), tf.strings.as_string(tf.boolean_mask(numbers, bad))],
            separator=" line ",
        )
        printed = tf.print(
            "psctl: skipped bad Criteo line(s) (--bad-records skip):", where, summarize=-1
        )
        with tf.control_dependencies([printed]):
            return tf.constant(True)

    printed = tf.cond(tf.reduce_any(bad), report, lambda: tf.constant(False))
    with tf.control_dependencies([printed]):
        return tf.boolean_mask(lines, good)


# -- writing ----------------------------------------------------------------------------------


def format_line(label: int, dense: Sequence[int | None], ids: Sequence[str | None]) -> str:
    """One line (no newline): ``None`` cells are written empty."""
    if len(dense) != NUM_DENSE or len(ids) != NUM_SPARSE:
        raise ValueError(f"{len(dense)} integers and {len(ids)} ids; the format has 13 and 26")
    cells = [str(int(label))]
    cells += ["" if v is None else str(int(v)) for v in dense]
    cells += ["" if v is None else v for v in ids]
    return "\t".join(cells)
