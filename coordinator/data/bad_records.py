"""Bad records found by the workers, in input files too large to check before training.

An input of more than ``--full-check-mb`` is checked on the coordinator only where that is
cheap and bounded (the first lines of its first files, every file's size:
coordinator/data/checks.py); the workers check every record as they read it. With
``--bad-records fail`` (the default) a bad record ends the job: the reader's assertion
(``assertion failed: [psctl-bad-record] [FIELD] [FORMAT] [PATH] [LINE]``, raised on a
worker) becomes one ConfigError naming the file, the line and what is wrong with it (exit
78, the training process's checkpoints kept: a run with the file fixed, or with
``--bad-records skip``, goes on from them). With ``skip`` the readers drop bad records and
each worker logs them.

Pure Python (no TensorFlow): ``failures.classify`` calls :func:`found_in`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from psctl.cluster.errors import ConfigError
from psctl.coordinator.data.files import open_bytes

__all__ = ["MARKER", "BadRecord", "as_config_error", "found_in"]

MARKER = "psctl-bad-record"

_FOUND = re.compile(
    r"\[" + MARKER + r"\] \[(?P<field>[^\]]*)\] \[(?P<format>\w+)\] \[(?P<path>.*)\] "
    r"\[(?P<line>\d+)\]"
)


@dataclass(frozen=True)
class BadRecord:
    field: str  # --train-data / --eval-data
    format: str  # "criteo"
    path: str
    line: int


def found_in(err: BaseException) -> BadRecord | None:
    """The bad record a reader's assertion names in ``err`` (or in an error it wraps, as
    TensorFlow's ClosureInputError wraps a worker's), if any."""
    seen: set[int] = set()
    current: object = err
    while isinstance(current, BaseException) and id(current) not in seen:
        seen.add(id(current))
        match = _FOUND.search(str(current))
        if match:
            return BadRecord(match["field"], match["format"], match["path"], int(match["line"]))
        current = getattr(current, "original_exception", None) or current.__cause__
    return None


def as_config_error(err: BaseException) -> ConfigError | None:
    """``err`` as the one line an operator acts on, when a reader's assertion raised it:
    the file, the line and what is wrong with it (the line read again here, as the full
    check would have described it)."""
    bad = found_in(err)
    if bad is None:
        return None
    from psctl.coordinator.data import checks

    skip = "or run with --bad-records skip to skip such records"
    try:
        line = _read_line(bad.path, bad.line)
    except (OSError, EOFError) as read_err:
        problem = f"{bad.path} line {bad.line}: a bad record (cannot read it again: {read_err})"
        return ConfigError(bad.field, problem, f"fix it, {skip}")
    problem = checks.describe_bad_criteo_line(line, bad.path, bad.line)
    return ConfigError(bad.field, problem, f"{checks.CRITEO_FIX}, {skip}")


def _read_line(path: str, number: int) -> bytes:
    """Line ``number`` (from 1) of ``path`` (gzipped when it ends in .gz), without its end."""
    import gzip

    with open_bytes(path) as raw:
        handle = gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
        for count, line in enumerate(handle, 1):
            if count == number:
                return line.rstrip(b"\n").rstrip(b"\r")
    raise EOFError(f"it has fewer than {number} lines")
