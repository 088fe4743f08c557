"""Who may use the control API: tokens over a real gRPC server (port 0), their per-user
files, the CLI's one-line refusals, the stream bound, TLS, and the loopback rule."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from psctl.cluster.errors import ConfigError
from psctl.control.v1 import control_pb2, control_pb2_grpc
from psctl.coordinator.operations.client import ControlError, Target, call
from psctl.coordinator.operations.job_state import JobControl
from psctl.coordinator.operations.security import (
    EXIT_NOT_ALLOWED,
    MAX_STREAMS,
    ControlSecurity,
    PublishedTokens,
    Tokens,
    address_key,
    token_paths,
)
from psctl.coordinator.operations.service import (
    ControlServer,
    start_control_server,
    stop_control_server,
)
from psctl.coordinator.operations.state import State
from psctl.coordinator.operations.task_book import TaskInfo
from tests.conftest import child_env, psctl_argv

pytestmark = pytest.mark.timeout(60)

CONTROL = "/psctl.control.v1.Control/"
UNARY = ("GetStatus", "Checkpoint", "Pause", "Resume", "Stop")


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's own runtime directory for token files."""
    base = tmp_path / "xdg"
    base.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    for name in ("PSCTL_CONTROL_TOKEN_FILE", "PSCTL_CONTROL_TLS_CA", "PSCTL_CONTROL_TLS_CERT"):
        monkeypatch.delenv(name, raising=False)
    return base / "psctl"


def new_control() -> JobControl:
    control = JobControl(
        job="unit",
        target_steps=100,
        steps_per_execution=1,
        can_checkpoint=True,
        tasks=[TaskInfo("chief", 0, "127.0.0.1:1")],
    )
    control.set_state(State.RUNNING)
    return control


@pytest.fixture
def server():
    server = ControlServer(new_control(), "127.0.0.1:0")
    server.start()
    yield server
    server.stop(grace=0)


def raw(address: str, method: str, body: bytes, token: str | None, **kw) -> grpc.StatusCode:
    """One call of ``method`` with ``body`` as the request bytes; its status code."""
    metadata = [("authorization", f"Bearer {token}")] if token else []
    with grpc.insecure_channel(address) as channel:
        if method == "WatchStatus":
            stream = channel.unary_stream(CONTROL + method)(body, timeout=5, metadata=metadata)
            try:
                next(stream)
            except grpc.RpcError as err:
                return err.code()
            stream.cancel()
            return grpc.StatusCode.OK
        try:
            channel.unary_unary(CONTROL + method)(body, timeout=5, metadata=metadata, **kw)
        except grpc.RpcError as err:
            return err.code()
        return grpc.StatusCode.OK


def test_every_control_method_needs_the_token(server):
    for method in (*UNARY, "WatchStatus"):
        assert raw(server.address, method, b"", None) == grpc.StatusCode.UNAUTHENTICATED, method
        assert raw(server.address, method, b"", "x" * 43) == grpc.StatusCode.UNAUTHENTICATED
        assert raw(server.address, method, b"", "Bearer") == grpc.StatusCode.UNAUTHENTICATED
    assert not server._control.stop_requested.is_set()
    assert not server._control.pause_requested
    assert raw(server.address, "GetStatus", b"", server.tokens.control) == grpc.StatusCode.OK


def test_the_read_only_token_reads_but_cannot_act(server):
    read = server.tokens.read
    assert raw(server.address, "GetStatus", b"", read) == grpc.StatusCode.OK
    assert raw(server.address, "WatchStatus", b"", read) == grpc.StatusCode.OK
    for method in ("Checkpoint", "Pause", "Resume", "Stop"):
        assert raw(server.address, method, b"", read) == grpc.StatusCode.PERMISSION_DENIED
    assert not server._control.stop_requested.is_set()
    assert raw(server.address, "Stop", b"", server.tokens.control) == grpc.StatusCode.OK
    assert server._control.stop_requested.is_set()


