"""Where side ports listen by default, and /metrics over HTTPS (a real server, port 0)."""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge

from psctl.cluster.errors import ConfigError
from psctl.cluster.metrics import serve_metrics
from psctl.cluster.ports import free_ports
from psctl.cluster.server import bind_host
from tests.unit.operations.test_control_auth import make_certs

pytestmark = pytest.mark.timeout(60)


def test_bind_host_is_the_flag_the_environment_or_the_tasks_own_address():
    assert bind_host("10.0.0.9", {"PSCTL_BIND_HOST": "10.0.0.8"}, "127.0.0.1") == "10.0.0.9"
    assert bind_host(None, {"PSCTL_BIND_HOST": "0.0.0.0"}, "127.0.0.1") == "0.0.0.0"
    assert bind_host(None, {}, "127.0.0.1") == "127.0.0.1"
    assert bind_host(None, {}, "localhost") in ("127.0.0.1", "::1")
    # Never every interface unasked: an address of another machine is a clear error.
    with pytest.raises(ConfigError, match="PSCTL_BIND_HOST"):
        bind_host(None, {}, "192.0.2.1")
    with pytest.raises(ConfigError, match="--bind-host"):
        bind_host(None, {}, "no-such-host.invalid")


def test_metrics_over_https(tmp_path: Path):
    files = make_certs(tmp_path)
    registry = CollectorRegistry()
    Gauge("psctl_test_value", "A test value.", registry=registry).set(7)
    (port,) = free_ports(1)
    serve_metrics(
        registry,
        host="127.0.0.1",
        port=port,
        certfile=str(files["server.pem"]),
        keyfile=str(files["server.key"]),
    )
    context = ssl.create_default_context(cafile=str(files["ca.pem"]))
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", context=context) as reply:
        assert "psctl_test_value 7.0" in reply.read().decode()
    with pytest.raises((OSError, http.client.HTTPException)):  # plain HTTP: no answer
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    with pytest.raises(ConfigError, match="give both"):
        serve_metrics(registry, host="127.0.0.1", port=0, certfile=str(files["server.pem"]))


def test_health_over_tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from psctl.cluster import health

    files = make_certs(tmp_path)
    service = health.HealthService(
        host="127.0.0.1",
        port=0,
        tls_cert=str(files["server.pem"]),
        tls_key=str(files["server.key"]),
    )
    try:
        service.set_serving(True)
        address = f"127.0.0.1:{service.port}"
        monkeypatch.delenv(health.TLS_CA_ENV, raising=False)
        assert health.check(address, timeout=3).status == "UNREACHABLE"  # plaintext: refused
        monkeypatch.setenv(health.TLS_CA_ENV, str(files["ca.pem"]))
        assert health.check(address, timeout=5).serving
    finally:
        service.stop(grace=0)


def _options(tmp_path: Path, cluster: dict, index: int, *flags: str, health: dict | None = None):
    from psctl.cluster import server

    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"cluster": cluster, **({"health": health} if health else {})}))
    args = server.build_parser("worker").parse_args(
        ["--cluster", str(path), "--index", str(index), "--metrics-port", "0", *flags]
    )
    return server.resolve_options("worker", args, {})


def test_threads_per_op_share_the_cpus_of_the_tasks_on_one_host(tmp_path: Path, monkeypatch):
    from psctl.cluster import server

    monkeypatch.setattr(server.os, "cpu_count", lambda: 16)
    p = free_ports(4)
    loopback = {
        "chief": [f"localhost:{p[0]}"],
        "ps": [f"127.0.0.1:{p[1]}"],
        "worker": [f"127.0.0.1:{p[2]}", f"127.0.0.2:{p[3]}"],
    }
    # psctl local: every task on this machine (loopback names and addresses alike).
    assert _options(tmp_path, loopback, 0).intra_op_threads == 16 // 4
    hosts = {"ps": ["192.0.2.1:2222"], "worker": [f"127.0.0.1:{p[0]}", "192.0.2.2:2222"]}
    assert _options(tmp_path, hosts, 0).intra_op_threads == 16  # a host of its own
    assert _options(tmp_path, hosts, 0, "--intra-op-threads", "3").intra_op_threads == 3
    assert _options(tmp_path, hosts, 0, "--intra-op-threads", "0").intra_op_threads == 0
    with pytest.raises(ConfigError, match="--intra-op-threads"):
        _options(tmp_path, hosts, 0, "--intra-op-threads", "-1")
    monkeypatch.setattr(server.os, "cpu_count", lambda: 2)
    assert _options(tmp_path, loopback, 1).intra_op_threads == 1  # never 0 (TF's "all")


