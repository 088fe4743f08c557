"""bench/embeddings.py end to end in its quick mode: fresh clusters, both children, per-ps
peak RSS, the table and the ratio line; and a run cut short by its --max-seconds budget."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration

BENCH = str(REPO / "bench" / "embeddings.py")
RATIO = re.compile(r"^psctl/raw_keras steps/s at 10k rows \(adam\) = (\d+\.\d\d|n/a \(.*\))$")


def _runs(results):
    report = json.loads((results / "results.json").read_text())
    return {run["mode"]: run for run in report["runs"]}


@pytest.mark.timeout(150)
def test_embeddings_quick_runs_end_to_end(run_cli, workdir):
    results = workdir / "results"
    proc = run_cli([sys.executable, BENCH, "--quick", "--results", str(results)], timeout=140)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert re.fullmatch(r"psctl/raw_keras steps/s at 10k rows \(adam\) = \d+\.\d\d", lines[-1]), (
        proc.stdout[-2000:]
    )
    assert float(lines[-1].rsplit("=", 1)[1]) > 0
    assert lines[-2] == "(1M rows with adam was not run: the ratio below is at 10k rows with adam)"
    assert "| network | rows | optimizer | psctl steps/s | raw steps/s | tf_keras steps/s |" in (
        proc.stdout
    )
    row = next(line for line in lines if line.startswith("| loopback | 10k | adam |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert len(cells) == 14, row
    assert float(cells[3]) > 0 and float(cells[4]) > 0, row  # both ran every step: no "*"
    assert cells[5] == cells[6] == "-", row  # tf_keras and local: not run by --quick
    assert re.fullmatch(r"\d+\.\d\dx", cells[7]), row
    assert cells[10] == "-, -, -", row  # round trips need a run at 0 ms and one above
    for peak in (cells[11], cells[12]):  # ps0/ps1 (growth/growth)
        assert re.fullmatch(r"\d+/\d+ \([+-]\d+/[+-]\d+\)", peak), row
    assert cells[13] == "1.0", row  # 10k x 16 x 4 bytes x (1 + 2 Adam slots) / 2 ps, in MB
    assert (results / "table.md").read_text().splitlines()[-1] == lines[-1]
    runs = _runs(results)
    assert runs["psctl"]["status"] == runs["raw"]["status"] == "ok", runs
    assert runs["psctl"]["steps"] == runs["raw"]["steps"] == 100
    # psctl split the table over the 2 ps; the raw loop kept it whole.
    assert [t["shards"] for t in runs["psctl"]["tables"]] == [2]
    assert [t["shards"] for t in runs["raw"]["tables"]] == [1]
    for run in runs.values():
        assert len(run["ps_peak_mb"]) == 2 and all(mb > 100 for mb in run["ps_peak_mb"]), run


@pytest.mark.timeout(150)
def test_embeddings_budget_cuts_runs_short(run_cli, workdir):
    """Far more steps than the budget allows: psctl is stopped through its hooks, the raw
    child reads its steps off the ps and exits without joining; neither hangs."""
    results = workdir / "results"
    argv = [BENCH, "--quick", "--steps", "5000", "--max-seconds", "3", "--results", str(results)]
    proc = run_cli([sys.executable, *argv], timeout=140)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert RATIO.fullmatch(last), proc.stdout[-2000:]
    runs = _runs(results)
    # psctl always finishes its calls in flight: some steps, fewer than asked.
    assert runs["psctl"]["status"] == "budget", runs["psctl"]
    assert 0 < runs["psctl"]["steps"] < 5000
    # The raw loop: steps read at the budget, or none done by then on a busy machine.
    assert runs["raw"]["status"] in ("budget", "too slow"), runs["raw"]
    assert runs["raw"]["wall_s"] < 60, runs["raw"]
    if runs["raw"]["status"] == "budget":
        assert 0 < runs["raw"]["steps"] < 5000
        rows = [line for line in proc.stdout.splitlines() if line.startswith("| loopback | 10k")]
        assert "*" in rows[0]


@pytest.mark.timeout(200)
def test_embeddings_quick_through_the_relay(run_cli, workdir):
    """--rtt 0: both clusters as namespace hosts behind the relay (bench/harness/netlab.py); the
    coordinator runs on its own host, the ps RSS is read from the servers there."""
    results = workdir / "results"
    argv = [BENCH, "--quick", "--rtt", "0", "--results", str(results)]
    proc = run_cli([sys.executable, *argv], timeout=190)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"psctl/raw_keras steps/s at 10k rows \(adam, rtt 0 ms\) = \d+\.\d\d", last)
    runs = _runs(results)
    assert {run["rtt"] for run in runs.values()} == {"0 ms"}
    assert runs["psctl"]["steps"] == runs["raw"]["steps"] == 100, runs
    for run in runs.values():
        assert len(run["ps_peak_mb"]) == 2 and all(mb > 100 for mb in run["ps_peak_mb"]), run
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "psrtt" not in names  # every namespace deleted


@pytest.mark.timeout(200)
def test_embeddings_quick_with_tf_ports_open_and_in_a_namespace(run_cli, workdir):
    """--tf-ports-overhead: psctl (only) on a cluster with its TF ports open, then on one
    in a job namespace; the last line compares the two."""
    results = workdir / "results"
    argv = [BENCH, "--quick", "--modes", "psctl", "--tf-ports-overhead", "--results", str(results)]
    proc = run_cli([sys.executable, *argv], timeout=190)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(
        r"psctl steps/s, TF ports in a job namespace/open at 10k rows \(adam\) = \d+\.\d\d "
        r"\(\d+\.\d / \d+\.\d\)",
        last,
    ), last
    report = json.loads((results / "results.json").read_text())
    networks = {run["rtt"]: run for run in report["runs"]}
    assert set(networks) == {"loopback", "job namespace"}
    assert all(run["steps"] == 100 for run in networks.values()), networks
