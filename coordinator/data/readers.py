"""File inputs for jobs: ``--train-data`` / ``--eval-data`` globs of CSV or TFRecord files.

Formats (told apart by the file name; one glob holds one format):

- ``*.csv``: a header row, then one example per line. The label column is named by
  ``--label-column`` (default ``label``) and may be anywhere; every other column is a float
  feature, in file order. Every file of a glob has the same header.
- ``*.tfrecord``, ``*.tfrecords``, ``*.tfr``: ``tf.train.Example`` records. The label is the
  feature named by ``--label-column`` (one int64 or float value). Every other feature is a
  float or int64 list of fixed length (the same in every record); the model input is their
  concatenation in sorted name order, so one float feature ``features`` of length 32, or 32
  scalar features ``f00`` ... ``f31``, both give a vector of 32 floats. The schema is read
  from the first record; :func:`write_tfrecord` writes the first form.

Every file is read in full once on the coordinator before training starts (cached per glob;
coordinator/data/checks.py and coordinator/data/tfrecord_check.py, in parallel processes for
large inputs), so a bad file is a :class:`~cluster.errors.ConfigError` naming the file and
the line (or record): no files, an empty file, a missing label column, headers that differ
between files, a blank line, a row with the wrong number of cells, a cell that is not a
finite number as TensorFlow's CSV reader reads them (ASCII digits; lines end in \\n or
\\r\\n; no byte order mark), a feature beyond float32, a record that does not match the
schema, and (when the job says what it needs) the wrong feature count or a label outside the
job's classes. The check reads about 30 MB of CSV a second per core. Local paths are made
absolute there: every worker must see the files at the same paths (one machine, or a shared
file system); paths with a scheme (``gs://``, ``hdfs://``) are listed and read through
``tf.io.gfile`` (coordinator/data/files.py).

Sharding: :func:`train_dataset` is called per worker with ``ctx.worker_index`` a scalar
tensor. With at least as many files as workers, worker ``i`` reads files ``i, i + n, ...``
of the sorted list (disjoint files, read in parallel); with fewer files, every worker reads
every file and keeps records ``i, i + n, ...`` (disjoint records). :func:`eval_dataset`
reads every record exactly once, in file order, without shuffling or repeating, when called
as evaluation is (worker 0 of 1).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from psctl.cluster.errors import ConfigError
from psctl.coordinator.data.checks import DataFiles
from psctl.coordinator.data.table_scan import scan_table

if TYPE_CHECKING:
    from psctl.coordinator.data.context import DataContext

# What jobs use (``from psctl.job import data``): the readers, the checks, the writers.
__all__ = [
    "DataFiles",
    "check_files",
    "eval_dataset",
    "inspect_files",
    "make_dataset",
    "train_dataset",
    "write_csv",
    "write_tfrecord",
]

DEFAULT_SHUFFLE_BUFFER = 10_000  # examples (CSV lines or serialized records) per worker

# -- finding and checking files ---------------------------------------------------------------

_cache: dict[tuple[str, str], DataFiles] = {}
_cache_lock = threading.Lock()


@tf.autograph.experimental.do_not_convert
def inspect_files(pattern: str, *, label_column: str = "label", field: str = "--data") -> DataFiles:
    """Expand ``pattern`` and check every file in full; the result is cached per glob.

    Raises ConfigError (field = the flag, e.g. ``--train-data``) naming the file and line.
    """
    key = (pattern, label_column)
    with _cache_lock:
        found = _cache.get(key)
        if found is None:
            # Eagerly, also when first called while a per-worker dataset function is traced.
            with tf.init_scope():
                found = scan_table(pattern, label_column=label_column, field=field)
            _cache[key] = found
    return found


def clear_cache() -> None:
    with _cache_lock:
        _cache.clear()


@tf.autograph.experimental.do_not_convert
def check_files(
    pattern: str,
    *,
    label_column: str = "label",
    field: str = "--data",
    num_features: int | None = None,
    num_classes: int | None = None,
    job: str = "the job",
) -> DataFiles:
    """:func:`inspect_files`, then what the job needs: the feature count, and class ids
    ``0 .. num_classes - 1`` (whole numbers) when ``num_classes`` is given."""
    info = inspect_files(pattern, label_column=label_column, field=field)
    if num_features is not None and info.num_features != num_features:
        if info.format == "csv":
            have = f"{info.num_features} feature columns besides {label_column!r}"
        else:
            have = f"{info.num_features} feature values (features {', '.join(info.feature_names)})"
        raise ConfigError(
            field,
            f"{info.where()}: {have}; {job} needs {num_features}",
            f"give {num_features} float features plus the label {label_column!r}",
        )
    if num_classes is not None:
        if not info.integer_labels:
            raise ConfigError(
                field,
                f"{info.pattern}: labels are not whole numbers; {job} needs class ids",
                f"write labels 0-{num_classes - 1}",
            )
        for extreme in (info.label_min, info.label_max):
            if not 0 <= extreme.value < num_classes:
                unit = "line" if info.format == "csv" else "record"
                raise ConfigError(
                    field,
                    f"{extreme.path} {unit} {extreme.line}: label {extreme.value:g} is outside "
                    f"0-{num_classes - 1} ({job} has {num_classes} classes)",
                    f"write labels 0-{num_classes - 1}",
                )
    return info


# -- datasets ---------------------------------------------------------------------------------


@tf.autograph.experimental.do_not_convert
def train_dataset(
    ctx: DataContext,
    *,
    label_dtype: Any = None,
    shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER,
) -> tf.data.Dataset:
    """This worker's part of ``ctx.train_data``: shuffled, repeated, batched (x, y)."""
    return make_dataset(
        ctx.train_data,
        ctx,
        training=True,
        field="--train-data",
        label_dtype=label_dtype,
        shuffle_buffer=shuffle_buffer,
    )


