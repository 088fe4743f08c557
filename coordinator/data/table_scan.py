"""Checking a CSV or TFRecord glob in full: the format told by the file names, then
coordinator/data/checks.py's CSV check or coordinator/data/tfrecord_check.py's TFRecord
check (which imports TensorFlow, so it is imported only for TFRecord files)."""

from __future__ import annotations

from psctl.coordinator.data.checks import DataFiles, checked_table, csv_format, format_of
from psctl.coordinator.data.files import PIECE_BYTES, expand

__all__ = ["scan_table"]


def scan_table(
    pattern: str,
    *,
    label_column: str = "label",
    field: str = "--data",
    jobs: int | None = None,
    piece_bytes: int = PIECE_BYTES,
) -> DataFiles:
    """Expand ``pattern`` and check every CSV line or TFRecord record of every file.
    ``jobs``: processes (None: one per core when there is enough to read)."""
    paths = expand(pattern, field)
    if format_of(paths, field) == "tfrecord":
        from psctl.coordinator.data.tfrecord_check import tfrecord_format

        table = tfrecord_format(paths, label_column=label_column, field=field)
    else:
        table = csv_format(paths, label_column=label_column, field=field, piece_bytes=piece_bytes)
    return checked_table(table, paths, pattern=pattern, field=field, jobs=jobs)