def test_idle_threads_spin_only_where_a_task_has_its_host_to_itself(tmp_path: Path):
    p = free_ports(3)
    loopback = {"ps": [f"127.0.0.1:{p[0]}"], "worker": [f"localhost:{p[1]}", f"127.0.0.1:{p[2]}"]}
    hosts = {"ps": ["192.0.2.1:2222"], "worker": [f"127.0.0.1:{p[0]}", "192.0.2.2:2222"]}
    assert _options(tmp_path, loopback, 0).thread_spinning is False  # psctl local
    assert _options(tmp_path, hosts, 0).thread_spinning is True
    assert _options(tmp_path, hosts, 0, "--thread-spinning", "off").thread_spinning is False
    assert _options(tmp_path, loopback, 0, "--thread-spinning", "on").thread_spinning is True


@pytest.mark.parametrize(
    ("task_type", "argv", "flag"),
    [
        ("ps", ["--thread-spinning", "maybe"], "--thread-spinning"),
        ("worker", ["--intra-op-threads", "x"], "--intra-op-threads"),
        ("worker", ["--index", "1", "--no-such-flag"], "--no-such-flag"),
    ],
)
def test_a_bad_server_command_line_is_one_line_and_2(capsys, task_type, argv, flag):
    from psctl.cluster import server

    with pytest.raises(SystemExit) as exit_:
        server.build_parser(task_type).parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{task_type}-server: error: ") and err.count("\n") == 1, err
    assert flag in err and f"'{task_type}-server --help'" in err and "usage:" not in err


@pytest.mark.parametrize(
    ("task", "server_type", "fix"),
    [
        ("chief", "worker", "the chief task is the coordinator: run `psctl train` for it"),
        ("evaluator", "ps", "psctl has no server for 'evaluator' tasks"),
        ("worker", "ps", "run worker-server for this task"),
    ],
)
def test_a_task_of_another_type_names_the_command_that_exists(task, server_type, fix):
    """Only ps-server and worker-server exist: the fix never names a chief-server."""
    from psctl.cluster import server

    p = free_ports(4)
    cluster = {
        "chief": [f"127.0.0.1:{p[0]}"],
        "ps": [f"127.0.0.1:{p[1]}"],
        "worker": [f"127.0.0.1:{p[2]}"],
        "evaluator": [f"127.0.0.1:{p[3]}"],
    }
    tf_config = json.dumps({"cluster": cluster, "task": {"type": task, "index": 0}})
    args = server.build_parser(server_type).parse_args(["--metrics-port", "0"])
    with pytest.raises(ConfigError) as err:
        server.resolve_options(server_type, args, {"TF_CONFIG": tf_config})
    assert err.value.field == "TF_CONFIG.task.type"
    assert err.value.fix == f"{fix}, or set task.type to {server_type!r}"


def test_health_port_comes_from_the_flag_the_cluster_files_section_or_tf_port_plus_1000(
    tmp_path: Path,
):
    """The cluster file's "health" section, which psctl health and status follow: a server
    started with that file and no --health-port listened at TF port + 1000 instead, so
    both showed it UNREACHABLE."""
    cluster = {"ps": ["127.0.0.1:2220"], "worker": ["127.0.0.1:2230", "127.0.0.1:2231"]}
    section = {"worker": ["127.0.0.1:2330", "127.0.0.1:7331"]}
    assert _options(tmp_path, cluster, 1, health=section).health_port == 7331
    assert _options(tmp_path, cluster, 1, "--health-port", "7400", health=section).health_port == (
        7400
    )
    assert _options(tmp_path, cluster, 1).health_port == 3231
