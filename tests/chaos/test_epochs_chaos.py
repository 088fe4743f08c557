"""``--epochs`` under failures, on real clusters (psctl local) with the visitation job's
per-id counter on the ps:

- a worker SIGKILL: the batches the worker held are lost, and psctl's make-up pass makes
  every example trained at least once per epoch (at-least-once);
- a ps SIGKILL: a new training process restores the checkpoint and trains the passes over,
  every example of them (its dispatcher recovers the old one's state from its journal; a
  fresh one handed the data workers' stale tasks out and the passes ended at once).

Prints the visit histogram (times trained: number of ids), e.g. ``{1: 5538, 2: 2462}``.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import child_env, kill_if_running, local_argv, processes_mentioning, read_json
from tests.integration.data.test_epochs import VISIT_JOB, checkpoint_tensor

pytestmark = pytest.mark.chaos

IDS = 8000
TRAINED = re.compile(r"end of the data \(\d+ of \d+ workers\); (\d+) examples trained so far")


def kill_during_epoch(workdir: Path, task: str, ids: int) -> tuple[str, list[int], dict]:
    """``psctl local --epochs 1`` of ``ids`` ids; SIGKILL of ``task`` (worker:1 or ps:0) a
    second after the first step. Returns the log, the visits and the summary."""
    workdir.mkdir(parents=True)
    out = workdir / "out.json"
    argv = local_argv(
        workdir,
        "--job", VISIT_JOB,
        "--epochs", "1",
        "--batch-size", "16",
        "--steps-per-execution", "5",
        "--log-every", "1",
        "--summary-json", str(out),
    )  # fmt: skip
    log_path = workdir / "launcher.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=child_env(VISIT_IDS=str(ids))
        )
    try:
        deadline = time.monotonic() + 120
        while "train | step" not in log_path.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        time.sleep(1.0)
        kind, index = task.split(":")
        tasks = read_json(workdir / "tasks.json")
        victim = next(t for t in tasks if t["type"] == kind and t["index"] == int(index))
        os.kill(victim["pid"], signal.SIGKILL)
        assert proc.wait(timeout=180) == 0, log_path.read_text()[-4000:]
    finally:
        kill_if_running(proc)
    log = log_path.read_text(errors="replace")
    visits = checkpoint_tensor(workdir / "checkpoints", "model/visits/.ATTRIBUTES/VARIABLE_VALUE")
    histogram = dict(sorted(collections.Counter(int(v) for v in visits).items()))
    print(f"\nepochs chaos: {task} SIGKILL, 1 epoch of {ids} ids, visits histogram {histogram}")
    deadline = time.monotonic() + 15
    while processes_mentioning(str(workdir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(str(workdir)) == []
    return log, [int(v) for v in visits], read_json(out)


@pytest.mark.timeout(240)
def test_worker_sigkill_during_epoch_is_at_least_once(workdir):
    log, visits, summary = kill_during_epoch(workdir, "worker:1", IDS)
    assert len(visits) == IDS
    assert min(visits) >= 1  # at-least-once
    assert "make-up pass" in log
    assert summary["worker_failures"] >= 1


@pytest.mark.timeout(240)
def test_ps_sigkill_during_epoch_trains_every_example_after_the_restart(workdir):
    log, visits, summary = kill_during_epoch(workdir, "ps:0", IDS)
    assert summary["restarts"] >= 1, log[-3000:]
    # The last training process's passes (they start over, from the checkpoint if one was
    # written): every example of them. Before the journal: 2,800 of 8,000, the rest never.
    assert [int(n) for n in TRAINED.findall(log)][-1] >= IDS, log[-3000:]
    assert len(visits) == IDS and min(visits) >= 1
