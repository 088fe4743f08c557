"""bench/soak.py's short seeded soaks: a `psctl local` job through 7 overlapping faults of 6
kinds (worker, ps and training process killed, a worker and a ps frozen, a pause, a
checkpoint) and the operator's stop and restart, every invariant holding at the end; the
same in --epochs mode, and on network-namespace hosts with link cuts (--netns)."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from tests.conftest import REPO, processes_mentioning, require_tool

pytestmark = pytest.mark.integration

BENCH = str(REPO / "bench" / "soak.py")
LAST = re.compile(
    r"^soak: (\d+) faults in (\d+\.\d) min, invariants held = (\d+)/(\d+), "
    r"recovery p95 = (\d+\.\d|nan) s$"
)
VISITS = re.compile(r"times trained: ids \{([^}]*)\}; (\d+) pass\(es\) started")


@pytest.mark.timeout(900)
def test_a_short_seeded_soak_holds_every_invariant(run_cli, workdir):
    out = workdir / "results"
    # Seed 2's schedule over 1.5 min: kill-worker, kill-trainer, freeze worker, kill-ps,
    # pause, freeze ps, checkpoint (printed first; the same on every machine).
    argv = [sys.executable, BENCH, "--minutes", "1.5", "--faults", "7", "--seed", "2"]
    argv += ["--baseline-steps", "2000", "--out", str(out)]
    proc = run_cli(argv, timeout=880)  # 152-164 s here; CI machines run slower
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    match = LAST.fullmatch(lines[-1])
    assert match, proc.stdout[-2000:]
    faults, held, total = int(match[1]), int(match[3]), int(match[4])
    # Six of the job, two of a real Prometheus scraping it (make test installs it).
    assert held == total == 8 and faults >= 5, lines[-1]
    invariants = [line for line in lines if line.startswith("invariant: ")]
    assert len(invariants) == 8 and all(": held (" in line for line in invariants), invariants
    report = json.loads((out / "results.json").read_text())
    kinds = {f["kind"] for f in report["faults"] if f["injected"] and not f["skipped"]}
    assert {"kill-worker", "kill-trainer", "freeze"} <= kinds, kinds
    # Both runs' summaries: the first stopped by the operator, the second at its target.
    first, second = report["summaries"]
    assert second["global_step"] > first["global_step"] > 0
    assert second["restarts"] + first["restarts"] >= 1
    assert processes_mentioning(str(out / "work")) == []


@pytest.mark.timeout(900)
def test_a_short_soak_in_epochs_mode_trains_every_example(run_cli, workdir):
    """``--epochs 1``: the visitation job's second run trains one pass through the faults,
    and every id was trained at least once and at most once per pass started."""
    out = workdir / "results"
    # Seed 3's schedule over 2 min: a worker frozen, then (in the second run) a pause, a
    # worker, the training process and a ps killed, the training process frozen.
    argv = [sys.executable, BENCH, "--epochs", "1", "--minutes", "2", "--faults", "8"]
    argv += ["--seed", "3", "--no-baseline", "--out", str(out)]
    proc = run_cli(argv, timeout=880)  # 177 s here
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    match = LAST.fullmatch(lines[-1])
    assert match, proc.stdout[-2000:]
    # Five of the job (no baseline: no accuracy), the visits, two of Prometheus.
    assert int(match[3]) == int(match[4]) == 8, lines[-1]
    visits = [line for line in lines if line.startswith("invariant: every example trained")]
    assert len(visits) == 1 and ": held (" in visits[0], visits
    # Every id trained at least once and at most once per pass started (a worker killed in
    # the second run's pass earns a make-up pass, so 2 is as right as 1), and no id missing.
    found = VISITS.search(visits[0])
    assert found, visits[0]
    counts = {int(k): int(v) for k, v in re.findall(r"(\d+): (\d+)", found[1])}
    started = int(found[2])
    ids = int(re.search(r"pass\(es\) of (\d+) ids \(VISIT_IDS\)", proc.stdout)[1])
    assert counts and 1 <= min(counts) <= max(counts) <= started, visits[0]
    assert sum(counts.values()) == ids, (ids, visits[0])
    first, second = json.loads((out / "results.json").read_text())["summaries"]
    assert second["global_step"] > first["global_step"] > 0
    assert second["stopped_early"] is False
    assert processes_mentioning(str(out / "work")) == []


@pytest.mark.timeout(900)
def test_a_short_soak_on_network_namespace_hosts_with_link_cuts(run_cli, workdir):
    """``--netns``: every task on a host of its own, the servers restarted as systemd does,
    psctl train as the coordinator, links cut; the ps and worker failures that only its
    training processes' health checks see are counted across its restarts."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    require_tool("ip", "tools/ensure-systemd-tools.sh (iproute2)")
    out = workdir / "results"
    # Seed 11's schedule over 1.5 min: a ps killed, then the links of a worker, the other
    # ps and the coordinator cut while it recovers; after the operator's stop and restart,
    # a worker and the training process frozen.
    argv = [sys.executable, BENCH, "--netns", "--minutes", "1.5", "--faults", "7"]
    argv += ["--seed", "11", "--no-baseline", "--out", str(out)]
    proc = run_cli(argv, timeout=880)  # 110 s here
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    match = LAST.fullmatch(lines[-1])
    assert match, proc.stdout[-2000:]
    # Five of the job (no baseline: no accuracy), two of Prometheus on the coordinator's host.
    assert int(match[3]) == int(match[4]) == 7, lines[-1]
    report = json.loads((out / "results.json").read_text())
    done = [f for f in report["faults"] if f["injected"] and not f["skipped"]]
    cuts = {f["victim"] for f in done if f["kind"] == "cut-link"}
    assert len(cuts) == 3 and "link of chief" in cuts, cuts
    first, second = report["summaries"]
    assert first["ps_failures"] >= 1 and second["global_step"] > first["global_step"] > 0
    assert processes_mentioning(str(out / "work")) == []
