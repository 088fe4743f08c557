"""The TLS transport between hosts (coordinator/deploy/tls.py), tried as an attacker would.

Three network-namespace hosts on one router (bench/harness/netlab.py): a and b are the
cluster (a cluster file naming a:2222 and b:2222), each running `psctl deploy tunnel` with
keys of `psctl deploy keys --transport tls`; c is outside. An echo server stands for b's
TensorFlow port in b's job namespace. From a's job namespace the echo answers (through
stunnel4 on both ends); a capture on b's cable, as a passive observer's, never holds the
bytes sent, while a datagram sent in the clear is seen. From c, plain TCP to b's TF port
gets no echo, nor does c's own tunnel with a key of its own: b's tunnel logs both as
refused, and its state file (what psctl status shows) counts them. A side port (plain on
the host's network, as health is) is reached from a's job namespace as it is.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.harness.netlab import NetLab
from psctl.cluster.tunnel_state import read_state
from psctl.coordinator.deploy.tls import make_psks, tls_conf
from tests.conftest import require_tool
from tests.integration.security.test_multihost import Capture

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PORT = 2222
SIDE_PORT = 2299

ECHO = """
import socket, sys, threading
s = socket.create_server(("0.0.0.0", int(sys.argv[1])))
def echo(c):
    with c:
        while d := c.recv(65536):
            c.sendall(d)
while True:
    threading.Thread(target=echo, args=(s.accept()[0],), daemon=True).start()
"""

SEND = """
import socket, sys
host, port, data = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode()
try:
    c = socket.create_connection((host, port), timeout=5)
    c.settimeout(5)
    c.sendall(data)
    got = b""
    while len(got) < len(data) and (d := c.recv(65536)):
        got += d
    print("echo" if got == data else f"no echo ({got[:40]!r})")
except OSError as err:
    print(type(err).__name__)
