"""bench/capacity.py end to end at small sizes: the two fixed-table runs side by side (peak
RSS of the coordinator and each ps, every checkpoint's seconds and what each ps wrote), the
dynamic table's bytes per key, the estimate, and the last line."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration

BENCH = str(REPO / "bench" / "capacity.py")
LAST = re.compile(
    r"^capacity: coordinator peak \d+\.\d\d GB at 20k rows \(\d+\.\d\d GB at 10k\), checkpoint "
    r"\d+\.\d s, \d+ bytes/key, largest dynamic table [\d,]+ keys on 2 ps \(estimated from "
    r"bytes/key and \d+\.\d\d GB available\)$"
)


@pytest.mark.timeout(400)
def test_capacity_runs_end_to_end_at_small_sizes(run_cli, workdir):
    out = workdir / "capacity.json"
    argv = [sys.executable, BENCH, "--rows", "20k", "--small-rows", "10k", "--steps", "60",
            "--checkpoint-every", "20", "--keys", "50k", "--out", str(out)]  # fmt: skip
    proc = run_cli(argv, timeout=390)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert LAST.fullmatch(lines[-1]), lines[-1]
    report = json.loads(out.read_text())
    for run in (report["small"], report["large"]):
        assert run["coordinator_peak_bytes"] > 100e6, run
        assert sorted(run["ps_peak_bytes"]) == ["ps:0", "ps:1"], run
        assert run["checkpoint_seconds"] and all(s > 0 for s in run["checkpoint_seconds"]), run
        # Each ps wrote its own part of the final checkpoint.
        assert re.search(r"ps:0 \d+ file\(s\).*ps:1 \d+ file\(s\)", run["checkpoint_lines"][-1])
    assert report["dynamic"]["rows"] > 0 and report["dynamic"]["bytes_per_key"] > 0
    assert report["dynamic"]["training_bytes_per_key"] > 0, report["dynamic"]
    assert report["largest_dynamic_keys_estimated"] > 0
