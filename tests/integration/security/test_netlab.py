"""bench/harness/netlab.py: namespace hosts through a router, with and without the delaying relay.
An echo server on one host, a client on another; the round trip is measured over a real
TCP connection (bench/harness/relay.c, built here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.harness.netlab import NetLab, parse_rtt, rtt_label

pytestmark = pytest.mark.integration

ECHO = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 2222)); s.listen(); s.settimeout(20)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (d := c.recv(100)):
    c.sendall(d)
"""

# Until the echo server answers: the relay accepts at once, and closes the connection when
# it cannot reach the echo server yet (seen: BrokenPipeError on a loaded machine).
PING = """
import socket, sys, time
host = sys.argv[1]
def echoing():
    try:
        c = socket.create_connection((host, 2222), timeout=5)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.settimeout(5)
        c.sendall(b"x")
        if c.recv(10) == b"x":
            return c
        c.close()
    except OSError:
        pass
    time.sleep(0.05)
for _ in range(200):
    if (c := echoing()) is not None:
        break
else:
    sys.exit(f"no echo from {host}:2222")
times = []
for _ in range(200):
    t = time.perf_counter(); c.sendall(b"x"); c.recv(10); times.append(time.perf_counter() - t)
print(sorted(times)[len(times) // 2] * 1000)
"""


def _median_rtt_ms(rtt: float | None, work) -> float:
    lab = NetLab(["a", "b"], rtt, work)
    try:
        lab.start()
        echo = subprocess.Popen(lab.exec_argv("b", [sys.executable, "-c", ECHO]))
        try:
            host = lab.dial("b").split(":")[0]
            done = subprocess.run(
                lab.exec_argv("a", [sys.executable, "-c", PING, host]),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 0, done.stderr
            return float(done.stdout)
        finally:
            echo.kill()
            echo.wait()
    finally:
        lab.stop()


@pytest.mark.timeout(120)
def test_the_relay_adds_the_round_trip_time_and_direct_does_not(tmp_path):
    direct = _median_rtt_ms(None, tmp_path / "direct")
    delayed = _median_rtt_ms(4.0, tmp_path / "delayed")
    assert direct < 2.0, direct
    assert 4.0 <= delayed < 4.0 + max(2.0, 3 * direct), (direct, delayed)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "psrtt" not in names  # every namespace deleted


def test_rtt_flags_parse():
    assert parse_rtt("0,1, direct") == [0.0, 1.0, None]
    assert [rtt_label(r) for r in parse_rtt("0.5,direct")] == ["0.5 ms", "direct"]
    for bad in ("fast", "-1", "5000"):
        with pytest.raises(ValueError, match="--rtt"):
            parse_rtt(bad)
