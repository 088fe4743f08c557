"""psctl local's start-up wait: every server checked at once, one "N of M servers SERVING"
progress line, a bound that grows with the servers' TensorFlow imports. Real gRPC health
services on loopback; the server processes are stand-ins (sleep), no TensorFlow."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from psctl.cluster.health import HealthService
from psctl.coordinator.launch import local
from psctl.coordinator.launch.local import (
    LocalCluster,
    ServerFailed,
    ServerProcess,
    default_start_timeout,
)

pytestmark = pytest.mark.timeout(60)


def test_the_default_start_timeout_grows_with_the_servers() -> None:
    assert default_start_timeout(3, cpus=2) == 120.0
    assert default_start_timeout(17, cpus=2) == 120.0
    assert default_start_timeout(170, cpus=2) == pytest.approx(3 * 1.0 * 170 / 2)
    assert default_start_timeout(1300, cpus=16) > default_start_timeout(170, cpus=16)


@pytest.fixture
def services() -> Iterator[list[HealthService]]:
    started = [HealthService(host="127.0.0.1", port=0) for _ in range(12)]
    yield started
    for service in started:
        service.stop(grace=0)


def servers_for(services: list[HealthService], tmp_path: Path) -> list[ServerProcess]:
    servers = []
    for i, service in enumerate(services):
        proc = subprocess.Popen(["sleep", "60"])
        servers.append(
            ServerProcess("worker", i, "127.0.0.1:1", service.port, 0, tmp_path / "log", proc)
        )
    return servers


def test_many_servers_one_progress_line(
    services: list[HealthService],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(local, "PROGRESS_SECONDS", 60.0)
    cluster = LocalCluster(num_ps=1, num_workers=1, workdir=tmp_path)
    servers = servers_for(services, tmp_path)
    try:
        for service in services[:6]:
            service.set_serving(True)
        caplog.set_level(logging.INFO, logger="psctl.local")

        def later() -> None:
            time.sleep(1.5)
            for service in services[6:]:
                service.set_serving(True)

        threading.Thread(target=later, daemon=True).start()
        started = time.monotonic()
        cluster._wait(servers, timeout=20)
        assert time.monotonic() - started < 5
        lines = [r.getMessage() for r in caplog.records if "servers SERVING" in r.getMessage()]
        assert len(lines) == 1 and lines[0].startswith("12 of 12 servers SERVING"), lines
    finally:
        for server in servers:
            server.proc.kill()
            server.proc.wait()


def test_a_bounded_wait_names_the_servers_still_starting(
    services: list[HealthService], tmp_path: Path
) -> None:
    cluster = LocalCluster(num_ps=1, num_workers=1, workdir=tmp_path)
    servers = servers_for(services, tmp_path)
    try:
        services[0].set_serving(True)
        started = time.monotonic()
        with pytest.raises(ServerFailed, match=r"11 of 12 servers not SERVING after 2s \(worker:1"):
            cluster._wait(servers, timeout=2)
        assert time.monotonic() - started < 5  # one deadline per round, not one per server
    finally:
        for server in servers:
            server.proc.kill()
            server.proc.wait()


def test_the_data_service_ports_are_none_of_those_chosen_before(monkeypatch, tmp_path) -> None:
    """The dispatcher and the data workers' ports are chosen after the servers' ports,
    which are not bound yet: the kernel may hand those out again (seen: the dispatcher
    given the ps's /metrics port; the data workers registered with that HTTP server and
    their servers never started). A stand-in kernel that hands out the lowest free port."""
    handed: list[list[int]] = []

    def free_ports(count: int, host: str = "127.0.0.1", *, avoid=()) -> list[int]:
        found = [p for p in range(40000, 40100) if p not in avoid][:count]
        handed.append(found)
        return found

    monkeypatch.setattr(local.ports, "free_ports", free_ports)
    cluster = LocalCluster(num_ps=1, num_workers=2, workdir=tmp_path, data_service=True)
    servers, service = handed
    assert cluster.dispatcher is not None
    assert set(service) == {
        int(cluster.dispatcher.rsplit(":", 1)[1]),
        *cluster._data_ports.values(),
    }
    assert not set(service) & set(servers), (servers, service)
