"""ps-server / worker-server as real processes: health, SIGTERM, port conflicts, config errors."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.harness.netns_hosts import NotifySocket
from psctl.cluster.health import wait_serving
from psctl.cluster.ports import free_ports
from psctl.coordinator import argv as launch_argv
from tests.conftest import child_env, kill_if_running

pytestmark = pytest.mark.integration


def write_cluster(path: Path, ps_port: int, worker_port: int) -> Path:
    path.write_text(
        json.dumps(
            {"cluster": {"ps": [f"127.0.0.1:{ps_port}"], "worker": [f"127.0.0.1:{worker_port}"]}}
        )
    )
    return path


def server_argv(kind: str, cluster: Path, health: int, metrics: int) -> list[str]:
    return [
        *launch_argv.server_argv(kind),
        "--cluster",
        str(cluster),
        "--index",
        "0",
        "--health-port",
        str(health),
        "--metrics-port",
        str(metrics),
        "--bind-host",
        "127.0.0.1",
    ]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["ps", "worker"])
def test_sigterm_goes_not_serving_then_exits_zero(tmp_path, kind):
    ps_port, worker_port, health, metrics = free_ports(4)
    cluster = write_cluster(tmp_path / "c.json", ps_port, worker_port)
    proc = subprocess.Popen(
        server_argv(kind, cluster, health, metrics),
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert wait_serving(f"127.0.0.1:{health}", timeout=60).serving
        statuses: list[int] = []

        def watch() -> None:
            with grpc.insecure_channel(f"127.0.0.1:{health}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                try:
                    for resp in stub.Watch(health_pb2.HealthCheckRequest(), timeout=20):
                        statuses.append(resp.status)
                except grpc.RpcError:
                    pass

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        deadline = time.monotonic() + 10
        while not statuses and time.monotonic() < deadline:
            time.sleep(0.05)
        assert statuses == [health_pb2.HealthCheckResponse.SERVING]
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=10)
        assert code == 0
        assert time.monotonic() - sent < 5.0
        watcher.join(timeout=10)
        assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses
        assert statuses.index(health_pb2.HealthCheckResponse.NOT_SERVING) > 0
    finally:
        kill_if_running(proc)


def run_with_port_taken(port: int, argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run a server to its end while this process listens on ``port``."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        return subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=50)


@pytest.mark.timeout(60)
def test_port_in_use_is_one_clear_line(tmp_path):
    ps_port, worker_port, health, metrics = free_ports(4)
    cluster = write_cluster(tmp_path / "c.json", ps_port, worker_port)
    proc = run_with_port_taken(ps_port, server_argv("ps", cluster, health, metrics))
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"port {ps_port} is already in use" in lines[0]


@pytest.mark.timeout(60)
def test_health_port_in_use_is_one_clear_line(tmp_path):
    ps_port, worker_port, health, metrics = free_ports(4)
    cluster = write_cluster(tmp_path / "c.json", ps_port, worker_port)
    proc = run_with_port_taken(health, server_argv("worker", cluster, health, metrics))
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "--health-port" in proc.stderr and "already in use" in proc.stderr


BAD_TF_CONFIGS = {
    "not json": ("{cluster", "TF_CONFIG"),
    "no ps": ('{"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0}}', "ps"),
    "bad port": (
        '{"cluster": {"ps": ["h:x"], "worker": ["h:1"]}, "task": {"type": "ps", "index": 0}}',
        "ps[0]",
    ),
    "index out of range": (
        '{"cluster": {"ps": ["h:2"], "worker": ["h:1"]}, "task": {"type": "ps", "index": 3}}',
        "index",
    ),
    "unknown type": (
        '{"cluster": {"ps": ["h:2"], "worker": ["h:1"], "boss": ["h:3"]}, '
        '"task": {"type": "ps", "index": 0}}',
        "boss",
    ),
    "duplicate": (
        '{"cluster": {"ps": ["h:2"], "worker": ["h:2"]}, "task": {"type": "ps", "index": 0}}',
        "h:2",
    ),
    "wrong role": (
        '{"cluster": {"ps": ["h:2"], "worker": ["h:1"]}, "task": {"type": "worker", "index": 0}}',
        "task.type",
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(BAD_TF_CONFIGS))
def test_bad_tf_config_is_one_line_and_status_78(case):
    tf_config, field = BAD_TF_CONFIGS[case]
    proc = subprocess.run(
        launch_argv.server_argv("ps"),
        env=child_env(TF_CONFIG=tf_config),
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 78, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert field in proc.stderr


@pytest.mark.timeout(90)
def test_systemd_watchdog_pings_stop_while_the_server_is_frozen(tmp_path):
    """Under WatchdogSec= (WATCHDOG_USEC): READY=1, then WATCHDOG=1 every half timeout; a
    SIGSTOPped server sends none, which is how systemd finds a frozen server to restart."""
    ps_port, worker_port, health, metrics = free_ports(4)
    cluster = write_cluster(tmp_path / "c.json", ps_port, worker_port)
    notify = NotifySocket(Path(tempfile.mkdtemp(prefix="psctl-wd", dir="/tmp")) / "n.sock")
    env = child_env(NOTIFY_SOCKET=str(notify.path), WATCHDOG_USEC="1000000")
    proc = subprocess.Popen(
        server_argv("ps", cluster, health, metrics),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        alive = lambda: proc.poll() is None  # noqa: E731
        notify.wait_for("READY", "1", count=1, timeout=60, alive=alive)
        notify.wait_for("WATCHDOG", "1", count=3, timeout=10, alive=alive)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(0.7)  # a ping already on its way may still land
        frozen = notify.count("WATCHDOG", "1")
        time.sleep(2.5)  # five half-timeouts
        assert notify.count("WATCHDOG", "1") == frozen
        proc.send_signal(signal.SIGCONT)
        notify.wait_for("WATCHDOG", "1", count=frozen + 2, timeout=10, alive=alive)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        kill_if_running(proc)
        notify.close()
        shutil.rmtree(notify.path.parent, ignore_errors=True)
