"""Where side ports listen by default, and /metrics over HTTPS (a real server, port 0)."""

from __future__ import annotations

import http.client
import ssl
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge

from psctl.cluster.errors import ConfigError
from psctl.cluster.metrics import serve_metrics
from psctl.cluster.ports import free_ports
from psctl.cluster.server import bind_host
from tests.unit.test_control_auth import make_certs

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
