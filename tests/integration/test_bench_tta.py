"""bench/tta.py end to end in its quick mode: cluster, children, table, plot, ratio line."""

from __future__ import annotations

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