"""


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[NetLab]:
    if os.geteuid() != 0:
        pytest.skip("network-namespace hosts need root")
    for tool in ("ip", "stunnel4", "nft", "systemd-socket-activate"):
        require_tool(tool, "tools/ensure-systemd-tools.sh")
    lab = NetLab(["a", "b", "c"], None, tmp_path / "lab", tunnel=True, transport="tls")
    servers: list[subprocess.Popen[bytes]] = []
    try:
        lab.start()
        cluster = {"chief": [f"{lab.hosts['a'].ip}:{PORT}"], "ps": [f"{lab.hosts['b'].ip}:{PORT}"]}
        cluster_file = tmp_path / "cluster.json"
        cluster_file.write_text(json.dumps({"cluster": cluster}))
        lab.start_tunnels(cluster_file, names=["a", "b"])
        for host, port in (("b", PORT), ("c", SIDE_PORT)):  # b's TF port; a side port on c
            servers.append(
                subprocess.Popen(lab.exec_argv(host, [sys.executable, "-c", ECHO, str(port)]))
            )
        yield lab
    finally:
        for server in servers:
            server.kill()
            server.wait()
        lab.stop()


def send(lab: NetLab, host: str, target: str, port: int, data: str, inside: str = "") -> str:
    """What ``host`` (its job namespace when it has one, else ``inside``: a namespace's
    path) gets back sending ``data`` to target:port."""
    argv = lab.exec_argv(host, [sys.executable, "-c", SEND, target, str(port), data])
    if inside:
        argv = ["nsenter", f"--net={inside}", *argv[argv.index(sys.executable) :]]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    return done.stdout.strip() or done.stderr.strip()[-300:]


def until_echo(lab: NetLab, host: str, target: str, port: int, data: str) -> str:
    deadline = time.monotonic() + 20
    while (said := send(lab, host, target, port, data)) != "echo" and time.monotonic() < deadline:
        time.sleep(0.2)
    return said


def test_only_the_clusters_hosts_get_through_and_nothing_crosses_in_the_clear(
    lab: NetLab, tmp_path: Path
):
    a, b, c = (lab.hosts[n] for n in "abc")
    tf_marker = f"psctl-tensor-{os.getpid()}-{time.time_ns()}"
    plain_marker = f"psctl-plain-{os.getpid()}-{time.time_ns()}"
    # The router's end of b's cable.
    capture = Capture(lab.router, f"h{b.number}", [tf_marker.encode(), plain_marker.encode()])
    try:
        # a -> b's TF port: through both tunnels, the bytes back as they were sent.
        assert until_echo(lab, "a", b.ip, PORT, tf_marker) == "echo"
        # The control: a datagram in the clear to b is seen by the same capture.
        subprocess.run(
            lab.exec_argv("c", [sys.executable, "-c",
                                f"import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM)"
                                f".sendto({plain_marker.encode()!r}, ({b.ip!r}, 9))"]),
            check=True, timeout=30,
        )  # fmt: skip
        time.sleep(0.5)
    finally:
        capture.stop()
    assert capture.markers[plain_marker.encode()], f"{capture.frames} frames, not the datagram"
    assert not capture.markers[tf_marker.encode()], "the TF port's bytes crossed in the clear"

    # c, outside the cluster, in plain TCP: the TLS server there answers no echo.
    assert send(lab, "c", b.ip, PORT, "from-c") != "echo"
    # c with a tunnel of its own: a key that is not one of the cluster's, its own identity.
    keys = tmp_path / "c-keys"
    make_psks([c.ip, b.ip], keys)  # b's key here is not b's real one
    conf = tmp_path / "c-tunnel.conf"
    conf.write_text(tls_conf(c.ip, [b.ip], keys))
    conf.chmod(0o600)
    c_cluster = tmp_path / "c-cluster.json"
    c_cluster.write_text(
        json.dumps({"cluster": {"chief": [f"{c.ip}:{PORT}"], "ps": [f"{b.ip}:{PORT}"]}})
    )
    psctl = str(Path(sys.executable).with_name("psctl"))
    log = tmp_path / "c-tunnel.log"
    with log.open("wb") as out:
        own = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{c.ns}", psctl, "deploy", "tunnel",
             "--config", str(conf), "--address", c.ip, "--cluster", str(c_cluster)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while "psctl tunnel: TLS in" not in log.read_text():
            assert own.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert send(lab, "c", b.ip, PORT, "c-tunnel", inside=f"/run/netns/psctl-{c.ip}") != "echo"
        time.sleep(1)
        assert f"psctl tunnel: no TLS connection to {b.ip}:{PORT}" in log.read_text(), (
            log.read_text()
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(own.pid, 9)
        own.wait()
        subprocess.run(["ip", "netns", "del", f"psctl-{c.ip}"], capture_output=True, timeout=30)

    b_log = (lab.work / "tunnel-b.log").read_text()
    assert f"psctl tunnel: refused a TLS connection from {c.ip}:" in b_log, b_log
    assert f"psctl tunnel: {a.ip}: TLS connection up, traffic flows" in b_log, b_log
    deadline = time.monotonic() + 10
    while not (state := read_state(b.ip) or {}).get("refused") and time.monotonic() < deadline:
        time.sleep(0.2)
    sources = {r["source"].split(":")[0]: r["count"] for r in state.get("refused", [])}
    assert sources.get(c.ip, 0) >= 2, state  # plain TCP, then its own tunnel

    # A side port (plain on its host's network, as health and /metrics are): as it is.
    assert until_echo(lab, "a", c.ip, SIDE_PORT, "side") == "echo"


def reload(lab: NetLab, host: str, conf_text: str | None = None) -> None:
    """``systemctl reload psctl-tunnel`` on ``host``: a new tunnel.conf (if given), SIGHUP,
    then its "reloaded" line."""
    index = [name for name in lab.hosts if lab.hosts[name].job_ns].index(host)
    log = lab.work / f"tunnel-{host}.log"
    before = log.read_text().count("psctl tunnel: reloaded")
    if conf_text is not None:
        (lab.work / f"tunnel-{host}.conf").write_text(conf_text)
    os.kill(lab.tunnels[index].pid, signal.SIGHUP)
    deadline = time.monotonic() + 10
    while log.read_text().count("psctl tunnel: reloaded") == before:
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


def test_keys_rotated_and_a_new_port_applied_by_reload_without_a_restart(lab: NetLab):
    """docs/deploy.md's rotation, and a task added on a host: `psctl deploy keys --rotate`,
    each host's new tunnel.conf and a reload; between the two reloads the hosts do not
    reach each other, after both they do, and a TF port added to the cluster file gets its
    listener on reload. The tunnels are never restarted."""
    a, b = lab.hosts["a"], lab.hosts["b"]
    assert until_echo(lab, "a", b.ip, PORT, "before") == "echo"
    keys = lab.work / "keys"
    make_psks([a.ip, b.ip], keys, rotate=True)
    reload(lab, "a", tls_conf(a.ip, [b.ip], keys))
    assert send(lab, "a", b.ip, PORT, "half-way") != "echo"  # b still has the old keys
    reload(lab, "b", tls_conf(b.ip, [a.ip], keys))
    assert until_echo(lab, "a", b.ip, PORT, "after") == "echo"
    # A worker added on b at another port: the cluster file, then both reloads.
    cluster = json.loads((lab.work.parent / "cluster.json").read_text())
    cluster["cluster"]["worker"] = [f"{b.ip}:{PORT + 2}"]
    (lab.work.parent / "cluster.json").write_text(json.dumps(cluster))
    echo = subprocess.Popen(lab.exec_argv("b", [sys.executable, "-c", ECHO, str(PORT + 2)]))
    try:
        for host in ("a", "b"):
            reload(lab, host)
        assert until_echo(lab, "a", b.ip, PORT + 2, "new port") == "echo"
    finally:
        echo.kill()
        echo.wait()
    assert all(t.poll() is None for t in lab.tunnels[:2])
