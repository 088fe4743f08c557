"""sd_notify: the watchdog interval systemd asks for, and pings to a real datagram socket."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from psctl.cluster.processes import sdnotify


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),  # another process's
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "thirty"}, None),
    ],
)
def test_watchdog_interval_is_half_the_timeout_for_this_process(env, expected):
    assert sdnotify.watchdog_interval(environ=env) == expected


def test_watchdog_pings_until_stopped(tmp_path: Path):
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(5)
        stop = threading.Event()
        env = {"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "100000"}
        thread = sdnotify.keep_watchdog_fed(stop, environ=env)
        assert thread is not None
        assert [sock.recv(64) for _ in range(3)] == [b"WATCHDOG=1"] * 3
        stop.set()
        thread.join(timeout=5)
        assert not thread.is_alive()
    assert sdnotify.keep_watchdog_fed(threading.Event(), environ={}) is None
