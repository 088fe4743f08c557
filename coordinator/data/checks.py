"""Checking input files in full: CSV and TFRecord (coordinator/data/readers.py's formats)
and Criteo TSV (coordinator/data/criteo.py's), the coordinator's check before training and
``psctl check-data``'s.

A bad file is one :class:`~cluster.errors.ConfigError` naming the first bad file and its
line (or record) in the glob's sorted order. Files are checked in pieces (plain text cut at
line starts, see coordinator/data/files.py), in parallel processes when there is enough to
read; a piece counts its lines from 1, and the first bad piece after a file's start is
checked again here with its true first line, so the error names the line in the file. Only
the TFRecord check imports TensorFlow (coordinator/data/readers.py reads the records).
"""

from __future__ import annotations

import functools
import gzip
import io
import itertools
import logging
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from psctl.cluster.errors import ConfigError, echo
from psctl.coordinator.data.files import (
    PIECE_BYTES,
    Piece,
    absolute,
    cut,
    default_jobs,
    expand,
    in_order,
    open_bytes,
    read_piece,
    size_of,
)

log = logging.getLogger(__name__)

__all__ = [
    "COLUMNS",
    "DataFiles",
    "Extreme",
    "TableFormat",
    "TsvFiles",
    "checked_table",
    "csv_format",
    "describe_bad_criteo_line",
    "scan_criteo",
]


CSV_SUFFIXES = (".csv",)
CRITEO_SUFFIXES = (".tsv", ".txt", ".tsv.gz", ".txt.gz")  # Criteo's own: train.txt
TFRECORD_SUFFIXES = (".tfrecord", ".tfrecords", ".tfr")
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
FLOAT32_MAX = 3.4028234663852886e38  # float(numpy.finfo(numpy.float32).max)
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
    total_bytes: int = 0  # of every file

    @property
    def num_features(self) -> int:
        return sum(self.feature_lengths)

    def where(self) -> str:
        """Where the feature count comes from, for messages."""
        if self.format == "csv":
            return f"{self.paths[0]} line 1"
        return f"{self.paths[0]} record 1"


def criteo_named(pattern: str, field: str) -> bool:
    """Whether the files ``pattern`` names are all called as Criteo TSV files are
    (``*.tsv``, ``*.txt``, gzipped or not)."""
    return all(path.lower().endswith(CRITEO_SUFFIXES) for path in expand(pattern, field))


def format_of(paths: Sequence[str], field: str) -> str:
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
                "name CSV files *.csv and TFRecord files *.tfrecord (Criteo TSV: *.tsv, "
                "*.txt, or the ctr job)",
            )
    if len(formats) > 1:
        raise ConfigError(
            field, "the glob matches both CSV and TFRecord files", "give one format per glob"
        )
    return formats.pop()


class Labels:
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

    def merge(self, later: Labels) -> None:
        """Add the statistics of a later part of the scan."""
        self.integer = self.integer and later.integer
        if later.low is not None and (self.low is None or later.low.value < self.low.value):
            self.low = later.low
        if later.high is not None and (self.high is None or later.high.value > self.high.value):
            self.high = later.high


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


# -- what a check of one piece found -----------------------------------------------------------


@dataclass
class Checked:
    """What checking one piece found (sent back from a checking process)."""

    lines: int = 0  # lines read (CSV: the header too), or records
    records: int = 0
    positives: int = 0  # Criteo: lines with label 1
    trimmed: int = 0  # Criteo: lines with fewer than 40 cells
    first_trimmed: int = 0  # the first one's line, counted from the piece's start
    labels: Labels | None = None  # CSV, TFRecord
    error: tuple[str, str, str] | None = None  # a ConfigError's field, problem and fix


