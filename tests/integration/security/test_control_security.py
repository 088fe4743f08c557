"""The control plane of a real `psctl local` job under attack and load: malformed requests to
every method, another uid without the token, 100 open watch streams, and which ports listen
on every interface."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from psctl.cluster.ports import free_ports
from psctl.control.v1 import control_pb2
from psctl.coordinator.operations.client import Target, call
from psctl.coordinator.operations.security import EXIT_NOT_ALLOWED, token_paths
from tests.conftest import (
    child_env,
    control_cli,
    kill_if_running,
    processes_mentioning,
    psctl_argv,
)

pytestmark = pytest.mark.integration

# Every method a coordinator's control port serves, with its request type.
UNARY = {
    "/psctl.control.v1.Control/GetStatus": control_pb2.GetStatusRequest,
    "/psctl.control.v1.Control/Checkpoint": control_pb2.CheckpointRequest,
    "/psctl.control.v1.Control/Pause": control_pb2.PauseRequest,
    "/psctl.control.v1.Control/Resume": control_pb2.ResumeRequest,
    "/psctl.control.v1.Control/Stop": control_pb2.StopRequest,
    "/grpc.health.v1.Health/Check": health_pb2.HealthCheckRequest,
}
STREAMING = {
    "/psctl.control.v1.Control/WatchStatus": control_pb2.WatchStatusRequest,
    "/grpc.health.v1.Health/Watch": health_pb2.HealthCheckRequest,
}


def malformed(kind: type, rng: random.Random, count: int) -> list[bytes]:
    """``count`` random byte strings that do not parse as ``kind`` (some random bytes are
    valid protobuf: those are left out)."""
    found: list[bytes] = [b"\x07", b"\x08" + b"\xff" * 11, b"\x0a\x7f" + b"x"]
    while len(found) < count:
        body = rng.randbytes(rng.randint(1, 64))
        try:
            kind.FromString(body)
        except DecodeError:
            found.append(body)
    return found


def step(address: str) -> tuple[str, int]:
    status = call(address, "GetStatus", control_pb2.GetStatusRequest())
    return control_pb2.JobState.Name(status.state), status.global_step


def wait_training(address: str, after: int, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state, now = step(address)
            if state == "JOB_STATE_RUNNING" and now > after:
                return now
        except Exception:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the job did not train past step {after} in {timeout}s")


# As another user: the CLI imported first (the interpreter lives under root's home), then
# uid/gid 65534, a home of its own, and psctl's own main().
# Everything the command imports is imported before the uid changes: this checkout and its
# Python may live where uid 65534 cannot read (/root). argparse imports shutil lazily.
AS_NOBODY = """
import os, sys, shutil
from psctl.coordinator.cli.main import main
path = sys.argv[1]
os.setgroups([]); os.setgid(65534); os.setuid(65534)
os.environ["HOME"] = "/nonexistent"; os.environ.pop("XDG_RUNTIME_DIR", None)
try:
    open(path).read()
    print("READ THE TOKEN")
except PermissionError:
    pass
