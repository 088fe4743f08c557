"""bench/dynamic.py end to end in its quick mode: the four runs on fresh clusters (dynamic
with and without eviction, the hashed table at equal memory, the 1M-row table), each ps's
RSS, the collision rate, the table and the two last lines."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration

BENCH = str(REPO / "bench" / "dynamic.py")
GAIN = re.compile(r"^dynamic/hashed eval auc gain at equal memory = [+-]\d\.\d{4}$")
RATE = re.compile(r"^dynamic/fixed steps/s = \d+\.\d\d$")


@pytest.mark.timeout(330)
def test_dynamic_quick_runs_end_to_end(run_cli, workdir):
    out = workdir / "results"
    proc = run_cli([sys.executable, BENCH, "--quick", "--out", str(out)], timeout=320)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert GAIN.fullmatch(lines[-2]) and RATE.fullmatch(lines[-1]), proc.stdout[-2000:]
    assert float(lines[-1].rsplit("=", 1)[1]) > 0
    report = json.loads((out / "results.json").read_text())
    runs = {run["name"]: run for run in report["runs"]}
    assert list(runs) == ["dynamic-ttl", "hashed", "dynamic", "fixed-1M"], list(runs)
    assert all(run["status"] == "ok" and run["steps"] == 100 for run in runs.values()), runs
    for run in runs.values():
        assert 0.5 < run["eval_auc"] < 1 and run["steps_per_sec"] > 0, run
        rss = run["ps_rss_mb"]
        assert len(rss["peak"]) == 2 and all(mb > 100 for mb in rss["peak"]), rss
        assert run["rss_samples"], run
    dynamic = runs["dynamic-ttl"]
    assert dynamic["env"]["CTR_TTL_STEPS"] == "30" and "CTR_TTL_STEPS" not in runs["dynamic"]["env"]
    # The hashed table has the dynamic table's live rows, and hashing them collides.
    assert dynamic["rows"] > 0 and dynamic["tables"]["embedding"]["rows"] == dynamic["rows"]
    assert runs["hashed"]["env"]["CTR_ROWS"] == str(max(dynamic["rows"], 1000))
    assert runs["fixed-1M"]["env"]["CTR_ROWS"] == "1000000"
    collisions = report["collisions"]
    assert collisions["matched"] > 0.9 * collisions["live_ids"], collisions
    assert 0.4 < collisions["collision_rate"] < 0.8, collisions  # 1 - 1/e for as many ids as rows
    assert report["lines"] == lines[-2:]
    assert (out / "table.md").read_text().splitlines()[-2:] == lines[-2:]
