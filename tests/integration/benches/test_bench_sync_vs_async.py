"""bench/sync_vs_async.py end to end in its quick mode: three psctl local runs (sync, async,
async local-step), each stopped by the bench, then the table, the plot and the ratio line."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import REPO, processes_mentioning

pytestmark = pytest.mark.integration


@pytest.mark.timeout(420)
def test_sync_vs_async_quick_runs_end_to_end(run_cli, workdir):
    results = workdir / "results"
    argv = [sys.executable, str(REPO / "bench" / "sync_vs_async.py"), "--quick"]
    proc = run_cli([*argv, "--results", str(results)], timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("sync/async_best tta = "), proc.stdout[-2000:]
    assert float(last.rsplit("=", 1)[1]) > 0
    table = (results / "table.md").read_text()
    for mode in ("sync", "async", "async-local"):
        assert f"| {mode} |" in table
    assert (results / "tta.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = json.loads((results / "results.json").read_text())["runs"]
    for run in runs:
        times = [point[0] for point in run["curve"]]
        assert times and times == sorted(times) and times[0] > 0, run["label"]
        assert run["final_accuracy"] >= 0.5, run
        assert run["stopped_at_s"] is not None, "the bench stopped it, not --steps"
    assert processes_mentioning(str(results)) == []
