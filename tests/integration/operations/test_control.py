"""psctl's control plane against a real `psctl local` job: status, watch, checkpoint,
pause/resume and stop through the CLI, as an operator uses them."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from psctl.cluster.ports import free_ports
from psctl.cluster.processes.procs import command_lines
from tests.conftest import (
    child_env,
    control_cli,
    kill_if_running,
    processes_mentioning,
    psctl_argv,
    read_json,
    run_python,
    status_or_none,
)

pytestmark = pytest.mark.integration


def health(cluster_file: Path) -> subprocess.CompletedProcess[str]:
    """`psctl health` on a cluster file: every server's grpc health service."""
    return subprocess.run(
        psctl_argv("health", "--cluster", str(cluster_file)),
        capture_output=True,
        text=True,
        timeout=30,
        env=child_env(),
    )


def status(address: str) -> dict:
    proc = control_cli(address, "status", "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def start_local_job(workdir: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    """`psctl local` of 100,000 steps on a free control port: (process, address, summary)."""
    (port,) = free_ports(1)
    address = f"127.0.0.1:{port}"
    out = workdir / "out.json"
    # Its log beside the work dir, for a failure to be read (pytest keeps the last runs).
    with open(workdir.parent / "job.log", "wb") as log:
        job = subprocess.Popen(
            psctl_argv(
                "local",
                "--workdir",
                str(workdir),
                "--steps",
                "100000",
                "--control-address",
                address,
                "--summary-json",
                str(out),
                *extra,
            ),
            stdout=subprocess.DEVNULL,
            stderr=log,
            env=child_env(),
        )
    return job, address, out


def stop_job(job: subprocess.Popen[bytes], address: str, *, wait: float) -> None:
    """`psctl stop` (the coordinator's own drain bounded at 120 s): it answers 0, and the
    job exits 0 within ``wait`` seconds."""
    stop = control_cli(address, "stop", "--timeout", "120", timeout=150)
    assert stop.returncode == 0, stop.stderr
    assert job.wait(timeout=wait) == 0


def wait_training(address: str) -> dict:
    """The job's status once it is RUNNING with steps done."""
    return wait_until(
        lambda: (
            (s := status_or_none(address))
            and s["state"] == "JOB_STATE_RUNNING"
            and int(s["global_step"]) > 0
            and s
        ),
        timeout=150,
        what="RUNNING with steps",
    )


def load_step(path: str) -> int:
    """Read global_step from a checkpoint in a fresh process: proves it is restorable."""
    code = (
        "import sys, tensorflow as tf; r = tf.train.load_checkpoint(sys.argv[1]); "
        "print(int(r.get_tensor('global_step/.ATTRIBUTES/VARIABLE_VALUE')))"
    )
    stdout = run_python(code, path)
    return int(stdout.strip())


@pytest.mark.timeout(300)
def test_operator_drives_a_running_job(workdir):
    # No periodic checkpoint rotates the requested one away.
    job, address, out = start_local_job(workdir, "--checkpoint-every", "1000000")
    try:
        # status: every task with health and pid, and a rising global step
        first = wait_training(address)
        tasks = {(t["type"], t["index"]): t for t in first["tasks"]}
        assert set(tasks) == {("chief", 0), ("ps", 0), ("worker", 0), ("worker", 1)}
        for task in tasks.values():
            assert int(task["pid"]) > 0
        wait_until(
            lambda: all(t["health"] == "TASK_HEALTH_SERVING" for t in status(address)["tasks"]),
            20,
            "all SERVING",
        )
        later = wait_until(
            lambda: (
                (s := status(address)) and int(s["global_step"]) > int(first["global_step"]) and s
            ),
            30,
            "a rising step",
        )
        assert int(later["global_step"]) > int(first["global_step"])

        # watch: at least three updates, one line each when piped
        watch = control_cli(address, "watch", "--interval", "0.3", "--count", "3")
        assert watch.returncode == 0, watch.stderr
        assert len(watch.stdout.strip().splitlines()) == 3

        # checkpoint: restorable, at the reported step
        ckpt = control_cli(address, "checkpoint", timeout=120)
        assert ckpt.returncode == 0, ckpt.stderr
        words = ckpt.stdout.split()
        path, step = words[1], int(words[-1])
        assert load_step(path) == step

        # pause holds the step still; resume moves it again
        assert control_cli(address, "pause").returncode == 0
        wait_until(lambda: status(address)["state"] == "JOB_STATE_PAUSED", 30, "PAUSED")
        held = int(status(address)["global_step"])
        time.sleep(4)
        assert int(status(address)["global_step"]) == held
        assert control_cli(address, "resume").returncode == 0
        wait_until(lambda: int(status(address)["global_step"]) > held, 30, "steps after resume")

        # health: every server's grpc health service, like grpc_health_probe
        probe = health(workdir / "cluster.json")
        assert probe.returncode == 0, probe.stdout + probe.stderr
        assert probe.stdout.count("SERVING") == 3

        # stop: exit 0 with a final checkpoint at the final step
        stop_job(job, address, wait=60)
    finally:
        kill_if_running(job)
    summary = read_json(out)
    assert summary["stopped_early"] is True
    assert summary["checkpoint"].endswith(f"ckpt-{summary['global_step']}")
    assert load_step(summary["checkpoint"]) == summary["global_step"]
    assert processes_mentioning(str(workdir)) == []
    probe = health(workdir / "cluster.json")
    assert probe.returncode == 69
    assert probe.stdout.count("UNREACHABLE") == 3


@pytest.mark.timeout(300)
def test_stop_after_a_status_and_a_scrape_ends_the_job_at_once(workdir):
    """An operator's look (`psctl status`, one read of the coordinator's /metrics) before
    `psctl stop`: the job ends within seconds of its summary. A single read is no scraper
    that comes back; the coordinator waited 30 s for its next scrape (the job ended ~31 s
    after the summary)."""
    job, address, out = start_local_job(workdir)
    try:
        running = wait_training(address)  # `psctl status --json`
        (chief,) = [t for t in running["tasks"] if t["type"] == "chief"]
        with urllib.request.urlopen(chief["metrics_url"], timeout=10) as response:
            assert b"psctl_global_step" in response.read()
        assert status_or_none(address) is not None
        stop_job(job, address, wait=90)
        ended = time.time()
    finally:
        kill_if_running(job)
    late = ended - out.stat().st_mtime  # the summary is written, then the job ends
    assert late < 10, f"the job ended {late:.1f}s after its summary"
    assert read_json(out)["stopped_early"] is True


@pytest.mark.timeout(60)
def test_status_without_coordinator_is_one_clear_line():
    (port,) = free_ports(1)
    started = time.monotonic()
    proc = control_cli(f"127.0.0.1:{port}", "status")
    assert time.monotonic() - started < 10
    assert proc.returncode == 69
    assert proc.stderr.strip() == (
        f"psctl: error: no coordinator at 127.0.0.1:{port}: connection refused"
    )


@pytest.mark.timeout(300)
def test_control_api_answers_while_the_training_process_restarts(workdir):
    """The launcher holds the control address: a SIGKILLed training process shows as
    RECOVERING (never a closed port) until the next one answers; requests that need it are
    refused in one line meanwhile, and a stop afterwards ends the job cleanly."""
    job, address, out = start_local_job(workdir)
    try:
        first = wait_training(address)
        (chief,) = [int(t["pid"]) for t in first["tasks"] if t["type"] == "chief"]
        assert chief != job.pid  # the training process, not the launcher
        subprocess.run(["kill", "-9", str(chief)], check=True)
        states, refused = [], None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            now = status_or_none(address)
            assert now is not None, "the control address stopped answering"
            states.append(now["state"])
            if now["state"] == "JOB_STATE_RECOVERING" and refused is None:
                assert "restarting" in now["message"], now
                refused = control_cli(address, "pause")
            chiefs = [int(t["pid"]) for t in now["tasks"] if t["type"] == "chief"]
            if now["state"] == "JOB_STATE_RUNNING" and chiefs and chiefs != [chief]:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"no new training process answered: {states[-20:]}")
        assert "JOB_STATE_RECOVERING" in states, states
        assert refused is not None and refused.returncode != 0
        (line,) = refused.stderr.strip().splitlines()
        assert "RECOVERING" in line and "try again" in line, line
        stop_job(job, address, wait=60)
    finally:
        kill_if_running(job)
    summary = read_json(out)
    assert summary["restarts"] >= 1 and summary["stopped_early"] is True
    assert processes_mentioning(str(workdir)) == []


def test_a_stop_while_the_next_training_process_starts_ends_as_a_stop(workdir):
    """Found by bench/soak.py: ``psctl stop`` reached a training process the supervisor had
    just started (importing TensorFlow, no handler yet) as SIGTERM, which killed it: exit
    130, no summary. Now it stops at once after restoring: evaluation, summary, exit 0."""
    job, address, out = start_local_job(workdir)
    try:
        first = wait_training(address)
        (chief,) = [int(t["pid"]) for t in first["tasks"] if t["type"] == "chief"]
        subprocess.run(["kill", "-9", str(chief)], check=True)
        wait_until(
            lambda: [p for p in trainers(workdir) if p != chief],
            timeout=60,
            what="the next training process started",
        )
        stop_job(job, address, wait=150)
    finally:
        kill_if_running(job)
    summary = read_json(out)
    assert summary["restarts"] == 1 and summary["stopped_early"] is True, summary
    assert summary["eval_accuracy"] is not None, summary
    assert processes_mentioning(str(workdir)) == []


def trainers(workdir: Path) -> list[int]:
    """The training processes of a `psctl local` job in ``workdir``."""
    return [
        pid
        for pid, line in command_lines(str(workdir)).items()
        if "-m psctl train" in line and "--once" in line
    ]
