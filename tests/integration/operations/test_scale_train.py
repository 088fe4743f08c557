"""psctl scale against a real `psctl train --cluster FILE` job on loopback, its ps and
worker servers started here with their own commands, as an operator starts them on hosts:
a third worker added (`psctl scale --cluster NEW.json`), a cluster naming a worker nobody
started refused in one line (exit 78) while the job goes on, the ps moved to a new
address by rewriting the job's cluster file and sending the launcher SIGHUP, and a worker
stopped by SIGTERM taken out with no failure counted, and taken back once its server
serves again; each time the new training process
goes on from the step reached when it was asked for."""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from psctl.cluster.health import wait_serving
from psctl.cluster.ports import HEALTH_PORT_OFFSET, METRICS_PORT_OFFSET, free_ports
from psctl.cluster.processes.files import write_json_atomic
from psctl.cluster.processes.procs import spawn
from psctl.coordinator import argv as launch_argv
from tests.conftest import (
    child_env,
    control_cli,
    kill_if_running,
    processes_mentioning,
    psctl_argv,
    read_json,
    status_or_none,
)
from tests.integration.operations.test_control import status, wait_until
from tests.integration.operations.test_scale import members, shape

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CONNECT_TIMEOUT = 10
TRAINING = ("JOB_STATE_RUNNING", "JOB_STATE_CHECKPOINTING")  # a periodic checkpoint shows
COPIES = re.compile(r"\((/\S*psctl-cluster-[^/\s]+)/cluster-\d+\.json\)")
RESTORED = re.compile(r"resuming: restored \S+ \(global step (\d+)\)")


