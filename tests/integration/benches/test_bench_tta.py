"""bench/tta.py end to end in its quick mode: cluster, children, table, plot, ratio line."""

from __future__ import annotations

import re
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration


@pytest.mark.timeout(240)
def test_tta_quick_runs_end_to_end(run_cli, workdir):
    results = workdir / "results"
    argv = [sys.executable, str(REPO / "bench" / "tta.py"), "--quick", "--results", str(results)]
    proc = run_cli(argv, timeout=220)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("raw_tf_best/psctl_best tta = "), proc.stdout[-2000:]
    assert float(last.rsplit("=", 1)[1]) > 0
    table = (results / "table.md").read_text()
    assert "| raw@1 |" in table and "| psctl-local |" in table
    png = results / "tta.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "peak RSS (MiB): servers ps:0" in proc.stdout


@pytest.mark.timeout(300)
def test_tta_quick_ctr_races_to_an_eval_auc(run_cli, workdir):
    # A 10k-row table split over 2 ps; the raw loop keeps it whole on one ps.
    results = workdir / "results"
    argv = [sys.executable, str(REPO / "bench" / "tta.py"), "--job", "ctr", "--quick"]
    proc = run_cli([*argv, "--results", str(results)], timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"raw_tf_best/psctl_best tta = \d+\.\d\d", last), proc.stdout[-2000:]
    table = (results / "table.md").read_text()
    assert "| final eval auc |" in table
    assert re.search(r"^\| raw@1 \| 1 \| [\d.]+ \| [\d.]+ \|", table, re.MULTILINE), table
    assert re.search(r"^\| psctl-local \| 50 \| [\d.]+ \| [\d.]+ \|", table, re.MULTILINE), table
    assert "ctr job (10000 table rows), 2 ps + 2 workers, --max-shards 2 for psctl" in table
    assert "target eval auc 0.55" in table
    line = r"^eval auc at step \d+: raw@1 \(best raw\) 0\.\d{4}; psctl-local 0\.\d{4} \([+-]"
    assert re.search(line, table, re.MULTILINE), table
