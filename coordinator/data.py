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

Every file is read in full once on the coordinator before training starts (cached per glob),
so a bad file is a :class:`~cluster.errors.ConfigError` naming the file and the line (or
record): no files, an empty file, a missing label column, headers that differ between files,
a blank line, a row with the wrong number of cells, a cell that is not a finite number as
TensorFlow's CSV reader reads them (ASCII digits; lines end in \\n or \\r\\n; no byte order
mark), a feature beyond float32, a record that does not match the schema, and (when the job
says what it needs) the wrong feature count or a label outside the job's classes. The check
reads about 30 MB of CSV a second on one core. Paths are made absolute there: every worker
must see the files at the same paths (one machine, or a shared file system).

Sharding: :func:`train_dataset` is called per worker with ``ctx.worker_index`` a scalar
tensor. With at least as many files as workers, worker ``i`` reads files ``i, i + n, ...``
of the sorted list (disjoint files, read in parallel); with fewer files, every worker reads
every file and keeps records ``i, i + n, ...`` (disjoint records). :func:`eval_dataset`
reads every record exactly once, in file order, without shuffling or repeating, when called
as evaluation is (worker 0 of 1).
"""

from __future__ import annotations

import glob as globlib
import math
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import tensorflow as tf

from psctl.cluster.errors import ConfigError, echo

if TYPE_CHECKING:
    from psctl.coordinator.job import DataContext

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

CSV_SUFFIXES = (".csv",)
TFRECORD_SUFFIXES = (".tfrecord", ".tfrecords", ".tfr")
DEFAULT_SHUFFLE_BUFFER = 10_000  # examples (CSV lines or serialized records) per worker
# What TensorFlow's CSV reader (tf.data.TextLineDataset, then tf.io.decode_csv) parses, and so
# what the check accepts: lines end in \n or \r\n (TextLineDataset drops every \r, so a lone
# \r would join two lines into one); a cell is an ASCII decimal number with spaces or tabs
# around it, or one in double quotes. float() takes more (other scripts' digits, Unicode
# spaces, nan, infinity, 1_000): every cell is matched against this first. No nested
# quantifiers, so a bad 20 MB cell fails in linear time.
_NUMBER = r"[ \t]*[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?[ \t]*"
_NUMBER_CELL = re.compile(f'{_NUMBER}|"{_NUMBER}"')
_NOT_FINITE = re.compile(r'[ \t"]*[+-]?(?:nan|inf|infinity)[ \t"]*', re.IGNORECASE)
# Features are read as float32; labels as float64, then cast to the job's label dtype
# (float32 unless it says otherwise): past this, either would be infinite.
FLOAT32_MAX = float(np.finfo(np.float32).max)
_PLAIN_ROW = re.compile(r"[0-9eE.+\- \t,]+")  # only characters of unquoted numbers
_BOM = "\ufeff"


@dataclass(frozen=True)
class Extreme:
    """A label value and where it was seen (for error messages)."""

    value: float
    path: str
    line: int


@dataclass(frozen=True)
class DataFiles:
    """A validated glob: what the readers need, and what a job may check."""

    pattern: str
    paths: tuple[str, ...]  # as the glob gave them (for messages), sorted
    files: tuple[str, ...]  # absolute, same order (for TensorFlow, on every worker)
    format: str  # "csv" or "tfrecord"
    label_column: str
    feature_names: tuple[str, ...]  # CSV columns in file order / TFRecord keys, sorted
    feature_lengths: tuple[int, ...]  # values per feature (always 1 for CSV)
    num_records: int
    records_per_file: tuple[int, ...]
    integer_labels: bool  # every label is a whole number
    label_min: Extreme
    label_max: Extreme
    # CSV: every column of the header (label included), in file order.
    columns: tuple[str, ...] = ()
    # TFRecord: each feature's kind ("float" or "int64"), in feature_names order; the label's.
    feature_kinds: tuple[str, ...] = ()
    label_kind: str = ""

    @property
    def num_features(self) -> int:
        return sum(self.feature_lengths)

    def where(self) -> str:
        """Where the feature count comes from, for messages."""
        if self.format == "csv":
            return f"{self.paths[0]} line 1"
        return f"{self.paths[0]} record 1"


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
                found = _scan(pattern, label_column, field)
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


def _format_of(paths: Sequence[str], field: str) -> str:
    formats = set()
    for path in paths:
        lower = path.lower()
        if lower.endswith(CSV_SUFFIXES):
            formats.add("csv")
        elif lower.endswith(TFRECORD_SUFFIXES):
            formats.add("tfrecord")
        else:
            raise ConfigError(
                field,
                f"cannot tell the format of {path} from its name",
                "name CSV files *.csv and TFRecord files *.tfrecord",
            )
    if len(formats) > 1:
        raise ConfigError(
            field, "the glob matches both CSV and TFRecord files", "give one format per glob"
        )
    return formats.pop()


def _scan(pattern: str, label_column: str, field: str) -> DataFiles:
    paths = expand(pattern, field)
    fmt = _format_of(paths, field)
    if fmt == "csv":
        return _scan_csv(pattern, paths, label_column, field)
    return _scan_tfrecord(pattern, paths, label_column, field)


class _Labels:
    """Running label statistics over a scan."""

    def __init__(self) -> None:
        self.integer = True
        self.low: Extreme | None = None
        self.high: Extreme | None = None

    def add(self, value: float, path: str, line: int) -> None:
        if self.integer and not float(value).is_integer():
            self.integer = False
        if self.low is None or value < self.low.value:
            self.low = Extreme(value, path, line)
        if self.high is None or value > self.high.value:
            self.high = Extreme(value, path, line)


def _cell(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] == '"':
        text = text[1:-1].strip()
    return text


def _number(text: str) -> float:
    """float() without digit separators: whether a header cell looks like a number."""
    if "_" in text:
        raise ValueError(text)
    return float(text)


def _row_pattern(width: int) -> re.Pattern[str]:
    """A whole data row of ``width`` number cells."""
    return re.compile(f"(?:{_NUMBER_CELL.pattern})(?:,(?:{_NUMBER_CELL.pattern})){{{width - 1}}}")


def _line_body(line: str, path: str, line_no: int, field: str) -> str:
    """A line without its end (read with newline="", which also splits at a lone \r)."""
    if line.endswith("\n"):
        return line[:-2] if line.endswith("\r\n") else line[:-1]
    if line.endswith("\r"):
        raise ConfigError(
            field,
            f"{path} line {line_no} ends in a lone carriage return (\\r, old Mac line ends)",
            "end lines with \\n or \\r\\n: TensorFlow splits lines at \\n only",
        )
    return line  # the last line, without an end


def _scan_csv(pattern: str, paths: list[str], label_column: str, field: str) -> DataFiles:
    header: list[str] = []
    counts = []
    labels = _Labels()
    for path in paths:
        try:
            with open(path, encoding="utf-8", newline="") as handle:
                header, count = _scan_csv_file(
                    handle, path, header, paths[0], label_column, labels, field
                )
        except OSError as err:
            raise ConfigError(field, f"cannot read {path}: {err.strerror}", "fix it") from None
        counts.append(count)
    assert labels.low is not None and labels.high is not None
    features = tuple(c for c in header if c != label_column)
    return DataFiles(
        pattern=pattern,
        paths=tuple(paths),
        files=tuple(os.path.abspath(p) for p in paths),
        format="csv",
        label_column=label_column,
        feature_names=features,
        feature_lengths=tuple(1 for _ in features),
        num_records=sum(counts),
        records_per_file=tuple(counts),
        integer_labels=labels.integer,
        label_min=labels.low,
        label_max=labels.high,
        columns=tuple(header),
    )


def _scan_csv_file(
    handle: Any,
    path: str,
    header: list[str],
    first_path: str,
    label_column: str,
    labels: _Labels,
    field: str,
) -> tuple[list[str], int]:
    """Check one CSV file against the header of the first (``[]``: this is the first);
    returns the header and the number of examples."""
    line_no = 1
    try:
        first = handle.readline()
        if first.startswith(_BOM):
            raise ConfigError(
                field,
                f"{path} starts with a byte order mark (BOM, U+FEFF)",
                "save it as UTF-8 without a BOM (a spreadsheet's plain CSV, not 'CSV UTF-8')",
            )
        first = _line_body(first, path, 1, field)
        if not first.strip():
            raise ConfigError(
                field,
                f"{path} is empty" if not first else f"{path} line 1 is blank",
                f"start the file with a header row naming each column and {echo(label_column)}",
            )
        names = [_cell(c) for c in first.split(",")]
        if not header:
            header = _check_header(path, names, label_column, field)
        elif names != header:
            raise ConfigError(
                field,
                f"{path} line 1: header {_short(names)} differs from {first_path}'s "
                f"{_short(header)}",
                "give every file the same columns in the same order",
            )
        label_index = header.index(label_column)
        width = len(header)
        row = _row_pattern(width)
        count = 0
        for line_no, line in enumerate(handle, start=2):
            body = _line_body(line, path, line_no, field)
            if not body.strip(" \t"):
                raise ConfigError(
                    field,
                    f"{path} line {line_no} is blank",
                    "remove blank lines (every line after the header is an example)",
                )
            cells = body.split(",")
            if len(cells) == width and _PLAIN_ROW.fullmatch(body):
                # float() reads exactly _NUMBER's numbers from these characters (quick).
                try:
                    values = [float(c) for c in cells]
                except ValueError:
                    _row_error(body, header, path, line_no, field)
            elif row.fullmatch(body):  # quoted cells
                values = [float(c.replace('"', "")) for c in cells]
            else:
                _row_error(body, header, path, line_no, field)
            if max(map(abs, values)) > FLOAT32_MAX:  # inf too; nan cannot match the patterns
                _check_range(values, cells, header, path, line_no, field)
            labels.add(values[label_index], path, line_no)
            count += 1
    except UnicodeDecodeError:
        where = "" if line_no == 1 else f" near line {line_no + 1}"
        raise ConfigError(field, f"{path}{where}: not UTF-8 text", "give CSV text") from None
    if count == 0:
        raise ConfigError(
            field, f"{path} has a header but no data rows", "add examples or remove the file"
        )
    return header, count


def _row_error(body: str, header: list[str], path: str, line_no: int, field: str) -> NoReturn:
    """Raise the ConfigError for a row that is not ``len(header)`` number cells."""
    cells = body.split(",")
    if len(cells) != len(header):
        raise ConfigError(
            field,
            f"{path} line {line_no}: {len(cells)} cells, the header has {len(header)}",
            "give every row one value per column",
        )
    for column, cell in zip(header, cells, strict=True):
        if _NUMBER_CELL.fullmatch(cell):
            continue
        text = cell.strip(" \t")
        if text in ("", '""'):
            what = "an empty cell"
        elif _NOT_FINITE.fullmatch(text):
            what = f"{text} is not a finite number"
        elif not text.isascii():
            what = f"{echo(cell)} is not a number (it holds non-ASCII characters)"
        elif '"' in text:
            what = f"{echo(cell)} is not a number in quotes that open and close the cell"
        else:
            what = f"{echo(cell)} is not a number"
        raise ConfigError(
            field,
            f"{path} line {line_no}, column {echo(column)}: {what}",
            "write a plain number such as 3, -0.25 or 1e-3 in every cell (or remove the row)",
        )
    raise AssertionError(f"{path} line {line_no}: no bad cell in a row that did not match")


def _check_range(
    values: list[float], cells: list[str], header: list[str], path: str, line_no: int, field: str
) -> None:
    """Numbers too large for float32 (a number past float64's range reads as inf: the
    cell is quoted as written, not as ``inf``)."""
    for column, value, cell in zip(header, values, cells, strict=True):
        if abs(value) > FLOAT32_MAX:
            shown = f"{value:g}" if math.isfinite(value) else echo(cell.strip(' \t"'))
            raise ConfigError(
                field,
                f"{path} line {line_no}, column {echo(column)}: {shown} is beyond float32",
                f"give numbers within +-{FLOAT32_MAX:.6g} (they are read as float32)",
            )


def _short(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(name if len(name) <= 40 else echo(name, 40) for name in names[:limit])
    more = f", ... ({len(names)} columns)" if len(names) > limit else ""
    return f"[{shown}{more}]"


def _check_header(path: str, names: list[str], label_column: str, field: str) -> list[str]:
    numeric = 0
    for name in names:
        try:
            _number(name)
            numeric += 1
        except ValueError:
            pass
    if numeric == len(names):
        raise ConfigError(
            field,
            f"{path} line 1 holds numbers, not column names",
            f"start the file with a header row naming each column and {echo(label_column)}",
        )
    if "" in names:
        raise ConfigError(
            field, f"{path} line 1: column {names.index('') + 1} has no name", "name every column"
        )
    seen = set()
    for name in names:
        if name in seen:
            raise ConfigError(field, f"{path} line 1: column {echo(name)} twice", "rename one")
        seen.add(name)
    if label_column not in names:
        raise ConfigError(
            field,
            f"{path} line 1: no label column {echo(label_column)} in {_short(names)}",
            "name the label column in --label-column (default label)",
        )
    if len(names) < 2:
        raise ConfigError(
            field, f"{path} line 1: only the label column", "add at least one feature column"
        )
    return names


def _scan_tfrecord(pattern: str, paths: list[str], label_column: str, field: str) -> DataFiles:
    from google.protobuf.message import DecodeError

    schema: dict[str, tuple[str, int]] | None = None  # name -> (kind, length)
    schema_where = ""
    counts = []
    labels = _Labels()
    for path in paths:
        if os.path.getsize(path) == 0:
            raise ConfigError(
                field, f"{path} is empty", "write tf.train.Example records, or remove the file"
            )
        count = 0
        try:
            for chunk in tf.data.TFRecordDataset(path).batch(4096):
                for serialized in chunk.numpy():
                    count += 1
                    try:
                        example = tf.train.Example.FromString(serialized)
                    except DecodeError:
                        raise ConfigError(
                            field,
                            f"{path} record {count}: not a tf.train.Example",
                            "write tf.train.Example records",
                        ) from None
                    found = _example_schema(example, path, count, field)
                    if schema is None:
                        schema, schema_where = found, f"{path} record 1"
                        _check_schema(schema, path, label_column, field)
                    elif found != schema:
                        raise ConfigError(
                            field,
                            f"{path} record {count}: features {_describe(found)} differ from "
                            f"{schema_where}'s {_describe(schema)}",
                            "give every record the same features, each with a fixed length",
                        )
                    feature = example.features.feature[label_column]
                    kind = feature.WhichOneof("kind")
                    value = float(getattr(feature, kind).value[0])
                    if math.isnan(value) or math.isinf(value):
                        raise ConfigError(
                            field,
                            f"{path} record {count}: label is {value}",
                            "give every example a finite label",
                        )
                    labels.add(value, path, count)
        except tf.errors.OpError as err:
            good = _readable_records(path)  # the batch failed as a whole: find the record
            raise ConfigError(
                field,
                f"{path} after record {good}: not a readable TFRecord file ({_op_message(err)})",
                "write the file with tf.io.TFRecordWriter",
            ) from None
        if count == 0:
            raise ConfigError(field, f"{path} holds no records", "add examples or remove it")
        counts.append(count)
    assert schema is not None and labels.low is not None and labels.high is not None
    features = sorted(name for name in schema if name != label_column)
    return DataFiles(
        pattern=pattern,
        paths=tuple(paths),
        files=tuple(os.path.abspath(p) for p in paths),
        format="tfrecord",
        label_column=label_column,
        feature_names=tuple(features),
        feature_lengths=tuple(schema[n][1] for n in features),
        num_records=sum(counts),
        records_per_file=tuple(counts),
        integer_labels=labels.integer,
        label_min=labels.low,
        label_max=labels.high,
        feature_kinds=tuple(schema[n][0] for n in features),
        label_kind=schema[label_column][0],
    )


def _readable_records(path: str) -> int:
    count = 0
    try:
        for _ in tf.data.TFRecordDataset(path):
            count += 1
    except tf.errors.OpError:
        pass
    return count


def _op_message(err: Any) -> str:
    """TensorFlow's error text without its op and function decorations."""
    text = (err.message or type(err).__name__).strip().splitlines()[0]
    text = re.sub(r"\{\{[^}]*\}\}\s*", "", text)
    return re.sub(r"\s*\[Op:.*$", "", text).strip() or type(err).__name__