def test_health_check_needs_no_token(server):
    with grpc.insecure_channel(server.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_grpc_port_that_is_not_a_coordinator_is_named_so(runtime: Path):
    """A server's health (or TensorFlow) port answers gRPC but not the Control API: the
    client says so and exits 69 (no coordinator there), not a bare UNIMPLEMENTED."""
    other = grpc.server(ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), other)
    port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    try:
        with pytest.raises(ControlError) as err:
            call(f"127.0.0.1:{port}", "GetStatus", control_pb2.GetStatusRequest(), timeout=5)
    finally:
        other.stop(grace=0)
    assert err.value.exit_status == 69
    assert str(err.value) == (
        f"no coordinator at 127.0.0.1:{port}: it answers gRPC but not psctl's Control API (a "
        "server's TensorFlow or health port?); give the job's --control-address"
    )


def test_token_files_are_private_and_found_by_address(runtime: Path):
    tokens = Tokens.generate()
    published = PublishedTokens("localhost:7071", tokens)
    control, read = token_paths("127.0.0.1:7071")
    assert (published.control_path, published.read_path) == (control, read)
    assert address_key("[::1]:7071") == address_key("127.0.0.1:7071")
    assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
    for path in (control, read):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert path.stat().st_uid == os.getuid()
    assert control.read_text().strip() == tokens.control
    assert Target.of("127.0.0.1:7071").token == tokens.control
    # Only the read-only token present: the client sends that one.
    control.unlink()
    assert Target.of("localhost:7071").token == tokens.read
    published.remove()
    assert not read.exists()


