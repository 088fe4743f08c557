"""bench/scale.py end to end in its quick mode: N = 4 worker tasks hosted in-process (the ps
beside them, the killed worker alone), psctl train driving them to the step count, the table,
the last line's shape, and no process left behind. About a minute on an idle 2-core machine;
the timeout leaves room for a busy one (every host imports TensorFlow)."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.conftest import REPO, processes_mentioning

pytestmark = pytest.mark.integration

BENCH = str(REPO / "bench" / "scale.py")
LAST = re.compile(r"^scale: largest N trained = (\d+), dispatch calls/s at 32 = (\d+|n/a)$")


@pytest.mark.timeout(300)
def test_scale_quick_trains_n_workers(run_cli, workdir):
    out = workdir / "results"
    proc = run_cli([sys.executable, BENCH, "--quick", "--out", str(out)], timeout=290)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    match = LAST.fullmatch(lines[-1])
    assert match, proc.stdout[-2000:]
    assert int(match.group(1)) == 4 and match.group(2) == "n/a", lines[-1]
    (row,) = json.loads((out / "results.json").read_text())
    assert row["workers"] == 4 and row["trained"] and row["steps"] >= 600, row
    assert row["dispatch_calls_per_s"] > 0 and row["steps_per_sec"] > 0, row
    assert row["status_tasks"] == 6 and row["status_serving"] == 6, row  # chief, ps, 4 workers
    assert 0 < row["notice_s"] < 10, row  # the health poll, every 2 s
    assert row["worker_pss_mb_per_task"] > 0 and row["series"] > 0, row
    assert "| 4 " in (out / "table.md").read_text()
    assert processes_mentioning(str(out)) == []