@tf.autograph.experimental.do_not_convert
def eval_dataset(ctx: DataContext, *, label_dtype: Any = None) -> tf.data.Dataset:
    """``ctx.eval_data`` once, in order, batched (x, y) (the last batch may be smaller).
    With ``ctx.train_data`` too, the eval files must have the training files' features in
    the same order: a model reads CSV columns by position, so swapped columns would score
    (or train) the wrong features without any error."""
    if ctx.train_data and ctx.eval_data:
        train = inspect_files(ctx.train_data, label_column=ctx.label_column, field="--train-data")
        held = inspect_files(ctx.eval_data, label_column=ctx.label_column, field="--eval-data")
        if held.feature_names != train.feature_names:
            order = "in file order" if held.format == "csv" else "by name"
            raise ConfigError(
                "--eval-data",
                f"{held.pattern} has the features {', '.join(held.feature_names)} ({order}), "
                f"where --train-data has {', '.join(train.feature_names)}",
                "give the eval files the training files' header, in the same order",
            )
    return make_dataset(
        ctx.eval_data, ctx, training=False, field="--eval-data", label_dtype=label_dtype
    )


@tf.autograph.experimental.do_not_convert
def make_dataset(
    pattern: str,
    ctx: DataContext,
    *,
    training: bool,
    field: str = "--data",
    label_dtype: Any = None,
    shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER,
) -> tf.data.Dataset:
    """Batches of ``(x, y)``: x ``[batch, num_features]``, float32 (int64 for TFRecords of
    int64 features alone), y ``[batch]`` of
    ``label_dtype`` (default float32; int64 for class ids).

    ``training``: shuffle, repeat forever, full batches only (with ``ctx.one_pass``: shuffle,
    every record once). Otherwise every record of this worker's part once, in order.
    """
    info = inspect_files(pattern, label_column=ctx.label_column, field=field)
    label_dtype = tf.float32 if label_dtype is None else tf.as_dtype(label_dtype)
    workers = int(ctx.num_workers)
    by_file = workers > 1 and len(info.files) >= workers
    by_record = workers > 1 and not by_file
    if by_record and info.num_records < workers:
        raise ConfigError(
            field,
            f"{info.num_records} examples in {info.pattern} for {workers} workers",
            "give at least one example per worker",
        )
    read = _read_csv_lines if info.format == "csv" else tf.data.TFRecordDataset
    parse = _csv_parser(info, label_dtype) if info.format == "csv" else _tfrecord_parser(info)
    return read_batches(
        info.files,
        read,
        lambda batch: _cast_label(parse(batch), label_dtype),
        ctx,
        training=training,
        shuffle_buffer=shuffle_buffer,
    )


def read_batches(
    files: Sequence[str],
    read: Callable[[Any], tf.data.Dataset],
    parse: Callable[..., Any],  # a batch; of tuple records: one argument per part
    ctx: DataContext,
    *,
    training: bool,
    shuffle_buffer: int,
) -> tf.data.Dataset:
    """This worker's part of ``files`` (``read(path)``: a file's records), batched and
    parsed (``parse(batch)``); shared by every file format (CSV, TFRecord, Criteo TSV).

    With at least as many files as workers, worker i reads files i, i + n, ... (interleaved);
    with fewer, every worker reads them all, one after the other, and keeps records i, i + n,
    ... ``training``: shuffled, repeated, full batches only (with ``ctx.one_pass``: one pass,
    the last batch partial); otherwise every record of this worker's part once, in order.
    """
    workers = int(ctx.num_workers)
    by_file = workers > 1 and len(files) >= workers
    by_record = workers > 1 and not by_file
    names = tf.data.Dataset.from_tensor_slices(tf.constant(list(files)))
    if by_file:
        names = names.shard(workers, ctx.worker_index)
    if training and not by_record:
        names = names.shuffle(len(files), seed=ctx.seed, reshuffle_each_iteration=True)
    if by_record:
        # The same order on every worker and in every epoch, or the shards would overlap:
        # one file after the other.
        records = names.flat_map(read).shard(workers, ctx.worker_index)
    else:
        records = names.interleave(
            read,
            cycle_length=max(1, min(len(files), 8)),
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=not training,  # evaluation: in file order
        )
    # ctx.one_pass (--epochs): one pass with the last partial batch; psctl repeats it.
    endless = training and not ctx.one_pass
    if training:
        records = records.shuffle(shuffle_buffer, seed=ctx.seed)
    if endless:
        records = records.repeat()
    return (
        records.batch(ctx.batch_size, drop_remainder=endless)
        .map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=not training)
        .prefetch(tf.data.AUTOTUNE)
    )


