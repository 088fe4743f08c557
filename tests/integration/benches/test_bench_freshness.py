"""bench/freshness.py end to end in its quick mode: partitions landed while a follow-mode
job trains and publishes, against per-partition restarts on a standing cluster; the
next-partition AUC of both and the last line."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration

BENCH = str(REPO / "bench" / "freshness.py")
LAST = re.compile(
    r"^freshness: p50 (\d+\.\d) s, p95 (\d+\.\d) s \(per-partition restarts: p50 (\d+\.\d) s\); "
    r"next-partition auc (\d\.\d{4}) vs (\d\.\d{4})$"
)


@pytest.mark.timeout(420)
def test_freshness_quick_runs_end_to_end(run_cli, workdir):
    out = workdir / "results"
    # The follow run ends 20 s after its last round, not --quick's 36 (--every + 30): it
    # waits at most --every (6 s) for the next partition, and publishes the last round's
    # version within about 4 s of it here (--quick's export cadence is 2 s).
    argv = [sys.executable, BENCH, "--quick", "--idle-timeout", "20", "--out", str(out)]
    proc = run_cli(argv, timeout=410)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = LAST.fullmatch(proc.stdout.strip().splitlines()[-1])
    assert last, proc.stdout[-2000:]
    p50, p95, restarts = (float(last.group(i)) for i in (1, 2, 3))
    assert 0 < p50 <= p95 and restarts > 0
    report = json.loads((out / "results.json").read_text())
    follow = report["follow"]
    # Each partition in exactly one round, in order, and a version at or after each.
    rounds = json.loads((out / "follow" / "checkpoints" / "follow.json").read_text())["rounds"]
    files = [f for r in rounds for f in r["files"]]
    assert files == sorted(files) and len(files) == len(set(files)) == 2, files
    assert max(follow["versions"]) >= rounds[-1]["step"]
    assert all(0 < a < 1 for a in follow["auc"] + report["restarts"]["auc"])
    assert len(report["restarts"]["freshness_s"]) == 2
