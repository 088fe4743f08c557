"""cluster/health.py's HealthChecker, against real gRPC health services on loopback: every
address checked at once (a round bounded by one deadline), kept channels that see a server
come back at the same address, and each answer naming the server process that gave it."""

from __future__ import annotations

import os
import socket
import time

import pytest

from psctl.cluster.health import HealthChecker, HealthService, served_task_types
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
        # Each answer names the server process (INSTANCE_KEY): the same one twice here.
        first_instance = checker.check_all([address], timeout=1.0)[address].instance
        assert first_instance and first_instance.startswith(f"{os.getpid()}-")
        assert checker.check_all([address], timeout=1.0)[address].instance == first_instance
        first.stop(grace=0)
        time.sleep(3.0)  # the kept channel fails a few reconnects meanwhile
        assert checker.check_all([address], timeout=1.0)[address].status == "UNREACHABLE"
        second = HealthService(host="127.0.0.1", port=first.port)
        second.set_serving(True)
        try:
            deadline = time.monotonic() + 3.0  # reconnect backoff is capped at 1 s
            while not (result := checker.check_all([address], timeout=1.0)[address]).serving:
                assert time.monotonic() < deadline, "the restarted server was not seen"
                time.sleep(0.2)
            assert result.instance and result.instance != first_instance  # a new one
        finally:
            second.stop(grace=0)
    finally:
        checker.close()


def test_servers_name_their_task_type_and_a_swapped_cluster_is_refused() -> None:
    """A ps-server answers the health service psctl.task.ps and a worker-server
    psctl.task.worker, whatever their status; a cluster whose ps address is a worker's
    server is one line, exit 78 (TensorFlow itself would train on it)."""
    from psctl.cluster.errors import ConfigError
    from psctl.coordinator.launch.train import check_server_types
    from psctl.coordinator.operations.task_book import TaskInfo

    ps = HealthService(host="127.0.0.1", port=0, task_type="ps")
    worker = HealthService(host="127.0.0.1", port=0, task_type="worker")
    worker.set_serving(True)
    untyped = HealthService(host="127.0.0.1", port=0)  # not psctl's, or an older psctl's
    (dead,) = free_ports(1)
    at = {name: f"127.0.0.1:{s.port}" for name, s in [("ps", ps), ("w", worker), ("u", untyped)]}
    at["dead"] = f"127.0.0.1:{dead}"
    try:
        assert served_task_types(list(at.values())) == {
            at["ps"]: "ps",
            at["w"]: "worker",
            at["u"]: None,
            at["dead"]: None,
        }

        def task(task_type: str, index: int, health: str) -> TaskInfo:
            return TaskInfo(task_type, index, f"10.0.0.{index + 1}:2222", health, "", 0)

        fine = [task("ps", 0, at["ps"]), task("worker", 0, at["w"]), task("worker", 1, at["u"])]
        check_server_types([*fine, task("ps", 1, at["dead"])], source="c.json")
        with pytest.raises(ConfigError) as err:
            swapped = [task("ps", 0, at["w"]), task("worker", 0, at["ps"])]
            check_server_types(swapped, source="c.json")
        assert str(err.value).startswith(
            "c.json: cluster.ps[0]: 10.0.0.1:2222 is a worker-server, not a ps-server "
            f"(its health service at {at['w']} says so) (and 1 more); give each task"
        ), err.value
    finally:
        for service in (ps, worker, untyped):
            service.stop(grace=0)


def test_psctl_health_marks_a_server_of_the_other_type(tmp_path, capsys) -> None:
    import argparse
    import json

    from psctl.coordinator.operations.client import cmd_health

    ps = HealthService(host="127.0.0.1", port=0, task_type="ps")
    worker = HealthService(host="127.0.0.1", port=0, task_type="worker")
    for service in (ps, worker):
        service.set_serving(True)
    tf_ps, tf_worker, tf_chief = free_ports(3)
    cluster = {
        "cluster": {
            "chief": [f"127.0.0.1:{tf_chief}"],
            "ps": [f"127.0.0.1:{tf_ps}"],
            "worker": [f"127.0.0.1:{tf_worker}"],
        }
    }
    path = tmp_path / "cluster.json"
    args = argparse.Namespace(cluster=str(path), health_port_offset=1000, timeout=1.0)
    try:
        for ps_at, worker_at, code in [(ps, worker, 0), (worker, ps, 69)]:
            health = {"ps": [f"127.0.0.1:{ps_at.port}"], "worker": [f"127.0.0.1:{worker_at.port}"]}
            path.write_text(json.dumps({**cluster, "health": health}))
            assert cmd_health(args) == code
            rows = capsys.readouterr().out.splitlines()[2:]
            statuses = [row.split(maxsplit=4)[4] for row in rows]
            if code == 0:
                assert statuses == ["SERVING", "SERVING"], rows
            else:
                assert statuses == ["SERVING (a worker-server)", "SERVING (a ps-server)"], rows
    finally:
        for service in (ps, worker):
            service.stop(grace=0)


def test_psctl_health_names_a_task_with_no_health_port(tmp_path, capsys) -> None:
    """A server at TF port 65000 has no default health port (66000): its row says so, and
    the command fails, where it used to probe the impossible address."""
    import argparse
    import json

    from psctl.coordinator.operations.client import cmd_health

    ps = HealthService(host="127.0.0.1", port=0, task_type="ps")
    ps.set_serving(True)
    path = tmp_path / "cluster.json"
    cluster = {"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:65000"]}
    path.write_text(json.dumps({"cluster": cluster, "health": {"ps": [f"127.0.0.1:{ps.port}"]}}))
    args = argparse.Namespace(cluster=str(path), health_port_offset=1000, timeout=1.0)
    try:
        assert cmd_health(args) == 69
    finally:
        ps.stop(grace=0)
    rows = [row.split(maxsplit=4) for row in capsys.readouterr().out.splitlines()[2:]]
    assert rows == [
        ["ps", "0", "127.0.0.1:2222", f"127.0.0.1:{ps.port}", "SERVING"],
        ["worker", "0", "127.0.0.1:65000", "-", "NO HEALTH PORT"],
    ], rows
