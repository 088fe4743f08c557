"""The launcher's control front over real gRPC servers: a training process's Control
service on the front's private Unix socket, the front on a loopback port. What it forwards,
what it answers while no training process does (RECOVERING, STARTING), a Stop then, its
one poller for every stream, and the job's tokens on the public side."""

from __future__ import annotations

import argparse
import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from psctl.cluster.ports import PortInUseError
from psctl.control.v1 import control_pb2
from psctl.coordinator.operations.client import Target, cmd_watch
from psctl.coordinator.operations.front import ControlFront, launch_control
from psctl.coordinator.operations.job_state import JobControl, JobView
from psctl.coordinator.operations.security import ControlSecurity, Tokens, bearer
from psctl.coordinator.operations.service import (
    ControlServer,
    start_control_server,
    stop_control_server,
)
from psctl.coordinator.operations.state import State
from psctl.coordinator.operations.stubs import control_stub
from psctl.coordinator.operations.task_book import TaskInfo

pytestmark = pytest.mark.timeout(60)

TOKENS = Tokens("c" * 32, "r" * 32)


def training_process(
    front: ControlFront, step: int = 0, state: State = State.RUNNING
) -> tuple[JobControl, ControlServer]:
    """What a training process serves behind ``front``: its JobControl on the socket."""
    control = JobControl(
        job="unit",
        target_steps=100,
        steps_per_execution=1,
        can_checkpoint=True,
        tasks=[TaskInfo("chief", 0, "127.0.0.1:1"), TaskInfo("ps", 0, "127.0.0.1:2")],
    )
    control.set_state(state)
    control.update(global_step=step)
    server = ControlServer(control, front.backend_address, tokens=TOKENS)
    server.start()
    return control, server


@pytest.fixture
def front() -> Iterator[ControlFront]:
    front = ControlFront("127.0.0.1:0", ControlSecurity(), TOKENS, job="unit").start()
    stops: list[bool] = []
    front.on_stop = stops.append
    front.stops = stops  # type: ignore[attr-defined]
    yield front
    front.stop(grace=0)


def stub(front: ControlFront, token: str = TOKENS.control):  # type: ignore[no-untyped-def]
    channel = grpc.insecure_channel(front.address)
    calls = control_stub(channel)

    def call(method: str, request, timeout: float = 5.0):  # type: ignore[no-untyped-def]
        return getattr(calls, method)(request, timeout=timeout, metadata=bearer(token))

    return call


def status(front: ControlFront) -> control_pb2.Status:
    return stub(front)("GetStatus", control_pb2.GetStatusRequest())