def _check_pieces(
    check: Callable[..., Checked],
    pieces: Sequence[Piece],
    *,
    jobs: int | None,
    total_bytes: int,
    empty: Callable[[str], ConfigError],
) -> tuple[list[int], list[Checked], str]:
    """Check every piece (in parallel when worth it); raise the first error in file order.
    Returns the records per file, every piece's findings, and where the first trimmed
    Criteo line is (``path line N``, or "")."""
    records_per_file: list[int] = []
    results: list[Checked] = []
    first_trimmed = ""
    before = records = 0  # this file's lines and records in its earlier pieces
    checked = in_order(
        check,
        pieces,
        jobs=default_jobs() if jobs is None else jobs,
        total_bytes=total_bytes if jobs is None else -1,
    )
    try:
        for piece, found in zip(pieces, checked, strict=False):
            if found.error is not None:
                if piece.start > 0:  # its lines were counted from 1: check it again here
                    again = check(piece, first_line=before + 1)
                    found = again if again.error is not None else found
                assert found.error is not None
                raise ConfigError(*found.error)
            if found.trimmed and not first_trimmed:
                first_trimmed = f"{piece.path} line {before + found.first_trimmed}"
            before += found.lines
            records += found.records
            results.append(found)
            if piece.last:
                if records == 0:
                    raise empty(piece.path)
                records_per_file.append(records)
                before = records = 0
    finally:
        checked.close()
    return records_per_file, results, first_trimmed