def test_without_a_token_of_its_own_the_client_takes_the_coordinator_units(
    runtime: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Root on the coordinator's host (deploy.md): the unit writes its token under its state
    directory (its HOME), not in root's runtime directory; the client finds it there."""
    from psctl.coordinator.operations import security

    monkeypatch.setattr(security, "SERVICE_STATE_DIR", str(tmp_path / "var-lib-psctl"))
    unit_dir = security.service_runtime_dir()
    unit_dir.mkdir(parents=True, mode=0o700)
    control, _ = token_paths("127.0.0.1:7072", directory=unit_dir)
    control.write_text("the-units-token\n")
    assert Target.of("127.0.0.1:7072").token == "the-units-token"
    # This user's own token for the address comes first.
    PublishedTokens("127.0.0.1:7072", Tokens("mine", "mine-read"))
    assert Target.of("127.0.0.1:7072").token == "mine"


def test_another_uid_cannot_read_the_token(runtime: Path, tmp_path: Path):
    published = PublishedTokens("127.0.0.1:7072", Tokens.generate())
    assert stat.S_IMODE(published.control_path.stat().st_mode) == 0o600
    if os.getuid() != 0:  # a normal user cannot switch uid; the mode above is the check
        return
    # Even with every directory on the way open, the file's own mode keeps uid 65534 out.
    for path in (tmp_path, runtime.parent, runtime):
        path.chmod(0o755)
    # setpriv, not subprocess's user=: that makes Python fork() (no vfork) in a process with
    # gRPC's threads, whose fork handler can wait for a thread that waits for the GIL (seen:
    # the suite hung here in CI, beyond pytest-timeout's reach).
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    proc = subprocess.run(
        [*nobody, "cat", str(published.control_path)],
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert proc.returncode != 0
    assert "Permission denied" in proc.stderr
    assert published.tokens.control not in proc.stdout


def test_a_file_of_another_job_is_not_removed(runtime: Path):
    first = PublishedTokens("127.0.0.1:7073", Tokens.generate())
    second = PublishedTokens("127.0.0.1:7073", Tokens.generate())
    first.remove()
    assert second.control_path.read_text().strip() == second.tokens.control


def cli(address: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        psctl_argv(*args, "--address", address),
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )


def test_cli_finds_the_token_and_refuses_in_one_line(runtime: Path, tmp_path: Path):
    server = start_control_server(new_control(), "127.0.0.1:0", ControlSecurity())
    try:
        env = child_env(XDG_RUNTIME_DIR=str(runtime.parent))
        ok = cli(server.address, "status", "--json", env=env)
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout)["state"] == "JOB_STATE_RUNNING"
        empty = tmp_path / "other-user"
        empty.mkdir()
        for command in ("status", "stop", "pause"):
            denied = cli(server.address, command, env=child_env(XDG_RUNTIME_DIR=str(empty)))
            assert denied.returncode == EXIT_NOT_ALLOWED, denied.stderr
            assert denied.stderr.count("\n") == 1 and "Traceback" not in denied.stderr
            assert "UNAUTHENTICATED" in denied.stderr
        read_only = cli(
            server.address,
            "stop",
            "--control-token-file",
            str(server.published.read_path),
            env=env,
        )
        assert read_only.returncode == EXIT_NOT_ALLOWED
        assert "PERMISSION_DENIED" in read_only.stderr
        assert not server._control.stop_requested.is_set()
    finally:
        stop_control_server(server, grace=0)
    assert not server.published.control_path.exists()


def test_streams_are_bounded_and_unary_calls_still_answer(server):
    """MAX_STREAMS watch streams held open: status and stop still answer at once; one more
    stream is RESOURCE_EXHAUSTED, naming the bound."""
    metadata = [("authorization", f"Bearer {server.tokens.read}")]
    request = control_pb2.WatchStatusRequest(interval_seconds=1.0)
    channels, streams = [], []
    try:
        for i in range(MAX_STREAMS):
            if i % 32 == 0:  # a few connections, as many clients would
                channels.append(grpc.insecure_channel(server.address))
                stub = control_pb2_grpc.ControlStub(channels[-1])
            streams.append(stub.WatchStatus(request, timeout=30, metadata=metadata))
        for stream in streams:
            next(stream)
        assert server.auth.open_streams == MAX_STREAMS
        extra = stub.WatchStatus(request, timeout=5, metadata=metadata)
        with pytest.raises(grpc.RpcError) as err:
            next(extra)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(MAX_STREAMS) in err.value.details()
        target = Target(server.address, ControlSecurity(), server.tokens.control)
        started = time.monotonic()
        for _ in range(10):
            call(target, "GetStatus", control_pb2.GetStatusRequest(), timeout=2)
        assert time.monotonic() - started < 5.0
        call(target, "Stop", control_pb2.StopRequest(), timeout=2)
        assert server._control.stop_requested.is_set()
    finally:
        for stream in streams:
            stream.cancel()
        for channel in channels:
            channel.close()
    # Cancelled streams give their slots back promptly.
    deadline = time.monotonic() + 10
    while server.auth.open_streams and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.auth.open_streams == 0


def test_off_loopback_needs_tls_and_a_token_file():
    with pytest.raises(ConfigError, match=r"--control-tls-cert.*--control-token-file"):
        ControlSecurity().check_server("10.1.2.3:7070")
    with pytest.raises(ConfigError, match="not loopback"):
        ControlSecurity(token_file="t").check_server("0.0.0.0:7070")
    ControlSecurity().check_server("127.0.0.1:7070")
    ControlSecurity().check_server("[::1]:7070")
    ControlSecurity(insecure=True).check_server("0.0.0.0:7070")
    ControlSecurity(tls_cert="c", tls_key="k", token_file="t").check_server("10.1.2.3:7070")
    with pytest.raises(ConfigError, match="give both"):
        ControlSecurity(tls_cert="c").check_server("127.0.0.1:7070")


@pytest.mark.parametrize("command", ["train", "local"])
def test_cli_refuses_a_plaintext_control_address_off_loopback(tmp_path: Path, command: str):
    cluster = tmp_path / "cluster.json"
    cluster.write_text(
        json.dumps(
            {
                "cluster": {
                    "chief": ["127.0.0.1:1"],
                    "ps": ["127.0.0.1:2"],
                    "worker": ["127.0.0.1:3"],
                }
            }
        )
    )
    args = ["--cluster", str(cluster)] if command == "train" else ["--workdir", str(tmp_path)]
    env = child_env(XDG_RUNTIME_DIR=str(tmp_path))
    proc = subprocess.run(
        psctl_argv(command, *args, "--control-address", "0.0.0.0:0"),
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 78, proc.stderr
    assert proc.stderr.count("\n") == 1 and "--insecure-control" in proc.stderr
    assert not list(tmp_path.glob("psctl/*.token"))


def make_certs(base: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, by openssl."""
    openssl = shutil.which("openssl")
    assert openssl, "openssl is needed for the TLS tests (apt-get install openssl)"

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, timeout=30, cwd=base)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=psctl test CA",
    )
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "")):
        run(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
        )
        (base / f"{name}.ext").write_text(ext + "\n" if ext else "basicConstraints=CA:FALSE\n")
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "1",
            "-extfile",
            f"{name}.ext",
        )
    return {n: base / n for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


@pytest.mark.timeout(120)
def test_tls_and_mutual_tls(tmp_path: Path):
    files = make_certs(tmp_path)
    token_file = tmp_path / "control.token"
    token_file.write_text("a-token-of-the-operators-0123456789\n")
    security = ControlSecurity(
        token_file=str(token_file),
        tls_cert=str(files["server.pem"]),
        tls_key=str(files["server.key"]),
        tls_ca=str(files["ca.pem"]),  # client certificates required
    )
    server = start_control_server(new_control(), "127.0.0.1:0", security)
    assert server.published is None  # the operator's token file is the credential
    try:
        request = control_pb2.GetStatusRequest()
        client = ControlSecurity(
            token_file=str(token_file),
            tls_ca=str(files["ca.pem"]),
            tls_cert=str(files["client.pem"]),
            tls_key=str(files["client.key"]),
        )
        status = call(Target.of(server.address, client), "GetStatus", request)
        assert status.state == control_pb2.JOB_STATE_RUNNING
        # No client certificate, or plaintext: no connection at all.
        for other in (
            ControlSecurity(token_file=str(token_file), tls_ca=str(files["ca.pem"])),
            ControlSecurity(token_file=str(token_file)),
        ):
            with pytest.raises(ControlError) as err:
                call(Target.of(server.address, other), "GetStatus", request, timeout=3)
            assert err.value.exit_status == 69
        # TLS but the wrong token: refused.
        wrong = Target(server.address, client, "not-the-token-0123456789")
        with pytest.raises(ControlError) as err:
            call(wrong, "Stop", control_pb2.StopRequest())
        assert err.value.exit_status == EXIT_NOT_ALLOWED
    finally:
        stop_control_server(server, grace=0)


def test_control_env_names_are_known():
    from psctl.coordinator.settings import check_environ

    check_environ(
        {
            "PSCTL_CONTROL_TOKEN_FILE": "f",
            "PSCTL_CONTROL_TLS_CA": "c",
            "PSCTL_INSECURE_CONTROL": "1",
        }
    )
    assert sys.modules["psctl.coordinator.operations.security"]


@pytest.mark.parametrize("value", ["maybe", "2", "on please"])
def test_insecure_control_env_takes_a_yes_or_no_only(value):
    import argparse

    with pytest.raises(ConfigError, match=r"^PSCTL_INSECURE_CONTROL: got .*set it to 1"):
        ControlSecurity.from_args(argparse.Namespace(), {"PSCTL_INSECURE_CONTROL": value})
    for allowed, expected in (("1", True), ("yes", True), ("0", False), ("", False)):
        security = ControlSecurity.from_args(
            argparse.Namespace(), {"PSCTL_INSECURE_CONTROL": allowed}
        )
        assert security.insecure is expected
