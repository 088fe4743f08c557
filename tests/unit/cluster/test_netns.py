"""The job's private network namespace (cluster/netns.py), without TensorFlow: a real
holder, real children joining it, a port inside that the host cannot reach."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from psctl.cluster import netns
from psctl.cluster.errors import ConfigError
from psctl.cluster.processes.procs import spawn, stop_processes
from tests.conftest import child_env

pytestmark = pytest.mark.timeout(60)

# A child as a psctl task starts: a side port on the host, then into the job's namespace,
# a port there (TensorFlow's, here a plain listener), then both ports printed.
TASK = """
import socket, sys
from psctl.cluster import netns
side = socket.create_server(("127.0.0.1", 0))
assert netns.enter()
inner = socket.create_server(("127.0.0.1", 0))
print(side.getsockname()[1], inner.getsockname()[1], flush=True)
inner.accept()  # a connection from inside the namespace
sys.stdin.read()
"""


def net_inode(pid: int | str = "thread-self") -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def holder(space: netns.JobNamespace) -> str:
    return space.path.split("/")[2]  # /proc/PID/ns


def test_a_task_is_reached_inside_its_job_namespace_and_not_from_the_host(monkeypatch):
    space = netns.JobNamespace()
    try:
        monkeypatch.setenv(netns.ENV, space.path)
        assert net_inode(holder(space)) != net_inode()
        task = subprocess.Popen(
            [sys.executable, "-c", TASK],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=child_env(**space.environ),
            preexec_fn=netns.join_user,
        )
        try:
            assert task.stdout is not None
            side, inner = (int(p) for p in task.stdout.readline().split())
            socket.create_connection(("127.0.0.1", side), timeout=5).close()  # the host's
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", inner), timeout=5)
            # One thread of this process goes in; the rest of it stays on the host.
            netns.run_inside(lambda: socket.create_connection(("127.0.0.1", inner), 5).close())
            assert net_inode(task.pid) == net_inode(holder(space))
        finally:
            task.kill()
            task.wait()
        assert netns.run_inside(net_inode) == net_inode(holder(space))
        assert net_inode() != net_inode(holder(space))
    finally:
        space.close()


def test_without_a_namespace_nothing_moves(monkeypatch):
    monkeypatch.delenv(netns.ENV, raising=False)
    before = net_inode()
    assert netns.enter() is False
    assert netns.run_inside(net_inode) == before
    netns.join_user()  # nothing to join


def test_children_spawned_by_psctl_join_the_job_namespace(tmp_path: Path, monkeypatch):
    space = netns.JobNamespace()
    try:
        monkeypatch.setenv(netns.ENV, space.path)
        out = tmp_path / "out"
        proc = spawn(
            [sys.executable, "-c", "from psctl.cluster import netns; print(netns.enter())"],
            log_path=out,
            env=child_env(**space.environ),
        )
        assert proc.wait(timeout=30) == 0, out.read_text()
        assert out.read_text().strip() == "True"
        stop_processes([proc])
    finally:
        space.close()


def test_no_unshare_is_one_line_naming_the_way_out(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ConfigError) as err:
        netns.JobNamespace()
    assert "unshare" in str(err.value) and "--open-tf-ports" in str(err.value)