def until(predicate, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("not within the timeout")


def test_starting_before_any_training_process_answers(front: ControlFront) -> None:
    first = status(front)
    assert first.state == State.STARTING.value and first.job == "unit"
    assert "starting the training process" in first.message


def test_forwards_status_and_requests_to_the_training_process(front: ControlFront) -> None:
    control, server = training_process(front, step=42)
    try:
        got = status(front)
        assert (got.state, got.global_step, got.job) == (State.RUNNING.value, 42, "unit")
        paused = stub(front)("Pause", control_pb2.PauseRequest())
        assert paused.state == State.RUNNING.value and control.pause_requested
        stub(front)("Resume", control_pb2.ResumeRequest())
        assert not control.pause_requested
        # The training process's refusal reaches the caller as it was.
        control.can_checkpoint = False
        with pytest.raises(grpc.RpcError) as err:
            stub(front)("Checkpoint", control_pb2.CheckpointRequest())
        assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "--checkpoint-dir" in (err.value.details() or "")
        stopped = stub(front)("Stop", control_pb2.StopRequest())
        assert stopped.state == State.RUNNING.value and control.stop_requested.is_set()
        assert front.stops == [True]  # type: ignore[attr-defined]
    finally:
        server.stop(grace=0)


def test_recovering_while_the_training_process_is_away_then_back(front: ControlFront) -> None:
    _, server = training_process(front, step=300)
    until(lambda: status(front).global_step == 300)
    server.stop(grace=0)
    away = until(lambda: (s := status(front)).state == State.RECOVERING.value and s)
    assert away.global_step == 300 and away.steps_per_second == 0.0
    assert "restarting" in away.message and "step 300" in away.message
    health = {t.type: t.health for t in away.tasks}
    assert health == {
        "chief": control_pb2.TASK_HEALTH_UNREACHABLE,
        "ps": control_pb2.TASK_HEALTH_UNKNOWN,
    }
    for method, request in (
        ("Pause", control_pb2.PauseRequest()),
        ("Checkpoint", control_pb2.CheckpointRequest()),
    ):
        with pytest.raises(grpc.RpcError) as err:
            stub(front)(method, request)
        assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "RECOVERING" in (err.value.details() or "")
    # A new training process on the same socket is seen within a second or so.
    started = time.monotonic()
    _, again = training_process(front, step=250)
    try:
        back = until(lambda: (s := status(front)).state == State.RUNNING.value and s)
        assert back.global_step == 250
        assert time.monotonic() - started < 3.0
    finally:
        again.stop(grace=0)


def test_stop_while_no_training_process_answers_stops_the_launcher(
    front: ControlFront,
) -> None:
    stopped = stub(front)("Stop", control_pb2.StopRequest())
    assert stopped.state == State.STARTING.value
    assert front.stops == [False]  # type: ignore[attr-defined]


def test_a_finished_job_stays_finished_after_its_process_exits(front: ControlFront) -> None:
    control, server = training_process(front, step=100, state=State.STOPPING)
    control.finish(State.DONE)
    until(lambda: status(front).state == State.DONE.value)
    server.stop(grace=0)
    time.sleep(0.5)
    assert status(front).state == State.DONE.value


def test_streams_are_served_from_one_poller(front: ControlFront) -> None:
    control, server = training_process(front, step=7)
    until(lambda: status(front).global_step == 7)
    time.sleep(0.3)  # the poller has seen it too
    calls = 0
    view = control.view

    def counted() -> JobView:
        nonlocal calls
        calls += 1
        return view()

    control.view = counted  # type: ignore[method-assign]
    streams = [
        stub(front)("WatchStatus", control_pb2.WatchStatusRequest(interval_seconds=0.1), 30)
        for _ in range(20)
    ]
    seen = [0] * len(streams)

    def read(i: int) -> None:
        for update in streams[i]:
            assert update.global_step == 7
            seen[i] += 1
            if seen[i] >= 10:
                return

    try:
        readers = [threading.Thread(target=read, args=(i,)) for i in range(len(streams))]
        started = time.monotonic()
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(timeout=20)
        elapsed = time.monotonic() - started
        assert seen == [10] * len(streams)
        # 200 updates went out; the training process answered the poller (every 0.25 s)
        # and nothing else, not once per stream and update.
        assert calls <= elapsed / 0.25 + 4, (calls, elapsed)
    finally:
        for stream in streams:
            stream.cancel()
        server.stop(grace=0)


def test_the_public_side_needs_the_jobs_token(front: ControlFront) -> None:
    for token, code in (
        ("x" * 32, grpc.StatusCode.UNAUTHENTICATED),
        (TOKENS.read, grpc.StatusCode.PERMISSION_DENIED),
    ):
        with pytest.raises(grpc.RpcError) as err:
            stub(front, token)("Stop", control_pb2.StopRequest())
        assert err.value.code() is code
    assert status(front).state == State.STARTING.value
    assert front.stops == []  # type: ignore[attr-defined]


def test_launch_control_publishes_tokens_and_a_private_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv("PSCTL_CONTROL_TOKEN_FILE", raising=False)
    with launch_control("127.0.0.1:0", ControlSecurity()) as (front, child):
        socket_dir = Path(front.backend_address.removeprefix("unix:")).parent
        assert socket_dir.stat().st_mode & 0o777 == 0o700
        assert Path(child.token_file).parent == runtime / "psctl"
        # The training process's own server on the socket: no TLS, no token files of its
        # own (the launcher's are kept), and the front reaches it.
        control = JobControl(
            job="unit", target_steps=1, steps_per_execution=1, can_checkpoint=False, tasks=[]
        )
        control.set_state(State.RUNNING)
        tls = ControlSecurity(
            token_file=child.token_file,
            read_token_file=child.read_token_file,
            tls_cert="/nonexistent.pem",
            tls_key="/nonexistent.key",
        )
        server = start_control_server(control, front.backend_address, tls)
        try:
            assert server.published is None
            token = Path(child.token_file).read_text().strip()
            got = stub(front, token)("GetStatus", control_pb2.GetStatusRequest())
            assert got.state == State.RUNNING.value
        finally:
            stop_control_server(server)
    assert not socket_dir.exists()
    assert not Path(child.token_file).exists()


def test_a_second_launcher_refused_the_address_leaves_the_running_jobs_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second job on a busy control address fails in one line (exit 1, as any port psctl
    needs), before it writes any token file: the running job stays controllable."""
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv("PSCTL_CONTROL_TOKEN_FILE", raising=False)
    with launch_control("127.0.0.1:0", ControlSecurity()) as (first, child):
        control, read = Path(child.token_file), Path(child.read_token_file)
        tokens = control.read_text(), read.read_text()
        with (
            pytest.raises(PortInUseError) as refused,
            launch_control(first.address, ControlSecurity()),
        ):
            pytest.fail("a second front listened on the same address")
        assert refused.value.exit_status == 1
        assert "--control-address" in str(refused.value) and "in use" in str(refused.value)
        assert (control.read_text(), read.read_text()) == tokens
        got = stub(first, tokens[0].strip())("GetStatus", control_pb2.GetStatusRequest())
        assert got.state == State.STARTING.value


def test_watch_ends_with_0_when_the_coordinator_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher closes the stream as the job ends (its last state may not reach it):
    `psctl watch` ran until the job ended, so it says so and exits 0, not 69."""
    front = ControlFront("127.0.0.1:0", ControlSecurity(), TOKENS, job="unit").start()
    _, server = training_process(front, step=42, state=State.STOPPING)
    target = Target(front.address, ControlSecurity(), TOKENS.control)
    monkeypatch.setattr(Target, "from_args", classmethod(lambda cls, _args: target))
    args = argparse.Namespace(address=front.address, interval=0.1, count=0, duration=0.0)
    out = io.StringIO()
    result: list[int] = []
    watcher = threading.Thread(target=lambda: result.append(cmd_watch(args, out)), daemon=True)
    watcher.start()
    try:
        until(lambda: "STOPPING step 42" in out.getvalue())
    finally:
        server.stop(grace=0)
        front.stop(grace=0)
    watcher.join(timeout=20)
    assert result == [0], out.getvalue()
    last = out.getvalue().splitlines()[-1]
    assert last == f"coordinator at {front.address} has exited (last seen STOPPING at step 42)"
