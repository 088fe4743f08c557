"""The Control service over real gRPC (port 0), driven by a JobControl without a cluster."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from psctl.control.v1 import control_pb2, control_pb2_grpc
from psctl.coordinator.operations.job_state import JobControl
from psctl.coordinator.operations.service import ControlServer
from psctl.coordinator.operations.state import State
from psctl.coordinator.operations.task_book import TaskInfo

pytestmark = pytest.mark.timeout(60)


class _Details(grpc.ClientCallDetails):
    def __init__(self, base, metadata):
        self.method, self.timeout, self.metadata = base.method, base.timeout, metadata
        self.credentials = base.credentials
        self.wait_for_ready = base.wait_for_ready
        self.compression = base.compression


class _Bearer(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the control token to every call, as the psctl client commands do."""

    def __init__(self, token):
        self.metadata = [("authorization", f"Bearer {token}")]

    def _add(self, details):
        return _Details(details, list(details.metadata or []) + self.metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._add(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._add(details), request)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._add(details), requests)


def token_channel(server: ControlServer, token: str | None = None) -> grpc.Channel:
    """A channel to ``server`` whose calls carry its control token (or ``token``)."""
    channel = grpc.insecure_channel(server.address)
    return grpc.intercept_channel(channel, _Bearer(token or server.tokens.control))


@pytest.fixture
def control():
    return JobControl(
        job="unit",
        target_steps=100,
        steps_per_execution=10,
        can_checkpoint=True,
        tasks=[TaskInfo("chief", 0, "127.0.0.1:1", pid=123), TaskInfo("ps", 0, "127.0.0.1:2")],
    )


@pytest.fixture
def stub(control):
    server = ControlServer(control, "127.0.0.1:0")
    server.start()
    channel = token_channel(server)
    yield control_pb2_grpc.ControlStub(channel), server
    channel.close()
    server.stop(grace=0)


def code_of(call, *args):
    with pytest.raises(grpc.RpcError) as err:
        call(*args, timeout=5)
    return err.value.code(), err.value.details()


def test_status_reflects_the_board(control, stub):
    client, _ = stub
    control.set_state(State.RUNNING)
    control.update(global_step=42, loss=0.5, metrics={"accuracy": 0.9})
    control.task_failed("ps", 0)
    status = client.GetStatus(control_pb2.GetStatusRequest(), timeout=5)
    assert status.state == control_pb2.JOB_STATE_RUNNING
    assert (status.global_step, status.target_steps, status.job) == (42, 100, "unit")
    assert status.metrics["accuracy"] == pytest.approx(0.9)
    ps = next(t for t in status.tasks if t.type == "ps")
    assert ps.failures == 1
    chief = next(t for t in status.tasks if t.type == "chief")
    assert chief.pid == 123


def test_watch_interval_out_of_range_is_invalid_argument(stub):
    client, _ = stub
    for bad in (0.01, 61.0, -1.0):
        stream = client.WatchStatus(control_pb2.WatchStatusRequest(interval_seconds=bad), timeout=5)
        with pytest.raises(grpc.RpcError) as err:
            next(stream)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "interval_seconds" in err.value.details()


def test_watch_streams_updates_and_ends_with_the_job(control, stub):
    client, _ = stub
    control.set_state(State.RUNNING)
    seen = []
    stream = client.WatchStatus(control_pb2.WatchStatusRequest(interval_seconds=0.1), timeout=10)
    for status in stream:
        seen.append(status.global_step)
        control.update(global_step=len(seen))
        if len(seen) == 3:
            control.set_state(State.STOPPING)
            control.finish(State.DONE)
    assert seen[:3] == [0, 1, 2]
    assert len(seen) <= 5


def test_pause_resume_stop_preconditions(control, stub):
    client, _ = stub
    control.set_state(State.RUNNING)
    assert client.Pause(control_pb2.PauseRequest(), timeout=5).state == State.RUNNING.value
    assert control.pause_requested
    client.Resume(control_pb2.ResumeRequest(), timeout=5)
    assert not control.pause_requested
    control.set_state(State.STOPPING)
    code, details = code_of(client.Pause, control_pb2.PauseRequest())
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "STOPPING" in details
    control.set_state(State.RECOVERING)
    code, details = code_of(client.Checkpoint, control_pb2.CheckpointRequest())
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "RECOVERING" in details
    client.Stop(control_pb2.StopRequest(), timeout=5)
    assert control.stop_requested.is_set()
    control.finish(State.FAILED)  # RECOVERING ends this process; DONE comes from STOPPING
    code, _ = code_of(client.Stop, control_pb2.StopRequest())
    assert code == grpc.StatusCode.FAILED_PRECONDITION


