"""``--strategy sync`` with real processes: ``psctl local --strategy sync`` trains the mlp job
to the target over every worker, answers ``psctl status`` / pause / resume on the chief,
and leaves nothing running."""

from __future__ import annotations

import json
import re
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
    describe_process,
    kill_if_running,
    processes_mentioning,
    psctl_argv,
    read_json,
    status_or_none,
)
from tests.integration.training.sync_job import (
    start_sync_job,
    wait_for,
    wait_for_state,
    wait_until_gone,
)

pytestmark = pytest.mark.integration

STEPS_PER_EPOCH = 312  # mlp: 40,000 examples / 64 per batch / 2 workers


@pytest.mark.timeout(200)
def test_sync_local_epochs_accuracy_status_and_pause(workdir):
    """The acceptance run (2 workers, 3 epochs, mlp), with the operator's commands on the
    chief while it runs: status, pause (the step stands still on every worker), resume."""
    (port,) = free_ports(1)
    address = f"127.0.0.1:{port}"
    out = workdir / "summary.json"
    proc, log = start_sync_job(
        workdir, address, "--epochs", "3", "--steps-per-execution", "10", summary=out
    )
    try:
        running = wait_for_state(address, "JOB_STATE_RUNNING", 120, proc, log)
        assert isinstance(running, dict)
        assert {t["type"] for t in running["tasks"]} == {"worker"}, running
        assert len(running["tasks"]) == 2, running
        # Every worker as a parameter-server job shows its tasks: the pid of its process
        # (tasks.json's), its health (its training process serves grpc.health.v1) and a
        # /metrics that answers.
        seen = wait_for(
            lambda: (
                (s := status_or_none(address))
                and all(t.get("health") == "TASK_HEALTH_SERVING" for t in s["tasks"])
                and s
            ),
            30,
            "every worker SERVING",
            proc,
            log,
        )
        assert isinstance(seen, dict)
        for task in seen["tasks"]:
            assert Path(f"/proc/{int(task['pid'])}").exists(), task
            assert f"--task-index {task['index']}" in describe_process(int(task["pid"])), task
            with urllib.request.urlopen(task["metrics_url"], timeout=10) as response:
                text = response.read().decode()
            # The chief's: the coordinator's series; every other worker's: its task's.
            series = "psctl_global_step " if task["index"] == 0 else "psctl_task_info{"
            assert series in text and 'psctl_health_state{state="serving"} 1.0' in text, task
        paused = control_cli(address, "pause")
        assert paused.returncode == 0, paused.stderr
        first = wait_for_state(address, "JOB_STATE_PAUSED", 30, proc, log)
        assert isinstance(first, dict)
        time.sleep(2.0)
        second = status_or_none(address)
        assert second is not None and second["state"] == "JOB_STATE_PAUSED"
        assert int(second["global_step"]) == int(first["global_step"])
        resumed = control_cli(address, "resume")
        assert resumed.returncode == 0, resumed.stderr
        # The chief's /metrics: the coordinator's series, plus the all-reduce time.
        url = read_json(workdir / "tasks.json")[0]["metrics_url"]
        with urllib.request.urlopen(url, timeout=10) as response:
            metrics = response.read().decode()
        assert re.search(r"^psctl_allreduce_seconds_count [1-9]", metrics, re.M), metrics
        assert re.search(r"^psctl_global_step [1-9]", metrics, re.M), metrics
        assert "psctl_workers 2.0" in metrics and "psctl_ps 0.0" in metrics
        assert proc.wait(timeout=150) == 0, log.read_text()[-4000:]
    finally:
        kill_if_running(proc)
    text = log.read_text(errors="replace")
    assert "resumed at global step" in text
    summary = read_json(out)
    assert summary["eval_accuracy"] >= 0.90, summary
    assert summary["global_step"] == summary["target_steps"] == 3 * STEPS_PER_EPOCH
    assert summary["num_workers"] == 2 and summary["num_ps"] == 0
    assert (workdir / "checkpoints" / "checkpoint").exists()
    wait_until_gone(workdir, 10)
    assert processes_mentioning(str(workdir)) == []