# -- Criteo TSV --------------------------------------------------------------------------------

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_CELLS = 1 + NUM_DENSE + NUM_SPARSE
COLUMNS = ("label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27)))
CRITEO_FIX = (
    "write the label (0 or 1), 13 integers and 26 hexadecimal ids, tab-separated (or remove it)"
)

_INT = rb"-?[0-9]{1,18}"  # at most 18 digits: always fits int64
_HEX = rb"[0-9a-fA-F]{1,16}"
_LINE = re.compile(rb"[01]" + (rb"\t(?:" + _INT + rb")?") * 13 + (rb"\t(?:" + _HEX + rb")?") * 26)
# The same lines but a lone "-" integer cell (found apart: "\t-\t", as I13 is never last),
# with bounded classes instead of optional groups: about twice as fast with Python's re
# (measured: 124-133 MB of lines per CPU second against 59-77; 3.11's possessive quantifiers
# would do as well, but psctl runs on 3.10).
_QUICK_LINE = re.compile(rb"[01]" + rb"\t-?[0-9]{0,18}" * 13 + rb"\t[0-9a-fA-F]{0,16}" * 26)
_LONE_MINUS = b"\t-\t"
# The lines _QUICK_LINE and _trimmed accept, as one RE2 pattern for the workers' readers
# (tf.strings.regex_full_match): the label, then up to 13 integers (none a lone "-"), then,
# only after all 13, up to 26 ids (fewer cells: trailing empty cells trimmed).
_RE2_INT = r"(?:\t(?:-?[0-9]{1,18})?)"
CRITEO_LINE_RE2 = (
    r"[01](?:" + _RE2_INT + r"{13}(?:\t[0-9a-fA-F]{0,16}){0,26}|" + _RE2_INT + r"{0,12})"
)
# Inputs larger than this are not read before training (psctl local/train --full-check-mb);
# of those, the coordinator checks the first HEAD_BYTES of each of the first HEAD_FILES
# files (gzipped: the first HEAD_LINES lines).
FULL_CHECK_BYTES = 256 << 20
HEAD_FILES = 16
HEAD_BYTES = 1 << 20
HEAD_LINES = 4096


@dataclass(frozen=True)
class TsvFiles:
    """A checked glob of Criteo TSV files."""

    pattern: str
    paths: tuple[str, ...]  # as the glob gave them (for messages), sorted
    files: tuple[str, ...]  # absolute, same order (for TensorFlow, on every worker)
    records_per_file: tuple[int, ...]
    positives: int  # lines with label 1
    # Lines with fewer than 40 cells: trailing empty cells trimmed, read as empty.
    trimmed: int = 0
    total_bytes: int = 0
    # False: too large to read before training (over FULL_CHECK_BYTES): only the first lines
    # of the first files were checked (records_per_file and positives count those), and the
    # readers check every line on the workers (coordinator/data/bad_records.py).
    complete: bool = True
    field: str = "--data"  # the flag that named the files, for the workers' errors

    @property
    def num_records(self) -> int:
        """Every line (with ``complete``; otherwise the lines checked)."""
        return sum(self.records_per_file)

    @property
    def compressed(self) -> bool:
        return self.files[0].endswith(".gz")


def scan_criteo(
    pattern: str,
    *,
    field: str,
    jobs: int | None = None,
    piece_bytes: int = PIECE_BYTES,
    full_below: int | None = None,
) -> TsvFiles:
    """Expand ``pattern`` (a glob, a file or a directory) and check every line of every
    file. ``jobs``: processes (None: one per core when there is enough to read).
    ``full_below``: bytes; a larger input (gzipped: its compressed bytes) is checked only
    in its first lines (HEAD_BYTES of each of its first HEAD_FILES files), and the readers
    check the rest on the workers (``complete=False``). None: every line, however large."""
    paths = expand(pattern, field)
    if len({p.endswith(".gz") for p in paths}) > 1:
        raise ConfigError(
            field, "the glob matches gzipped and plain files", "give one kind per glob"
        )
    gzipped = paths[0].endswith(".gz")
    sizes = [size_of(path) for path in paths]
    complete = full_below is None or sum(sizes) <= full_below
    if complete:
        pieces, total = cut(paths, splittable=not gzipped, piece_bytes=piece_bytes, sizes=sizes)
    else:
        pieces, total = _heads(paths, sizes, gzipped=gzipped), sum(sizes)
    records, results, first_trimmed = _check_pieces(
        functools.partial(check_criteo_piece, field=field, max_lines=0 if complete else HEAD_LINES),
        pieces,
        jobs=jobs,
        total_bytes=total,
        empty=lambda path: ConfigError(
            field, f"{path} is empty", "write examples into it, or remove it"
        ),
    )
    trimmed = sum(found.trimmed for found in results)
    if trimmed:
        log.warning(
            "%s: %d line(s) with fewer than %d cells (the first: %s): their missing trailing "
            "cells read as empty",
            field,
            trimmed,
            NUM_CELLS,
            first_trimmed,
        )
    return TsvFiles(
        pattern=pattern,
        paths=tuple(paths),
        files=tuple(absolute(p) for p in paths),
        records_per_file=tuple(records),
        positives=sum(found.positives for found in results),
        trimmed=trimmed,
        total_bytes=total,
        complete=complete,
        field=field,
    )


def _heads(paths: Sequence[str], sizes: Sequence[int], *, gzipped: bool) -> list[Piece]:
    """The first lines of the first HEAD_FILES files: plain files to the line that crosses
    HEAD_BYTES, gzipped ones (read from their start) to HEAD_LINES lines."""
    pieces = []
    for index, (path, size) in enumerate(zip(paths[:HEAD_FILES], sizes, strict=False)):
        if gzipped or size <= HEAD_BYTES:
            pieces.append(Piece(path, index))
            continue
        with open_bytes(path) as handle:
            handle.seek(HEAD_BYTES - 1)
            handle.readline()
            end = handle.tell()
        pieces.append(Piece(path, index, 0, end, last=True))
    return pieces


def check_criteo_piece(
    piece: Piece, *, field: str, first_line: int = 1, max_lines: int = 0
) -> Checked:
    """Check the lines of one piece (a gzipped file is one piece: its first ``max_lines``
    lines when that is not 0), counting from ``first_line``."""
    found = Checked()
    try:
        if piece.path.endswith(".gz"):
            with open_bytes(piece.path) as raw, gzip.GzipFile(fileobj=raw) as unzipped:
                unzipped_lines: Iterable[bytes] = (line.rstrip(b"\n") for line in unzipped)
                if max_lines:
                    unzipped_lines = itertools.islice(unzipped_lines, max_lines)
                _criteo_lines(unzipped_lines, piece.path, first_line, field, found)
        else:
            data = read_piece(piece)
            lines = data.split(b"\n")
            if lines[-1] == b"":  # after the last line's end (or an empty piece)
                lines.pop()
            if b"\r" in data:  # TextLineDataset drops a \r before \n too
                lines = [line[:-1] if line.endswith(b"\r") else line for line in lines]
            if all(map(_QUICK_LINE.fullmatch, lines)) and _LONE_MINUS not in data:  # the quick way
                found.lines = found.records = len(lines)
                found.positives = data.count(b"\n1") + data.startswith(b"1")
            else:
                _criteo_lines(lines, piece.path, first_line, field, found)
    except ConfigError as err:
        found.error = (err.field, err.problem, err.fix)
    except (OSError, EOFError) as err:  # unreadable, or a broken gzip stream
        found.error = (
            field,
            f"{piece.path} after line {first_line - 1 + found.lines}: cannot read it ({err})",
            "give a readable file",
        )
    return found


def _criteo_lines(
    lines: Iterable[bytes], path: str, first_line: int, field: str, found: Checked
) -> None:
    match = _QUICK_LINE.fullmatch
    count = positives = trimmed = 0
    try:
        for count, raw in enumerate(lines, 1):
            line = raw[:-1] if raw.endswith(b"\r") else raw
            if match(line) is None or _LONE_MINUS in line:
                if not _trimmed(line):
                    where = first_line + count - 1
                    raise ConfigError(
                        field, describe_bad_criteo_line(line, path, where), CRITEO_FIX
                    )
                trimmed += 1
                if trimmed == 1:
                    found.first_trimmed = count
            positives += line.startswith(b"1")
    finally:
        found.lines = found.records = count
        found.positives = positives
        found.trimmed = trimmed


def _trimmed(line: bytes) -> bool:
    """Whether a line that does not match is a good one whose trailing empty cells were
    trimmed (fewer than 40 cells, as some copies of the Kaggle file have): readers built on
    pandas read the missing cells as empty, and so does psctl (criteo.parse_lines)."""
    tabs = line.count(b"\t")
    if tabs >= NUM_CELLS - 1:
        return False
    return _LINE.fullmatch(line + b"\t" * (NUM_CELLS - 1 - tabs)) is not None


def describe_bad_criteo_line(line: bytes, path: str, line_no: int) -> str:
    """The problem of a line that does not match, as ``path line N[, column C]: ...``."""
    where = f"{path} line {line_no}"
    if not line.strip():
        return f"{where} is blank"
    cells = line.split(b"\t")
    if len(cells) > NUM_CELLS:
        return (
            f"{where}: {len(cells)} tab-separated cells, the Criteo format has {NUM_CELLS} "
            f"(label, I1-I13, C1-C26)"
        )
    note = ""
    if len(cells) < NUM_CELLS:  # its trailing cells read as empty, so some other cell is bad
        hint = "; the Criteo challenge's test files have no label column" * (len(cells) == 39)
        note = f" (in a line of {len(cells)} tab-separated cells of {NUM_CELLS}{hint})"
        cells += [b""] * (NUM_CELLS - len(cells))
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
            return f"{where}, column {column}: {shown!r} is not {want}{note}"
    return f"{where}: not a Criteo line"  # unreachable: some cell fails above


# -- CSV and TFRecord --------------------------------------------------------------------------


@dataclass(frozen=True)
class TableFormat:
    """What checks the files of one table format (CSV, TFRecord): the check of one piece,
    the pieces (``cut``'s, and their bytes), what a file without a record is (and the fix),
    and the format's own DataFiles fields."""

    check: Callable[..., Checked]
    pieces: tuple[Sequence[Piece], int]
    empty: tuple[str, str]
    fields: dict[str, Any]


def csv_format(
    paths: Sequence[str], *, label_column: str, field: str, piece_bytes: int = PIECE_BYTES
) -> TableFormat:
    """CSV files (``paths``): every line checked against the first file's header."""
    header = _first_header(paths[0], label_column, field)
    features = tuple(c for c in header if c != label_column)
    check = functools.partial(
        check_csv_piece,
        header=tuple(header),
        first_path=paths[0],
        label_column=label_column,
        field=field,
    )
    return TableFormat(
        check,
        cut(paths, splittable=True, piece_bytes=piece_bytes),
        ("has a header but no data rows", "add examples or remove the file"),
        {
            "format": "csv",
            "label_column": label_column,
            "feature_names": features,
            "feature_lengths": tuple(1 for _ in features),
            "columns": tuple(header),
        },
    )


def checked_table(
    table: TableFormat, paths: Sequence[str], *, pattern: str, field: str, jobs: int | None
) -> DataFiles:
    """Check the pieces of a CSV or TFRecord glob (``pattern``: its ``paths``) with
    ``table.check``, in parallel when worth it (``jobs``: processes, None: one per core when
    there is enough to read; the first error in file order raised), and describe it."""
    problem, fix = table.empty
    pieces, total_bytes = table.pieces
    records, results, _ = _check_pieces(
        table.check,
        pieces,
        jobs=jobs,
        total_bytes=total_bytes,
        empty=lambda path: ConfigError(field, f"{path} {problem}", fix),
    )
    labels = _merged_labels(results)
    assert labels.low is not None and labels.high is not None
    return DataFiles(
        pattern=pattern,
        paths=tuple(paths),
        files=tuple(absolute(p) for p in paths),
        num_records=sum(records),
        records_per_file=tuple(records),
        integer_labels=labels.integer,
        label_min=labels.low,
        label_max=labels.high,
        total_bytes=total_bytes,
        **table.fields,
    )


def _merged_labels(results: Sequence[Checked]) -> Labels:
    labels = Labels()
    for found in results:
        assert found.labels is not None
        labels.merge(found.labels)
    assert labels.low is not None and labels.high is not None
    return labels


def _first_header(path: str, label_column: str, field: str) -> list[str]:
    """The first file's header, checked: every file must have it."""
    try:
        with open_bytes(path) as raw, io.TextIOWrapper(raw, encoding="utf-8", newline="") as text:
            first = text.readline()
    except UnicodeDecodeError:
        raise ConfigError(field, f"{path}: not UTF-8 text", "give CSV text") from None
    except OSError as err:
        raise ConfigError(field, f"cannot read {path}: {err.strerror}", "fix it") from None
    return _check_header(path, _header_names(first, path, label_column, field), label_column, field)


def _header_names(first: str, path: str, label_column: str, field: str) -> list[str]:
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
    return [_cell(c) for c in first.split(",")]


def check_csv_piece(
    piece: Piece,
    *,
    header: tuple[str, ...],
    first_path: str,
    label_column: str,
    field: str,
    first_line: int = 1,
) -> Checked:
    """Check one piece of a CSV file against the first file's header, counting lines from
    ``first_line``; the file's first piece starts with its header."""
    found = Checked(labels=Labels())
    assert found.labels is not None
    try:
        text = io.TextIOWrapper(io.BytesIO(read_piece(piece)), encoding="utf-8", newline="")
        line_no = first_line
        if piece.start == 0:
            try:
                first = text.readline()
            except UnicodeDecodeError:
                raise ConfigError(field, f"{piece.path}: not UTF-8 text", "give CSV text") from None
            names = _header_names(first, piece.path, label_column, field)
            if tuple(names) != header:
                raise ConfigError(
                    field,
                    f"{piece.path} line 1: header {_short(names)} differs from {first_path}'s "
                    f"{_short(list(header))}",
                    "give every file the same columns in the same order",
                )
            found.lines = 1
            line_no += 1
        count = _csv_rows(
            text, piece.path, line_no, list(header), label_column, found.labels, field
        )
        found.lines += count
        found.records = count
    except ConfigError as err:
        found.error = (err.field, err.problem, err.fix)
    except OSError as err:
        found.error = (field, f"cannot read {piece.path}: {err.strerror}", "fix it")
    return found


def _csv_rows(
    handle: Any,
    path: str,
    first_line: int,
    header: list[str],
    label_column: str,
    labels: Labels,
    field: str,
) -> int:
    """Check the data rows from ``handle`` (the first is line ``first_line``); returns how
    many there are."""
    label_index = header.index(label_column)
    width = len(header)
    row = _row_pattern(width)
    count = 0
    line_no = first_line - 1
    try:
        for line_no, line in enumerate(handle, start=first_line):
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
        where = "" if line_no <= 1 else f" near line {line_no + 1}"
        raise ConfigError(field, f"{path}{where}: not UTF-8 text", "give CSV text") from None
    return count
