"""``--epochs`` under a worker SIGKILL: the batches the worker held are lost, and psctl's
make-up pass makes every example trained at least once per epoch (at-least-once).

Prints the visit histogram (times trained: number of ids), e.g. ``{1: 5538, 2: 2462}``.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import time

import pytest

from tests.conftest import child_env, kill_if_running, local_argv, processes_mentioning, read_json
from tests.integration.test_epochs import VISIT_JOB, checkpoint_tensor

pytestmark = pytest.mark.chaos

IDS = 8000


@pytest.mark.timeout(240)
def test_worker_sigkill_during_epoch_is_at_least_once(workdir):
    workdir.mkdir(parents=True)
    out = workdir / "out.json"
    argv = local_argv(
        workdir,
        "--job",
        VISIT_JOB,
        "--epochs",
        "1",
        "--batch-size",
        "16",
        "--steps-per-execution",
        "5",
        "--log-every",
        "1",
        "--summary-json",
        str(out),
    )
    log_path = workdir / "launcher.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=child_env(VISIT_IDS=str(IDS))
        )
    try:
        deadline = time.monotonic() + 120
        while "train | step" not in log_path.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        time.sleep(1.0)
        tasks = read_json(workdir / "tasks.json")
        worker = next(t for t in tasks if t["type"] == "worker" and t["index"] == 1)
        os.kill(worker["pid"], signal.SIGKILL)
        assert proc.wait(timeout=180) == 0, log_path.read_text()[-4000:]
    finally:
        kill_if_running(proc)
    log = log_path.read_text(errors="replace")
    visits = checkpoint_tensor(workdir / "checkpoints", "model/visits/.ATTRIBUTES/VARIABLE_VALUE")
    histogram = dict(sorted(collections.Counter(int(v) for v in visits).items()))
    print(f"\nepochs chaos: worker SIGKILL, 1 epoch of {IDS} ids, visits histogram {histogram}")
    assert len(visits) == IDS
    assert min(visits) >= 1, histogram  # at-least-once
    assert "make-up pass" in log
    assert read_json(out)["worker_failures"] >= 1
    deadline = time.monotonic() + 15
    while processes_mentioning(str(workdir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(str(workdir)) == []
