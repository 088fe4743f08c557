"""bench/elastic.py end to end in its quick mode, on two kinds: a worker added by psctl scale,
then one preempted (SIGTERM) while a `psctl local` job trains, each measured from the job's
own lines, no step redone, the table and the last line."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.conftest import REPO, processes_mentioning

pytestmark = pytest.mark.integration

BENCH = str(REPO / "bench" / "elastic.py")
LAST = re.compile(r"^elastic: median seconds without steps = (\d+\.\d), steps redone = (\d+)$")


@pytest.mark.timeout(330)
def test_elastic_quick_runs_end_to_end(run_cli, workdir):
    out = workdir / "results"
    argv = [sys.executable, BENCH, "--quick", "--kinds", "add-worker,preemption"]
    proc = run_cli([*argv, "--out", str(out)], timeout=320)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    match = LAST.fullmatch(lines[-1])
    assert match, proc.stdout[-2000:]
    assert 0 < float(match.group(1)) < 120 and int(match.group(2)) == 0, lines[-1]
    report = json.loads((out / "results.json").read_text())
    runs = report["runs"]
    assert [(r["kind"], r["from"], r["to"]) for r in runs] == [
        ("add-worker", [1, 2], [1, 3]),
        ("preemption", [1, 3], [1, 2]),
    ], runs
    added, preempted = runs
    # The new process went on from the old one's last step, its resize checkpoint's.
    assert added["restored_step"] == added["checkpoint_step"] == added["old_last_step"], added
    assert added["first_step_after"] > added["restored_step"] >= added["step_at_request"]
    assert added["steps_redone"] == 0 and added["supervisor_seconds"] > 0, added
    # A preempted worker: the same process trains on (nothing restored), no resize pause.
    assert preempted["restored_step"] is None and preempted["steps_redone"] == 0, preempted
    assert preempted["first_step_after"] > preempted["old_last_step"], preempted
    assert preempted["supervisor_seconds"] == 0, preempted
    summary = report["summary"]
    assert len(summary["resizes"]) == 2 and summary["restarts"] == 0, summary
    assert summary["worker_failures"] == 0, summary
    assert summary["num_workers"] == 2 and summary["eval_accuracy"] >= 0.99, summary
    assert report["line"] == lines[-1]
    assert (out / "table.md").read_text().splitlines()[-1] == lines[-1]
    assert processes_mentioning(str(out)) == []