def test_checkpoint_is_answered_by_the_loop(control, stub):
    client, _ = stub
    control.set_state(State.RUNNING)

    def loop() -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            for request in control.take_checkpoint_requests():
                request.future.set_result(("/ckpt/ckpt-40", 40))
                return
            time.sleep(0.01)

    worker = threading.Thread(target=loop)
    worker.start()
    response = client.Checkpoint(control_pb2.CheckpointRequest(), timeout=5)
    worker.join()
    assert (response.checkpoint.path, response.checkpoint.step) == ("/ckpt/ckpt-40", 40)


def test_checkpoint_without_directory_is_failed_precondition():
    control = JobControl(
        job="x", target_steps=1, steps_per_execution=1, tasks=[], can_checkpoint=False
    )
    control.set_state(State.RUNNING)
    server = ControlServer(control, "127.0.0.1:0")
    server.start()
    try:
        with token_channel(server) as channel:
            other = control_pb2_grpc.ControlStub(channel)
            code, details = code_of(other.Checkpoint, control_pb2.CheckpointRequest())
    finally:
        server.stop(grace=0)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "--checkpoint-dir" in details


def test_health_and_reflection_are_served(stub):
    _, server = stub
    with token_channel(server) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        resp = health.Check(
            health_pb2.HealthCheckRequest(service="psctl.control.v1.Control"), timeout=5
        )
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert "psctl.control.v1.Control" in names


def test_control_address_in_use_is_a_clear_error(stub):
    from psctl.cluster.errors import ConfigError

    _, server = stub
    with pytest.raises(ConfigError, match="--control-address"):
        ControlServer(
            JobControl(
                job="x", target_steps=1, steps_per_execution=1, tasks=[], can_checkpoint=False
            ),
            server.address,
        )


def test_generated_code_matches_the_protos():
    # In a process of its own: protoc beside an imported TensorFlow can crash (seen).
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "protos.generate", "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "up to date" in proc.stdout


def test_a_checkpoint_activity_is_reported_over_grpc(control, stub):
    client, _ = stub
    control.set_state(State.RUNNING)
    with control.activity("checkpointing"):
        status = client.GetStatus(control_pb2.GetStatusRequest(), timeout=5)
        assert status.state == control_pb2.JOB_STATE_CHECKPOINTING
        # Pause/Resume/Stop answer the reported state, as when CHECKPOINTING was written.
        paused = client.Pause(control_pb2.PauseRequest(), timeout=5)
        assert paused.state == control_pb2.JOB_STATE_CHECKPOINTING
        assert control.state is State.RUNNING
    status = client.GetStatus(control_pb2.GetStatusRequest(), timeout=5)
    assert status.state == control_pb2.JOB_STATE_RUNNING


def test_a_job_finished_during_an_activity_reports_the_final_state(control, stub):
    client, _ = stub
    control.set_state(State.RUNNING)
    control.set_state(State.STOPPING)
    control.begin_activity("checkpointing")
    control.finish(State.DONE)
    status = client.GetStatus(control_pb2.GetStatusRequest(), timeout=5)
    assert status.state == control_pb2.JOB_STATE_DONE
    code, _ = code_of(client.Stop, control_pb2.StopRequest())
    assert code == grpc.StatusCode.FAILED_PRECONDITION


def test_psctl_status_shows_a_target_only_where_one_is_known():
    """--epochs: the data decides the last step (target 0): the line shows the step alone
    (it showed the unused --steps default: 'step 16789/1500 (1119.3%)')."""
    from psctl.coordinator.operations.client import format_status

    known = control_pb2.Status(job="mlp", global_step=250, target_steps=1000)
    assert "| step 250/1000 (25.0%) |" in format_status(known)
    open_ended = control_pb2.Status(job="visit", global_step=16789, target_steps=0)
    assert "| step 16789 |" in format_status(open_ended)


def test_the_gates_decision_travels_to_status_and_its_text():
    """--export-if-better's last decision: on the board, in the Status proto's freshness,
    and as the `gate:` line of `psctl status`."""
    from psctl.coordinator.operations.client import format_freshness
    from psctl.coordinator.operations.service import freshness_proto

    control = JobControl(
        job="ctr", target_steps=0, steps_per_execution=1, tasks=[], can_checkpoint=True
    )
    line = "version 32 held back: auc 0.5100 against serving version 16's 0.5162, on 1 file(s)"
    control.update(fresh=True, export_dir="/srv/m", published_version=16, publish_decision=line)
    fresh = freshness_proto(control.view().board, time.time())
    assert fresh.publish_decision == line
    assert f"gate: {line}" in format_freshness(fresh)
    assert not any(s.startswith("gate:") for s in format_freshness(control_pb2.Freshness()))
