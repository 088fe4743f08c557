"""coordinator/deploy/tunnel.py's pure parts: names, wireguard-go's log, peers. The tunnel
itself (root, wireguard-go, namespaces) runs in tests/integration/test_multihost.py."""

from __future__ import annotations

import subprocess

import pytest

from psctl.cluster.errors import ConfigError
from psctl.coordinator.deploy import tunnel
from psctl.coordinator.deploy.plan import escape_instance
from tests.integration.netns_hosts import unescape_instance

WIREGUARD_GO_OUTPUT = """\
+------------------------------------------------------+
|   Running wireguard-go is not required because this  |
+------------------------------------------------------+
DEBUG: (wgp0) 2026/12/05 21:58:11 Starting wireguard-go version 0.0.20220316
DEBUG: (wgp0) 2026/12/05 21:58:12 Received invalid initiation message from 10.0.0.9:51820
DEBUG: (wgp0) 2026/12/05 21:58:13 peer(Ab1c…) - Sending keepalive packet
DEBUG: (wgp0) 2026/12/05 21:58:17 Received invalid initiation message from 10.0.0.9:51820
DEBUG: (wgp0) 2026/12/05 21:58:18 Received invalid initiation message from [fd00::7]:51820
DEBUG: (wgp0) 2026/12/05 21:58:18 Received packet with invalid mac1
DEBUG: (wgp0) 2026/12/05 21:58:19 Received packet with invalid mac1
ERROR: (wgp0) 2026/12/05 21:58:19 Failed to bind UAPI socket
"""


def test_wireguard_go_log_keeps_each_refusal_once_per_source_and_its_errors(capsys):
    proc = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(WIREGUARD_GO_OUTPUT.encode())
    proc.stdin.close()
    tunnel._relay_log(proc)
    proc.wait(5)
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        *(
            f"psctl tunnel: refused a handshake from {source}: its key is not one of this "
            "cluster's (a host outside it, or one whose new keys are not reloaded here)"
            for source in ("10.0.0.9:51820", "[fd00::7]:51820")
        ),
        "psctl tunnel: refused a handshake made for another key than this host's (its "
        "sender has other keys of this cluster's hosts)",
    ]
    error = "ERROR: (wgp0) 2026/12/05 21:58:19 Failed to bind UAPI socket"
    assert err == f"psctl tunnel: wireguard-go: {error}\n"


@pytest.mark.parametrize(
    "host", ["10.0.0.3", "fd00::1234:5678:9abc", "[fd00::1]", "255.255.255.255"]
)
def test_names_fit_the_kernel_and_differ_per_host(host: str):
    name = tunnel.interface_name(host)
    assert len(name) <= 15 and name.startswith("wgp"), name  # IFNAMSIZ - 1
    assert name != tunnel.interface_name("10.0.0.4")
    assert tunnel.netns_name(host) == f"psctl-{host.strip('[]')}"


def test_a_host_name_is_refused_where_the_tunnel_needs_an_address():
    with pytest.raises(ConfigError, match=r"^--address: 'ps-1.example' is not an IP address"):
        tunnel.netns_name("ps-1.example")


@pytest.mark.parametrize("address", ["10.0.0.3:3222", "127.0.0.1:7070", "[fd00::1]:4222"])
def test_a_proxy_instance_is_escaped_and_back(address: str):
    instance = escape_instance(address)
    assert ":" not in instance and "[" not in instance, instance
    assert unescape_instance(instance) == address
