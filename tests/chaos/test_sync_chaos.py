"""``--strategy sync`` under a worker SIGKILL: the other worker's all-reduce fails, every
training process exits to be restarted, the group goes on from the chief's latest
checkpoint, and the job finishes with the accuracy it would have had; nothing is left."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from psctl.cluster.ports import free_ports
from tests.conftest import kill_if_running, processes_mentioning, read_json, status_or_none
from tests.integration.training.sync_job import start_sync_job, wait_until_gone

pytestmark = pytest.mark.chaos

CHECKPOINT_EVERY = 200
K = 10  # steps per call


def training_process(workdir, index: int) -> int | None:
    """The pid of worker ``index``'s training process (``train ... --once``)."""
    for pid in processes_mentioning(str(workdir)):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
        except OSError:
            continue
        args = [a.decode() for a in cmdline]
        if (
            "--once" in args
            and "--task-index" in args
            and args[args.index("--task-index") + 1] == str(index)
        ):
            return pid
    return None


@pytest.mark.timeout(280)
def test_sync_worker_sigkill_restarts_the_group_from_checkpoint(workdir):
    (port,) = free_ports(1)
    address = f"127.0.0.1:{port}"
    out = workdir / "summary.json"
    proc, log = start_sync_job(
        workdir,
        address,
        "--steps",
        "2400",
        "--checkpoint-every",
        str(CHECKPOINT_EVERY),
        "--steps-per-execution",
        str(K),
        summary=out,
    )
    try:
        deadline = time.monotonic() + 150
        seen = 0
        while seen < 700:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            status = status_or_none(address)
            seen = int(status["global_step"]) if status else 0
            time.sleep(0.2)
        victim = training_process(workdir, 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        assert proc.wait(timeout=200) == 0, log.read_text()[-4000:]
    finally:
        kill_if_running(proc)
    text = log.read_text(errors="replace")
    restored = [int(m) for m in re.findall(r"resuming: restored \S+ \(global step (\d+)\)", text)]
    failed = [int(m) for m in re.findall(r"other workers failed at global step (\d+)", text)]
    assert restored and failed, text[-4000:]
    # Steps lost: those the chief had trained when the all-reduce failed, after the
    # checkpoint the group restarted from: at most one checkpoint interval.
    lost = failed[-1] - restored[-1]
    print(
        f"\nsync chaos: worker 1 SIGKILLed (status said step {seen}); the chief failed at step "
        f"{failed[-1]}, restored step {restored[-1]} ({lost} steps lost), done "
        f"{time.monotonic() - killed_at:.0f}s after the kill"
    )
    assert 0 <= lost <= CHECKPOINT_EVERY, (failed, restored)
    summary = read_json(out)
    assert summary["global_step"] == 2400
    assert summary["eval_accuracy"] >= 0.90, summary
    assert summary["restarts"] >= 1, summary
    wait_until_gone(workdir, 10)
    assert processes_mentioning(str(workdir)) == []