def _example_schema(example: Any, path: str, record: int, field: str) -> dict[str, tuple[str, int]]:
    found = {}
    for name, feature in example.features.feature.items():
        kind = feature.WhichOneof("kind")
        if kind == "bytes_list":
            raise ConfigError(
                field,
                f"{path} record {record}: feature {name!r} holds bytes",
                "store model inputs as float or int64 lists",
            )
        values = getattr(feature, kind).value if kind else []
        found[name] = ("float" if kind == "float_list" else "int64", len(values))
    return found


def _check_schema(
    schema: dict[str, tuple[str, int]], path: str, label_column: str, field: str
) -> None:
    if label_column not in schema:
        raise ConfigError(
            field,
            f"{path} record 1: no label feature {label_column!r} in {_describe(schema)}",
            "name the label feature in --label-column (default label)",
        )
    if schema[label_column][1] != 1:
        raise ConfigError(
            field,
            f"{path} record 1: label {label_column!r} has {schema[label_column][1]} values",
            "give each example one label value",
        )
    if len(schema) < 2:
        raise ConfigError(
            field, f"{path} record 1: only the label feature", "add a float feature 'features'"
        )
    for name, (_, length) in schema.items():
        if length == 0:
            raise ConfigError(
                field, f"{path} record 1: feature {name!r} is empty", "give it its values"
            )