def _read_csv_lines(filename: Any) -> Any:
    return tf.data.TextLineDataset(filename).skip(1)  # the header; no blank lines (checked)


def _cast_label(xy: tuple[Any, Any], dtype: Any) -> tuple[Any, Any]:
    x, y = xy
    if y.dtype.is_floating and dtype.is_integer:
        y = tf.round(y)
    return x, tf.cast(y, dtype)


def _csv_parser(info: DataFiles, label_dtype: Any) -> Any:
    label_index = info.columns.index(info.label_column)
    feature_indexes = [i for i, name in enumerate(info.columns) if name != info.label_column]
    defaults = [
        tf.constant([], tf.float64 if i == label_index else tf.float32)
        for i in range(len(info.columns))
    ]

    def parse(lines: Any) -> tuple[Any, Any]:
        cells = tf.io.decode_csv(lines, record_defaults=defaults)
        x = tf.stack([cells[i] for i in feature_indexes], axis=1)
        return x, cells[label_index]

    return parse


def _tfrecord_parser(info: DataFiles) -> Any:
    kinds = {"float": tf.float32, "int64": tf.int64}
    spec = {
        name: tf.io.FixedLenFeature([length], kinds[kind])
        for name, length, kind in zip(
            info.feature_names, info.feature_lengths, info.feature_kinds, strict=True
        )
    }
    spec[info.label_column] = tf.io.FixedLenFeature([], kinds[info.label_kind])

    # Ids stay exact: int64 features alone stay int64 (float32 holds integers exactly only
    # up to 2**24); with any float feature, all are float32 (docs/data.md).
    dtype = tf.int64 if set(info.feature_kinds) == {"int64"} else tf.float32

    def parse(serialized: Any) -> tuple[Any, Any]:
        parsed = tf.io.parse_example(serialized, spec)
        parts = [tf.cast(parsed[name], dtype) for name in info.feature_names]
        x = parts[0] if len(parts) == 1 else tf.concat(parts, axis=1)
        return x, parsed[info.label_column]

    return parse


# -- writing files in these formats (tests, benchmarks, converting in-memory data) -------------


def write_csv(
    path: str | os.PathLike[str],
    x: np.ndarray,
    y: np.ndarray,
    *,
    feature_names: Sequence[str] | None = None,
    label_column: str = "label",
) -> None:
    """A header (``f00, f01, ...`` unless named, then the label) and one row per example."""
    x = np.asarray(x)
    y = np.asarray(y)
    names = list(feature_names or [f"f{i:02d}" for i in range(x.shape[1])])
    # Enough digits to read back the same value (float32: 9, float64: 17).
    digits = 9 if x.dtype == np.float32 else 17
    label_fmt = "%d" if np.issubdtype(y.dtype, np.integer) else "%.17g"
    table = np.column_stack([x.astype(np.float64), y.astype(np.float64)])
    np.savetxt(
        path,
        table,
        fmt=[f"%.{digits}g"] * x.shape[1] + [label_fmt],
        delimiter=",",
        header=",".join([*names, label_column]),
        comments="",
    )


def write_tfrecord(
    path: str | os.PathLike[str], x: np.ndarray, y: np.ndarray, *, label_column: str = "label"
) -> None:
    """``tf.train.Example`` records: float list ``features`` and the label (int64 when y holds
    integers, else float)."""
    y = np.asarray(y)
    integer = np.issubdtype(y.dtype, np.integer)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for row, label in zip(np.asarray(x, np.float32), y, strict=True):
            if integer:
                target = tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)]))
            else:
                target = tf.train.Feature(float_list=tf.train.FloatList(value=[float(label)]))
            example = tf.train.Example(
                features=tf.train.Features(
                    feature={
                        "features": tf.train.Feature(float_list=tf.train.FloatList(value=row)),
                        label_column: target,
                    }
                )
            )
            writer.write(example.SerializeToString())
