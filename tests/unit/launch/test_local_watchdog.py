"""psctl local's frozen-server watchdog, against real processes serving gRPC health (no
TensorFlow): a frozen one is killed, a healthy one and one that never answered are not."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from psctl.cluster.ports import free_ports
from psctl.coordinator.launch.local import FrozenServerWatchdog, ServerProcess
from tests.conftest import child_env

pytestmark = pytest.mark.timeout(60)

HEALTH_SERVER = """
import sys, time
from psctl.cluster.health import HealthService
health = HealthService(host="127.0.0.1", port=int(sys.argv[1]))
health.set_serving(True)
print("ready", flush=True)
time.sleep(120)
"""


def start(port: int, tmp_path: Path, *, serve: bool = True) -> ServerProcess:
    code = HEALTH_SERVER if serve else "import time; print('ready', flush=True); time.sleep(120)"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(port)], stdout=subprocess.PIPE, env=child_env()
    )
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    return ServerProcess("worker", port, f"127.0.0.1:{port}", port, 0, tmp_path / "log", proc)


def test_a_frozen_server_is_killed_and_no_other(tmp_path: Path) -> None:
    ports = free_ports(3)
    servers = [start(ports[0], tmp_path), start(ports[1], tmp_path)]
    silent = start(ports[2], tmp_path, serve=False)  # never answered: still starting, say
    watchdog = FrozenServerWatchdog(lambda: [*servers, silent], timeout=2.0, interval=0.2)
    try:
        watchdog.check()  # both answer: armed
        servers[1].proc.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        watchdog.start()
        servers[1].proc.wait(timeout=20)
        took = time.monotonic() - frozen_at
        assert servers[1].proc.returncode == -signal.SIGKILL
        assert 2.0 <= took < 10.0, took
        time.sleep(1.0)
        assert servers[0].proc.poll() is None and silent.proc.poll() is None
        assert watchdog.killed == [servers[1].name]
    finally:
        watchdog.stop()
        for server in [*servers, silent]:
            server.proc.kill()
            server.proc.wait()
            assert server.proc.stdout is not None
            server.proc.stdout.close()


def test_a_failed_look_does_not_end_the_watch(tmp_path: Path, caplog) -> None:
    ports = free_ports(1)
    server = start(ports[0], tmp_path)
    failures = [RuntimeError("can't start new thread")] * 3  # a machine out of threads

    def servers() -> list[ServerProcess]:
        if failures:
            raise failures.pop()
        return [server]

    watchdog = FrozenServerWatchdog(servers, timeout=2.0, interval=0.2)
    try:
        watchdog.start()
        deadline = time.monotonic() + 10
        while failures and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # armed: it answered a look after the failures
        server.proc.send_signal(signal.SIGSTOP)
        server.proc.wait(timeout=20)
        assert server.proc.returncode == -signal.SIGKILL
        said = [r.getMessage() for r in caplog.records if "a check failed" in r.getMessage()]
        assert said == [
            "frozen-server watchdog: a check failed (can't start new thread); trying again"
        ]
    finally:
        watchdog.stop()
        server.proc.kill()
        server.proc.wait()