sys.exit(main(sys.argv[2:]))
"""


def listening(pids: list[int]) -> dict[int, set[str]]:
    """Listening TCP ports of ``pids``: {port: {local address as /proc shows it}}."""
    inodes: set[str] = set()
    for pid in pids:
        fds = Path(f"/proc/{pid}/fd")
        try:
            for fd in fds.iterdir():
                try:
                    target = str(fd.readlink())
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    ports: dict[int, set[str]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # LISTEN
                host, port = local.rsplit(":", 1)
                ports.setdefault(int(port, 16), set()).add(host)
    return ports


WILDCARD = {"00000000", "00000000000000000000000000000000"}


@pytest.mark.timeout(420)
def test_control_plane_holds_against_strangers_garbage_and_crowds(workdir: Path):
    (port,) = free_ports(1)
    address = f"127.0.0.1:{port}"
    job = subprocess.Popen(
        psctl_argv(
            "local",
            "--workdir",
            str(workdir),
            "--steps",
            "10000000",
            "--control-address",
            address,
            "--checkpoint-every",
            "1000000",
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=child_env(),
    )
    streams: list = []
    channels: list[grpc.Channel] = []
    try:
        last = wait_training(address, 0, timeout=180)

        # -- exposure: no side port on every interface; TF's own ports cannot help it ----
        tasks = json.loads((workdir / "tasks.json").read_text())
        cluster = json.loads((workdir / "cluster.json").read_text())
        side = {port}
        for task in tasks:
            if task.get("health_address"):
                side.add(int(task["health_address"].rsplit(":", 1)[1]))
            side.add(int(task["metrics_url"].rsplit(":", 1)[1].split("/")[0]))
        tf_ports = {
            int(a.rsplit(":", 1)[1]) for addrs in cluster["cluster"].values() for a in addrs
        }
        ports = listening(processes_mentioning(str(workdir)))
        assert side <= set(ports), f"side ports {side - set(ports)} not listening"
        for side_port in side:
            assert not ports[side_port] & WILDCARD, f"side port {side_port} on every interface"
        wildcard = {p for p, hosts in ports.items() if hosts & WILDCARD}
        assert wildcard <= tf_ports, f"ports on every interface besides TF's: {wildcard}"

        # -- malformed requests: each an error status, with and without the token ----
        token = Target.of(address).token
        assert token
        rng = random.Random(16)
        with grpc.insecure_channel(address) as channel:
            for method, kind in {**UNARY, **STREAMING}.items():
                for body in malformed(kind, rng, 12):
                    for metadata in ([("authorization", f"Bearer {token}")], []):
                        try:
                            if method in STREAMING:
                                stream = channel.unary_stream(method)(
                                    body, timeout=5, metadata=metadata
                                )
                                next(stream)
                                stream.cancel()
                            else:
                                channel.unary_unary(method)(body, timeout=5, metadata=metadata)
                        except grpc.RpcError as err:
                            assert err.code() not in (
                                grpc.StatusCode.OK,
                                grpc.StatusCode.DEADLINE_EXCEEDED,
                                grpc.StatusCode.UNAVAILABLE,
                            ), (method, body, err)
                        else:
                            raise AssertionError(f"{method} accepted {body!r}")
        last = wait_training(address, last)

        # -- another uid: no token, one line, exit 77; the job goes on --------------------
        control_file = str(token_paths(address)[0])
        for command in ("status", "stop", "pause"):
            proc = subprocess.run(
                [sys.executable, "-c", AS_NOBODY, control_file, command, "--address", address],
                capture_output=True,
                text=True,
                timeout=60,
                env=child_env(),
            )
            assert proc.returncode == EXIT_NOT_ALLOWED, proc.stdout + proc.stderr
            assert "READ THE TOKEN" not in proc.stdout
            assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
            assert "UNAUTHENTICATED" in proc.stderr
        last = wait_training(address, last)

        # -- 100 watch streams open: status and stop still answer ---------------------
        request = control_pb2.WatchStatusRequest(interval_seconds=1.0)
        metadata = [("authorization", f"Bearer {token}")]
        for i in range(100):
            if i % 25 == 0:
                channels.append(grpc.insecure_channel(address))
            method = channels[-1].unary_stream(
                "/psctl.control.v1.Control/WatchStatus",
                request_serializer=control_pb2.WatchStatusRequest.SerializeToString,
                response_deserializer=control_pb2.Status.FromString,
            )
            streams.append(method(request, timeout=300, metadata=metadata))
        for stream in streams:
            next(stream)
        started = time.monotonic()
        status = control_cli(address, "status", timeout=60)
        assert status.returncode == 0, status.stderr
        assert "RUNNING" in status.stdout
        assert time.monotonic() - started < 20
        stop = control_cli(address, "stop", "--timeout", "150", timeout=180)
        assert stop.returncode == 0, stop.stderr
        assert job.wait(timeout=60) == 0
    finally:
        for stream in streams:
            stream.cancel()
        for channel in channels:
            channel.close()
        kill_if_running(job)
    assert not token_paths(address)[0].exists()
