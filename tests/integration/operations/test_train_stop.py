"""`psctl stop` of a real `psctl train --cluster FILE` job whose ps died and stays down, its
servers started here with their own commands as an operator starts them on hosts: the stop
ends the job at once (exit 0, the latest checkpoint kept), not after --recovery-timeout
and a training process that can never reach the ps (docs/operations.md, runbook
PsctlPsDown). First, the same servers refuse a cluster file with their addresses swapped."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from psctl.cluster.ports import free_ports
from tests.conftest import (
    child_env,
    control_cli,
    kill_if_running,
    processes_mentioning,
    psctl_argv,
    status_or_none,
)
from tests.integration.operations.test_control import wait_until
from tests.integration.operations.test_scale_train import (
    await_serving,
    launch_server,
    tf_ports,
    write_cluster,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

RECOVERY_TIMEOUT = 240  # far longer than the stop may take


def test_a_stop_while_the_ps_stays_down_ends_the_job_at_once(workdir: Path):
    (workdir / "logs").mkdir(parents=True)
    chief, ps0, w0 = tf_ports(3)
    control_port, metrics_port = free_ports(2)
    address = f"127.0.0.1:{control_port}"
    cluster_file = write_cluster(workdir / "cluster.json", chief, [ps0], [w0])
    checkpoints = workdir / "checkpoints"
    log_path = workdir / "logs" / "coordinator.log"
    summary_path = workdir / "summary.json"
    # An earlier run's summary at the same path: this run's end replaces it (it was kept).
    summary_path.write_text(json.dumps({"global_step": 300, "job": "earlier"}))
    # Both servers start side by side (as on their hosts), each SERVING before the job.
    ps = launch_server(workdir, "ps", 0, cluster_file, ps0)
    worker = launch_server(workdir, "worker", 0, cluster_file, w0)
    await_serving("ps", 0, ps0)
    await_serving("worker", 0, w0)
    job = None
    try:
        # A cluster file with the ps and the worker swapped: refused before training starts
        # (TensorFlow would train on it, the variables on the worker's server).
        swapped = write_cluster(workdir / "swapped.json", chief, [w0], [ps0])
        wrong = subprocess.run(
            psctl_argv(
                "train", "--cluster", str(swapped), "--control-address", "127.0.0.1:0",
                "--metrics-port", "0",
                "--checkpoint-dir", str(workdir / "unused"), "--connect-timeout", "90",
            ),
            capture_output=True, text=True, timeout=150, env=child_env(),
        )  # fmt: skip
        assert wrong.returncode == 78, wrong.stdout + wrong.stderr
        assert (
            f"{swapped}: cluster.ps[0]: 127.0.0.1:{w0} is a worker-server, not a ps-server"
            in wrong.stderr
        ), wrong.stderr
        assert "Traceback" not in wrong.stderr and len(wrong.stderr.splitlines()) <= 3, wrong.stderr
        assert not list((workdir / "unused").glob("ckpt-*")), "trained on the swapped cluster"
        with log_path.open("wb") as log_file:
            job = subprocess.Popen(
                psctl_argv(
                    "train", "--cluster", str(cluster_file), "--control-address", address,
                    "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "100",
                    "--steps", "1000000", "--recovery-timeout", str(RECOVERY_TIMEOUT),
                    "--connect-timeout", "10", "--metrics-port", str(metrics_port),
                    "--summary-json", str(summary_path),
                ),
                stdout=log_file, stderr=subprocess.STDOUT, env=child_env(),
            )  # fmt: skip
        wait_until(
            lambda: (s := status_or_none(address)) and int(s.get("global_step", 0)) > 300,
            timeout=150,
            what="training past step 300",
        )
        wait_until(lambda: list(checkpoints.glob("ckpt-*.index")), 60, "a checkpoint")
        # Status lists the chief with its /metrics, as every other task (not "-").
        (chief_row,) = [t for t in status_or_none(address)["tasks"] if t["type"] == "chief"]
        assert chief_row["metrics_url"] == f"http://127.0.0.1:{metrics_port}/metrics"
        with urllib.request.urlopen(chief_row["metrics_url"], timeout=10) as page:
            assert b"psctl_global_step" in page.read()
        ps.send_signal(signal.SIGKILL)
        ps.wait(10)
        wait_until(
            lambda: (s := status_or_none(address)) and s["state"] == "JOB_STATE_RECOVERING",
            timeout=90,
            what="RECOVERING after the ps died",
        )
        kept = sorted(checkpoints.glob("ckpt-*.index"))
        asked = time.monotonic()
        stop = control_cli(address, "stop", "--timeout", "120", timeout=150)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        code = job.wait(timeout=120)
        took = time.monotonic() - asked
        log = log_path.read_text(errors="replace")
        assert code == 0, log[-3000:]
        # Not RECOVERY_TIMEOUT (and then --connect-timeout for a process that cannot start).
        assert took < RECOVERY_TIMEOUT / 2, (took, log[-3000:])
        assert "stopped while waiting for the ps tasks (ps:0 not SERVING)" in log, log[-3000:]
        assert "one more restores" not in log and "Traceback" not in log, log[-3000:]
        assert sorted(checkpoints.glob("ckpt-*.index"))[-1:] == kept[-1:]
        # The summary is this job's: the steps its latest checkpoint keeps, no evaluation.
        summary = json.loads(summary_path.read_text())
        newest = max(int(p.name.split("-")[1].split(".")[0]) for p in kept)
        assert summary["job"] == "mlp" and summary["global_step"] == newest, summary
        assert summary["stopped_early"] is True and summary["eval_accuracy"] is None, summary
        assert summary["checkpoint"] == str(checkpoints / f"ckpt-{newest}"), summary
        assert summary["ps_failures"] >= 1 and summary["num_workers"] == 1, summary
    finally:
        kill_if_running(job, timeout=30)
        for server in (ps, worker):
            kill_if_running(server, timeout=30)
    assert processes_mentioning(str(checkpoints)) == []


def test_a_killed_launchers_training_process_checkpoints_and_the_next_run_goes_on(
    local_cluster, workdir: Path
):
    """SIGKILL of `psctl train` (an OOM kill, an operator's kill -9) left its training process
    training on unsupervised, holding the chief's port: a new `psctl train` started at once
    failed with exit 1. Now the training process stops as at a stop (its final checkpoint,
    the kernel's double parent-death signal acted on once) and the new run waits for the
    port, then goes on from that checkpoint."""
    (control_port,) = free_ports(1)
    address = f"127.0.0.1:{control_port}"
    checkpoints = workdir / "checkpoints"
    argv = psctl_argv(
        "train", "--cluster", str(local_cluster.cluster_file), "--control-address", address,
        "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1000", "--steps", "100000",
        "--metrics-port", "0", "--connect-timeout", "30",
    )  # fmt: skip
    log_path = workdir / "train.log"
    with log_path.open("wb") as log_file:
        first = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=child_env())
    second = None
    try:
        wait_until(
            lambda: (s := status_or_none(address)) and int(s.get("global_step", 0)) > 300,
            timeout=150,
            what="training past step 300",
        )
        (child,) = [p for p in processes_mentioning("--once") if p in children_of(first.pid)]
        first.kill()
        first.wait(10)
        wait_until(lambda: not pid_alive(child), timeout=60, what="the training process gone")
        steps = sorted(int(p.name[5:-6]) for p in checkpoints.glob("ckpt-*.index"))
        assert steps and steps[-1] % 1000 != 0, steps  # its own final checkpoint
        with log_path.open("ab") as log_file:
            second = subprocess.Popen(
                argv, stdout=log_file, stderr=subprocess.STDOUT, env=child_env()
            )
        wait_until(
            lambda: f"restored {checkpoints}/ckpt-{steps[-1]} " in log_path.read_text(),
            timeout=120,
            what=f"the new run restoring ckpt-{steps[-1]}",
        )
        stop = control_cli(address, "stop", timeout=150)
        assert stop.returncode == 0, stop.stderr
        assert second.wait(timeout=150) == 0, log_path.read_text()[-3000:]
    finally:
        kill_if_running(first, timeout=30)
        kill_if_running(second, timeout=30)


def children_of(pid: int) -> set[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return {int(p) for p in path.read_text().split()} if path.exists() else set()


def pid_alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False
