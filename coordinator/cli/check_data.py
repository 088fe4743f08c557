"""`psctl check-data GLOB`: the coordinator's full check of input files as a command of its
own (for data pipelines' CI), every file read in parallel processes
(coordinator/data/checks.py). TensorFlow is imported only for TFRecord files."""

from __future__ import annotations

import argparse
import time
from typing import Any

from psctl.coordinator.cli.numbers import whole_number


def add_check_data_command(sub: Any) -> dict[str, Any]:
    parser = sub.add_parser(
        "check-data",
        help="check input files in full, in parallel (for data pipelines' CI)",
        description="Check every line (or record) of the files a --train-data / --eval-data "
        "glob names, as the coordinator does before training, in parallel processes. A bad "
        "file is one line naming the first bad file, line and column, exit 78; otherwise one "
        "summary line (files, records, bytes, seconds), exit 0.",
    )
    parser.add_argument("glob", help="a glob, a file or a directory, e.g. 'data/train-*.csv'")
    parser.add_argument(
        "--job",
        default="",
        help="ctr: Criteo TSV files (the ctr job's); otherwise told apart by the file names: "
        "*.tsv and *.txt (gzipped or not) Criteo TSV, *.csv CSV, *.tfrecord TFRecord (the "
        "job's own needs, such as mlp's 32 features, are checked when it trains)",
    )
    parser.add_argument(
        "--label-column", default="label", help="CSV / TFRecord label column (default label)"
    )
    parser.add_argument(
        "--jobs",
        type=whole_number,
        default=None,
        metavar="N",
        help="processes reading the files (default: one per core, or none for less than "
        "64 MiB in all)",
    )
    return {"check-data": cmd_check_data}


def cmd_check_data(args: argparse.Namespace) -> int:
    from psctl.coordinator.data import checks, table_scan

    started = time.monotonic()
    if args.job == "ctr" or (not args.job and checks.criteo_named(args.glob, "check-data")):
        tsv = checks.scan_criteo(args.glob, field="check-data", jobs=args.jobs)
        files, records, size = len(tsv.paths), tsv.num_records, tsv.total_bytes
        kind = "Criteo TSV" + (" (gzipped)" if tsv.compressed else "")
        extra = f", {tsv.trimmed:,} with trimmed trailing cells" if tsv.trimmed else ""
    else:
        table = table_scan.scan_table(
            args.glob, label_column=args.label_column, field="check-data", jobs=args.jobs
        )
        files, records, size = len(table.paths), table.num_records, table.total_bytes
        kind = "CSV" if table.format == "csv" else "TFRecord"
        extra = f", {table.num_features} features"
    seconds = time.monotonic() - started
    rate = size / seconds / 1e6 if seconds > 0 else 0.0
    print(
        f"check-data: ok: {files:,} {kind} file(s), {records:,} records{extra}, "
        f"{size / 1e6:,.1f} MB in {seconds:.2f} s ({rate:,.0f} MB/s)"
    )
    return 0
