"""cluster/health.py's HealthChecker, against real gRPC health services on loopback: every
address checked at once (a round bounded by one deadline), kept channels that see a server
come back at the same address."""

from __future__ import annotations

import socket
import time

import pytest

from psctl.cluster.health import HealthChecker, HealthService
from psctl.cluster.ports import free_ports

pytestmark = pytest.mark.timeout(60)


def test_statuses_and_one_deadline_for_a_round() -> None:
    serving = HealthService(host="127.0.0.1", port=0)
    serving.set_serving(True)
    starting = HealthService(host="127.0.0.1", port=0)  # UNKNOWN (starting) until told
    (dead,) = free_ports(1)
    # Listens but never speaks HTTP/2 (a frozen process): only the deadline ends its check.
    silent = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(3)]
    for sock in silent:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
    addresses = {
        "serving": f"127.0.0.1:{serving.port}",
        "starting": f"127.0.0.1:{starting.port}",
        "dead": f"127.0.0.1:{dead}",
    }
    frozen = [f"127.0.0.1:{s.getsockname()[1]}" for s in silent]
    checker = HealthChecker()
    try:
        started = time.monotonic()
        results = checker.check_all([*addresses.values(), *frozen], timeout=1.0)
        took = time.monotonic() - started
        assert results[addresses["serving"]].status == "SERVING"
        assert results[addresses["starting"]].status == "UNKNOWN"
        assert results[addresses["dead"]].status == "UNREACHABLE"
        assert all(results[a].status == "UNREACHABLE" for a in frozen)
        assert took < 2.5, f"3 frozen servers took {took:.1f}s: checked one after another?"
    finally:
        checker.close()
        serving.stop(grace=0)
        starting.stop(grace=0)
        for sock in silent:
            sock.close()


def test_a_server_back_at_the_same_address_is_seen_soon() -> None:
    first = HealthService(host="127.0.0.1", port=0)
    first.set_serving(True)
    address = f"127.0.0.1:{first.port}"
    checker = HealthChecker()
    try:
        assert checker.check_all([address], timeout=1.0)[address].serving
        first.stop(grace=0)
        time.sleep(3.0)  # the kept channel fails a few reconnects meanwhile
        assert checker.check_all([address], timeout=1.0)[address].status == "UNREACHABLE"
        second = HealthService(host="127.0.0.1", port=first.port)
        second.set_serving(True)
        try:
            deadline = time.monotonic() + 3.0  # reconnect backoff is capped at 1 s
            while not checker.check_all([address], timeout=1.0)[address].serving:
                assert time.monotonic() < deadline, "the restarted server was not seen"
                time.sleep(0.2)
        finally:
            second.stop(grace=0)
    finally:
        checker.close()