def _describe(schema: dict[str, tuple[str, int]]) -> str:
    return "{" + ", ".join(f"{n}: {k}[{length}]" for n, (k, length) in sorted(schema.items())) + "}"


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
    """``ctx.eval_data`` once, in order, batched (x, y) (the last batch may be smaller)."""
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
    """Batches of ``(x, y)``: x float32 ``[batch, num_features]``, y ``[batch]`` of
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
    files = tf.data.Dataset.from_tensor_slices(tf.constant(list(info.files)))
    if by_file:
        files = files.shard(workers, ctx.worker_index)
    if training and not by_record:
        files = files.shuffle(len(info.files), seed=ctx.seed, reshuffle_each_iteration=True)
    read = _read_csv_lines if info.format == "csv" else tf.data.TFRecordDataset
    if by_record:
        # The same order on every worker and in every epoch, or the shards would overlap:
        # one file after the other.
        records = files.flat_map(read).shard(workers, ctx.worker_index)
    else:
        records = files.interleave(
            read,
            cycle_length=max(1, min(len(info.files), 8)),
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=not training,  # evaluation: in file order
        )
    # ctx.one_pass (--epochs): one pass with the last partial batch; psctl repeats it.
    endless = training and not ctx.one_pass
    if training:
        records = records.shuffle(shuffle_buffer, seed=ctx.seed)
    if endless:
        records = records.repeat()
    batches = records.batch(ctx.batch_size, drop_remainder=endless)
    parse = _csv_parser(info, label_dtype) if info.format == "csv" else _tfrecord_parser(info)
    return batches.map(
        lambda batch: _cast_label(parse(batch), label_dtype),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=not training,
    ).prefetch(tf.data.AUTOTUNE)


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

    def parse(serialized: Any) -> tuple[Any, Any]:
        parsed = tf.io.parse_example(serialized, spec)
        parts = [tf.cast(parsed[name], tf.float32) for name in info.feature_names]
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
