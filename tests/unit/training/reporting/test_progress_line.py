"""The progress line: the step, the training metrics, the rate, and each dynamic table's
live rows and evictions (instead of a log line per eviction)."""

from __future__ import annotations

import io

from psctl.coordinator.training.reporting.progress import Progress, format_line


def test_the_line_carries_each_tables_rows_and_evictions():
    tables = {"items": {"rows": 120_500, "admitted": 130_000, "evicted": 9_500, "bytes": 1}}
    line = format_line(300, 1000, 4096.0, {"loss": 0.25}, tables)
    assert line == (
        "train | step:    300/1000 | loss: 0.2500 |    4096 ex/s | "
        "items: 120,500 rows, 9,500 evicted"
    )
    assert format_line(300, 0, 1.0, {}) == "train | step:    300 |       1 ex/s"


def test_a_pipe_gets_one_line_per_report():
    out = io.StringIO()
    progress = Progress(total=10, start=0, stream=out)
    progress.report(5, 10.0, {"loss": 1.0}, {"users": {"rows": 3, "evicted": 0}})
    progress.finish(10, 10.0, {"loss": 0.5})
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("| users: 3 rows, 0 evicted") and len(lines) == 2