def bindable(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def tf_ports(count: int) -> list[int]:
    """``count`` free TF ports whose default side ports (health +1000, metrics +2000) are
    free too: the servers listen there, and the coordinator's status looks there."""
    chosen: list[int] = []
    while len(chosen) < count:
        for port in free_ports(count):
            side = (port + HEALTH_PORT_OFFSET, port + METRICS_PORT_OFFSET)
            used = {p + o for p in chosen for o in (0, HEALTH_PORT_OFFSET, METRICS_PORT_OFFSET)}
            if len(chosen) < count and used.isdisjoint((port, *side)) and all(map(bindable, side)):
                chosen.append(port)
    return chosen


def write_cluster(path: Path, chief: int, ps: list[int], workers: list[int]) -> Path:
    jobs = {"chief": [chief], "ps": ps, "worker": workers}
    body = {"cluster": {kind: [f"127.0.0.1:{p}" for p in ports] for kind, ports in jobs.items()}}
    write_json_atomic(path, body)
    return path


def launch_server(
    workdir: Path, kind: str, index: int, cluster: Path, tf_port: int
) -> subprocess.Popen[bytes]:
    """A ps-server or worker-server as on a host: its task from ``--cluster F --index I``,
    its side ports at their defaults; not waited for (``await_serving``)."""
    return spawn(
        launch_argv.server_argv(kind, ["--cluster", str(cluster), "--index", str(index)]),
        log_path=workdir / "logs" / f"{kind}-{index}-{tf_port}.log",
        env=child_env(),
    )


def await_serving(kind: str, index: int, tf_port: int) -> None:
    health = f"127.0.0.1:{tf_port + HEALTH_PORT_OFFSET}"
    result = wait_serving(health, timeout=90)
    assert result.serving, f"{kind}:{index} not SERVING at {health}: {result}"


def start_server(
    workdir: Path, kind: str, index: int, cluster: Path, tf_port: int
) -> subprocess.Popen[bytes]:
    """``launch_server``, SERVING before it returns."""
    proc = launch_server(workdir, kind, index, cluster, tf_port)
    await_serving(kind, index, tf_port)
    return proc


def scale(address: str, cluster: Path) -> subprocess.CompletedProcess[str]:
    return control_cli(address, "scale", "--cluster", str(cluster), timeout=120)


def wait_running(address: str, *, workers: int, generation: int, after: int, ps: str) -> dict:
    """RUNNING on 1 ps at ``ps`` + ``workers`` workers at ``generation``, past ``after``."""
    return wait_until(
        lambda: (
            (s := status_or_none(address))
            and s["state"] == "JOB_STATE_RUNNING"
            and shape(s) == (1, workers)
            and int(s.get("cluster_generation", 0)) == generation
            and int(s["global_step"]) > after
            and [t["address"] for t in members(s) if t["type"] == "ps"] == [ps]
            and all(t["health"] == "TASK_HEALTH_SERVING" for t in members(s))
            and s
        ),
        timeout=150,
        what=f"RUNNING on {ps} + {workers} workers (generation {generation}) past step {after}",
    )


def steps_go_on(address: str, after: int) -> int:
    return wait_until(
        lambda: (s := status_or_none(address)) and int(s["global_step"]) > after and s,
        timeout=60,
        what=f"steps past {after}",
    )["global_step"]


def test_scale_a_train_job_on_operator_started_servers(workdir: Path):
    (workdir / "logs").mkdir(parents=True)
    chief, ps0, ps_new, w0, w1, w2, nobody = tf_ports(7)
    (control_port,) = free_ports(1)
    address = f"127.0.0.1:{control_port}"
    cluster_file = write_cluster(workdir / "cluster.json", chief, [ps0], [w0, w1])
    out = workdir / "summary.json"
    log_path = workdir / "logs" / "coordinator.log"
    # The three servers start side by side (as on their hosts), each SERVING before the job.
    first = (("ps", 0, ps0), ("worker", 0, w0), ("worker", 1, w1))
    servers = [
        launch_server(workdir, kind, index, cluster_file, port) for kind, index, port in first
    ]
    for kind, index, port in first:
        await_serving(kind, index, port)
    job = None
    try:
        with log_path.open("wb") as log_file:
            job = subprocess.Popen(
                psctl_argv(
                    "train",
                    "--cluster",
                    str(cluster_file),
                    "--checkpoint-dir",
                    str(workdir / "checkpoints"),
                    "--control-address",
                    address,
                    "--steps",
                    "100000",
                    "--connect-timeout",
                    str(CONNECT_TIMEOUT),
                    "--summary-json",
                    str(out),
                    "--metrics-port",
                    "0",
                    "--log-every",
                    "1",
                ),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=child_env(),
            )
        ps_address = f"127.0.0.1:{ps0}"
        wait_running(address, workers=2, generation=0, after=0, ps=ps_address)

        # (a) A third worker: its server started on the new cluster file, then the scale.
        three = write_cluster(workdir / "three-workers.json", chief, [ps0], [w0, w1, w2])
        servers.append(start_server(workdir, "worker", 2, three, w2))
        before = int(status(address)["global_step"])
        proc = scale(address, three)
        assert proc.returncode == 0, proc.stderr
        assert "(generation 1)" in proc.stdout, proc.stdout
        s = wait_running(address, workers=3, generation=1, after=before, ps=ps_address)
        assert int(s["global_step"]) >= before

        # (b) A fourth worker nobody started: refused in one line after --connect-timeout,
        # and the job trains on as it was.
        missing = write_cluster(workdir / "missing-worker.json", chief, [ps0], [w0, w1, w2, nobody])
        sent = time.monotonic()
        proc = scale(address, missing)
        took = time.monotonic() - sent
        assert proc.returncode == 78, (proc.returncode, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "worker:3" in lines[0], proc.stderr
        assert CONNECT_TIMEOUT <= took < CONNECT_TIMEOUT + 15, took
        s = status(address)
        assert s["state"] in TRAINING and shape(s) == (1, 3), s
        assert int(s.get("cluster_generation", 0)) == 1, s
        steps_go_on(address, int(s["global_step"]))

        # (c) The ps moved: a new ps server, the job's own cluster file rewritten, SIGHUP to
        # the launcher. The checkpoint taken at the request restores into the new ps.
        moved = write_cluster(workdir / "moved-ps.json", chief, [ps_new], [w0, w1, w2])
        servers.append(start_server(workdir, "ps", 0, moved, ps_new))
        write_json_atomic(cluster_file, read_json(moved))
        before = int(status(address)["global_step"])
        job.send_signal(signal.SIGHUP)
        new_ps = f"127.0.0.1:{ps_new}"
        s = wait_running(address, workers=3, generation=2, after=before, ps=new_ps)
        restored = [int(m) for m in RESTORED.findall(log_path.read_text(errors="replace"))]
        assert len(restored) == 2 and restored[-1] >= before, (restored, before)
        # The old ps is out of the job: stopping it stops nothing.
        servers[0].terminate()
        assert servers[0].wait(timeout=30) == 0
        steps_go_on(address, int(s["global_step"]))
        # A reload of the unchanged file (systemctl reload) is one line, and no fresh start.
        job.send_signal(signal.SIGHUP)
        wait_until(
            lambda: "already runs on this cluster" in log_path.read_text(errors="replace"),
            timeout=30,
            what="the unchanged cluster file refused",
        )
        assert int(status(address).get("cluster_generation", 0)) == 2

        # (d) A worker stopped by SIGTERM (a preemption notice: NOT_SERVING, then exit 0)
        # leaves: the job goes on without it in the same process, no failure counted.
        s = status(address)
        before, uptime = int(s["global_step"]), float(s["uptime_seconds"])
        servers[2].terminate()  # worker:1
        s = wait_running(address, workers=2, generation=3, after=before, ps=new_ps)
        (gone,) = [t for t in s["tasks"] if t["address"] == f"127.0.0.1:{w1}"]
        assert gone["state"] in ("TASK_STATE_DRAINING", "TASK_STATE_LEFT"), s["tasks"]
        assert float(s["uptime_seconds"]) > uptime, s  # no new training process
        assert servers[2].wait(timeout=30) == 0

        # (e) ... and started again (`systemctl restart psctl-worker@1`: a SIGTERM, then a
        # start), it is taken back into the job once it serves, as psctl scale would.
        before = int(s["global_step"])
        servers[2] = start_server(workdir, "worker", 1, cluster_file, w1)
        s = wait_running(address, workers=3, generation=4, after=before, ps=new_ps)
        assert f"127.0.0.1:{w1}" in [t["address"] for t in members(s)], s["tasks"]

        stop = control_cli(address, "stop", timeout=150)
        assert stop.returncode == 0, stop.stderr
        assert job.wait(timeout=150) == 0
    finally:
        kill_if_running(job, timeout=30)
        for server in servers:
            kill_if_running(server, timeout=30)
        # The launcher's copies of each generation's cluster file, left behind by it.
        logged = log_path.read_text(errors="replace") if log_path.exists() else ""
        for copies in set(COPIES.findall(logged)):
            shutil.rmtree(copies, ignore_errors=True)
    summary = read_json(out)
    resizes = summary["resizes"]
    assert [(r["from"], r["to"]) for r in resizes] == [
        ("1 ps + 2 workers", "1 ps + 3 workers"),
        ("1 ps + 3 workers", "1 ps + 3 workers"),
        ("1 ps + 3 workers", "1 ps + 2 workers"),
        ("1 ps + 2 workers", "1 ps + 3 workers"),
    ], resizes
    assert (resizes[2]["reason"], resizes[2]["seconds"]) == ("worker:1 left", 0.0), resizes
    assert resizes[3]["reason"] == f"worker 127.0.0.1:{w1} back", resizes
    assert all(resizes[i]["seconds"] > 0 for i in (0, 1, 3)), resizes  # requested: timed
    assert summary["restarts"] == 0 and summary["num_workers"] == 3, summary
    assert summary["worker_failures"] == 0, summary
    assert summary["eval_accuracy"] >= 0.99, summary
    assert processes_mentioning(str(workdir)) == []
