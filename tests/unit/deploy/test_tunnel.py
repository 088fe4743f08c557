"""coordinator/deploy/tunnel.py's pure parts: names, wireguard-go's log, peers. The tunnel
itself (root, wireguard-go, namespaces) runs in tests/integration/security/test_multihost.py."""

from __future__ import annotations

import subprocess
import time

import pytest

from bench.harness.netns_hosts import unescape_instance
from psctl.cluster import tunnel_state
from psctl.cluster.errors import ConfigError
from psctl.cluster.tunnel_state import TunnelState
from psctl.control.v1 import control_pb2
from psctl.coordinator.deploy import tunnel
from psctl.coordinator.deploy.plan import escape_instance
from psctl.coordinator.operations.client import format_status, status_dict
from psctl.coordinator.operations.service import tunnel_proto

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


def test_wireguard_go_log_keeps_each_refusal_once_per_source_and_its_errors(
    capsys, tmp_path, monkeypatch
):
    monkeypatch.setattr(tunnel_state, "STATE_DIR", tmp_path / "run")
    state = TunnelState("10.0.0.1", tunnel_state.state_path("10.0.0.1"))
    proc = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(WIREGUARD_GO_OUTPUT.encode())
    proc.stdin.close()
    tunnel._relay_log(proc, state)
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
    # Every refusal counted, in the file the coordinator reads for psctl status.
    written = tunnel_state.read_state("10.0.0.1")
    assert written is not None
    assert {r["source"]: r["count"] for r in written["refused"]} == {
        "": 2, "10.0.0.9:51820": 2, "[fd00::7]:51820": 1}  # fmt: skip
    assert (tmp_path / "run" / "10.0.0.1.json").stat().st_mode & 0o777 == 0o644


def test_psctl_status_shows_the_tunnels_peers_and_refusals(tmp_path, monkeypatch):
    monkeypatch.setattr(tunnel_state, "STATE_DIR", tmp_path)
    assert tunnel_proto("10.0.0.1") is None  # no tunnel on this host: no section
    state = TunnelState("10.0.0.1", tunnel_state.state_path("10.0.0.1"))
    now = time.time()
    state.handshakes({"10.0.0.2": now - 30, "10.0.0.3": 0, "10.0.0.4": now - 1000})
    state.refused("10.0.0.9:51820")
    state.refused("10.0.0.9:51820")
    status = control_pb2.Status(job="j")
    found = tunnel_proto("10.0.0.1")
    assert found is not None
    status.tunnel.CopyFrom(found)
    text = format_status(status).splitlines()
    assert "tunnel 10.0.0.1: 1 of 3 peers up (no recent handshake: 10.0.0.3, 10.0.0.4)" in text
    refused = [line for line in text if line.startswith("tunnel refused")]
    assert len(refused) == 1 and refused[0].startswith(
        "tunnel refused 2 handshake(s) from 10.0.0.9:51820, last 0s ago"), refused  # fmt: skip
    (shown,) = status_dict(status)["tunnel"]["refused"]
    assert shown["source"] == "10.0.0.9:51820" and shown["count"] == 2, shown  # a number
    # A tunnel process that stopped writing (crashed): said so, instead of stale peers.
    status.tunnel.updated_unix_seconds = now - 100
    assert any("has not reported for 100s" in line for line in format_status(status).splitlines())
    (tmp_path / "10.0.0.5.json").write_text("[1, 2]")
    assert tunnel_proto("10.0.0.5") is None


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


@pytest.mark.parametrize(
    ("route", "link", "mtu"),
    [
        ("10.0.0.2 dev eth0 src 10.0.0.1 uid 0", "2: eth0: <UP> mtu 1500 qdisc", 1420),
        ("10.0.0.2 dev eth0 src 10.0.0.1 uid 0", "2: eth0: <UP> mtu 9000 qdisc", 8920),
        ("10.0.0.2 via 10.0.0.254 dev eth0 mtu 1400", "2: eth0: <UP> mtu 9000 qdisc", 1320),
        ("", "", tunnel.DEFAULT_MTU),  # no route to the peer: wireguard-go's own
    ],
)
def test_the_tunnels_mtu_is_the_paths_less_wireguards_overhead(monkeypatch, route, link, mtu):
    def fake_ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        out = route if args[:2] == ("route", "get") else link
        return subprocess.CompletedProcess(["ip", *args], 0 if out else 2, out, "")

    monkeypatch.setattr(tunnel, "_ip", fake_ip)
    peers = [tunnel.Peer("key=", ("10.0.0.2/32",), "10.0.0.2:51820")]
    assert tunnel.tunnel_mtu(peers) == mtu