@pytest.mark.timeout(240)
def test_sync_checkpoints_are_read_by_async_mode_and_evaluate(run_cli, workdir, tmp_path):
    """One checkpoint layout: the parameter-server mode goes on from a sync run's
    checkpoint, sync mode from that one, and `psctl evaluate` reads them."""
    checkpoints = tmp_path / "checkpoints"
    common = ["--checkpoint-dir", str(checkpoints), "--control-address", "127.0.0.1:0"]

    def local(name: str, *args: str) -> str:
        argv = psctl_argv("local", "--workdir", str(workdir / name), *common, *args)
        proc = run_cli(argv, timeout=150)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stderr

    local("sync1", "--strategy", "sync", "--workers", "2", "--steps", "300")
    out = local("async", "--steps", "400")
    assert re.search(r"resuming: restored \S+ckpt-300 \(global step 300\)", out), out[-3000:]
    out = local("sync2", "--strategy", "sync", "--workers", "2", "--steps", "500")
    assert re.search(r"resuming: restored \S+ckpt-400 \(global step 400\)", out), out[-3000:]
    summary = tmp_path / "eval.json"
    proc = run_cli(
        psctl_argv(
            "evaluate",
            "--checkpoint-dir",
            str(checkpoints),
            "--max-evaluations",
            "1",
            "--summary-json",
            str(summary),
        ),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = read_json(summary)
    assert result["global_step"] == 500 and result["eval_accuracy"] >= 0.90, result


def start_long_sync_job(
    workdir: Path, summary: Path | None = None
) -> tuple[subprocess.Popen[bytes], Path]:
    """A sync job far from its target, once it has logged its first step."""
    proc, log = start_sync_job(workdir, "127.0.0.1:0", "--steps", "1000000", summary=summary)
    wait_for(lambda: "train | step" in log.read_text(errors="replace"), 120, "steps", proc, log)
    return proc, log


@pytest.mark.timeout(200)
def test_sync_local_sigterm_stops_every_worker_gracefully(workdir):
    out = workdir / "summary.json"
    proc, log = start_long_sync_job(workdir, summary=out)
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, log.read_text()[-4000:]
    finally:
        kill_if_running(proc)
    summary = read_json(out)
    assert summary["stopped_early"] and summary["global_step"] > 0, summary
    assert summary["checkpoint"], summary
    assert processes_mentioning(str(workdir)) == []


@pytest.mark.timeout(200)
def test_sync_local_sigkill_leaves_no_worker_behind(workdir):
    proc, _log = start_long_sync_job(workdir)
    try:
        proc.kill()
        proc.wait(timeout=10)
    finally:
        kill_if_running(proc)
    wait_until_gone(workdir, 15)
    assert processes_mentioning(str(workdir)) == []


@pytest.mark.timeout(200)
def test_sync_trains_a_job_with_an_auc_metric(run_cli, workdir, tmp_path):
    """The ctr job: embeddings, and a training metric (AUC) that is not a mean, whose
    on-read variables must not be all-reduced by the chief alone; --eval-every on the
    chief between calls."""
    out = tmp_path / "summary.json"
    argv = psctl_argv(
        "local",
        "--workdir",
        str(workdir),
        "--control-address",
        "127.0.0.1:0",
        "--strategy",
        "sync",
        "--workers",
        "2",
        "--job",
        "ctr",
        "--steps",
        "200",
        "--log-every",
        "1",
        "--eval-every",
        "80",
        "--steps-per-execution",
        "20",
        "--summary-json",
        str(out),
    )
    proc = run_cli(argv, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = re.findall(r"eval \| step:\s+(\d+) \| loss: [0-9.]+ \| auc: 0\.", proc.stderr)
    assert evals == ["80", "160", "200"], proc.stderr[-3000:]
    summary = read_json(out)
    assert summary["global_step"] == 200
    assert summary["eval_auc"] is not None and summary["eval_auc"] > 0.6, summary
    assert "auc" in summary["metrics"], summary


@pytest.mark.timeout(200)
def test_sync_train_without_metrics_runs(workdir):
    """`psctl train --strategy sync --metrics-port 0` on worker 0: /metrics off, as in the
    parameter-server mode. It was refused (exit 78: the chief's /metrics address taken as
    worker 0's own, 'also used by cluster.worker[0]')."""
    workdir.mkdir(parents=True)
    tf_ports = free_ports(2)
    cluster = workdir / "cluster.json"
    workers = [f"127.0.0.1:{port}" for port in tf_ports]
    cluster.write_text(json.dumps({"cluster": {"worker": workers}}))

    def argv(index: int) -> list[str]:
        return psctl_argv(
            "train", "--strategy", "sync", "--cluster", str(cluster), "--task-index", str(index),
            "--metrics-port", "0", "--health-port", "0", "--steps", "40",
            "--control-address", "127.0.0.1:0", "--connect-timeout", "60",
        )  # fmt: skip

    procs = [
        subprocess.Popen(
            argv(i), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env()
        )
        for i in range(2)
    ]
    try:
        outs = [proc.communicate(timeout=150)[0] for proc in procs]
        assert [proc.returncode for proc in procs] == [0, 0], outs[0][-3000:] + outs[1][-2000:]
        assert "done | step: 40" in outs[0], outs[0][-3000:]
        assert "metrics on" not in outs[0], outs[0][-3000:]
    finally:
        for proc in procs:
            kill_if_running(proc, timeout=30)


@pytest.mark.timeout(200)
def test_a_sync_worker_whose_peer_never_starts_ends_at_the_connect_timeout(workdir):
    """Worker 0 of 2, worker 1 never started: exit 69 after ``--connect-timeout`` with one
    line, as sync.md says. TensorFlow 2.21 waits for the group with no deadline (it ran
    13 min, SIGTERM and ``psctl stop`` not acted on). A ``psctl stop`` meanwhile says
    "coordinator stopped" only once it is gone (it said so while the job still ran)."""
    workdir.mkdir(parents=True)
    cluster = workdir / "cluster.json"
    tf_port, absent, control = free_ports(3)
    workers = [f"127.0.0.1:{tf_port}", f"127.0.0.1:{absent}"]
    cluster.write_text(json.dumps({"cluster": {"worker": workers}}))
    address = f"127.0.0.1:{control}"

    def start(connect_timeout: int) -> subprocess.Popen[str]:
        argv = psctl_argv(
            "train", "--strategy", "sync", "--cluster", str(cluster), "--task-index", "0",
            "--metrics-port", "0", "--health-port", "0", "--steps", "40",
            "--checkpoint-dir", str(workdir / "ckpt"), "--control-address", address,
            "--connect-timeout", str(connect_timeout),
        )  # fmt: skip
        return subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env()
        )

    proc = start(5)
    try:
        out = proc.communicate(timeout=90)[0]
        assert proc.returncode == 69, out[-3000:]
        assert out.strip().splitlines()[-1] == (
            "psctl: error: not every worker joined within --connect-timeout; start psctl train "
            "--strategy sync on every worker of the cluster file, or raise --connect-timeout; "
            "giving up (exit 69)"
        ), out[-3000:]

        proc = start(30)
        deadline = time.monotonic() + 60
        while status_or_none(address) is None and time.monotonic() < deadline:
            time.sleep(0.5)
        stop = control_cli(address, "stop", "--timeout", "90", timeout=120)
        assert stop.returncode == 0 and "coordinator stopped" in stop.stdout, stop
        proc.wait(timeout=5)  # gone when stop said so
        assert "not every worker joined" not in proc.stdout.read(), "a stop is no failed join"
    finally:
        kill_if_running(proc, timeout=30)
