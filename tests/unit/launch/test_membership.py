"""What psctl status shows of a resizing cluster (launch/resize.py Membership): the tasks
joining and draining while a resize is under way, the tasks that left once it is done or
once they departed, the generation from the launcher's count; matched by address."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from psctl.cluster.spec import ClusterConfig
from psctl.control.v1 import control_pb2
from psctl.coordinator.launch.resize import LEFT_SHOWN, Membership

pytestmark = pytest.mark.timeout(30)

CHIEF = ("127.0.0.1:1",)
PS = ("127.0.0.1:10",)


def cluster(*workers: str, ps: tuple[str, ...] = PS) -> ClusterConfig:
    return ClusterConfig(jobs={"chief": CHIEF, "ps": ps, "worker": tuple(workers)})


def status_of(c: ClusterConfig) -> control_pb2.Status:
    status = control_pb2.Status()
    for task_type, index, address in c.tasks():
        status.tasks.append(
            control_pb2.Task(
                type=task_type,
                index=index,
                address=address,
                health=control_pb2.TASK_HEALTH_SERVING,
                state=control_pb2.TASK_STATE_SERVING,
            )
        )
    return status


def states(status: control_pb2.Status) -> list[tuple[str, str]]:
    return [
        (t.address, control_pb2.TaskState.Name(t.state).removeprefix("TASK_STATE_"))
        for t in status.tasks
        if t.type != "chief"
    ]


def membership() -> tuple[Membership, SimpleNamespace]:
    supervisor = SimpleNamespace(resizing=False, counters=SimpleNamespace(resizes=[]))
    return Membership(supervisor), supervisor  # type: ignore[arg-type]


def test_a_resize_shows_joining_and_draining_then_left():
    m, supervisor = membership()
    old, new = cluster("w:1", "w:2"), cluster("w:1", "w:3")
    supervisor.resizing = True
    m.resize(old, new)
    status = status_of(old)
    m.apply(status)
    assert states(status) == [
        ("127.0.0.1:10", "SERVING"),
        ("w:1", "SERVING"),
        ("w:2", "DRAINING"),
        ("w:3", "JOINING"),
    ]
    supervisor.resizing = False
    supervisor.counters.resizes.append({})
    status = status_of(new)  # the new training process answers
    m.apply(status)
    assert status.cluster_generation == 1
    assert states(status) == [
        ("127.0.0.1:10", "SERVING"),
        ("w:1", "SERVING"),
        ("w:3", "SERVING"),
        ("w:2", "LEFT"),
    ]


def test_a_departure_is_listed_once_and_the_list_is_bounded():
    m, _ = membership()
    c = cluster("w:1", "w:2")
    m.left([("worker", 1, "w:2")])
    status = status_of(c)  # the running process still lists it (its own state)
    m.apply(status)
    assert [a for a, _ in states(status)].count("w:2") == 1
    m.left([("worker", i, f"gone:{i}") for i in range(2 * LEFT_SHOWN)])
    status = status_of(cluster("w:1"))
    m.apply(status)
    left = [a for a, s in states(status) if s == "LEFT"]
    assert len(left) == LEFT_SHOWN and left[0] == f"gone:{2 * LEFT_SHOWN - 1}"  # newest first


def test_a_scale_to_servers_that_never_answer_is_refused_before_the_callers_deadline(tmp_path):
    """psctl scale --cluster NEW --timeout 4: the refusal (one line, exit 78) comes before
    the client gives up, not after the coordinator's --connect-timeout (was: the client's
    'did not answer in time', exit 69, and the coordinator waiting on for 120 s)."""
    import json
    import time

    from psctl.cluster.errors import ConfigError
    from psctl.cluster.ports import free_ports
    from psctl.coordinator.launch.resize import ClusterFile, Resizer, server_wait

    assert server_wait(120.0, None) == 120.0 and server_wait(120.0, 10.0) == 8.0
    assert server_wait(5.0, 300.0) == 5.0 and server_wait(120.0, 0.5) == 1.0
    chief, ps0, w0, w1 = (f"127.0.0.1:{p}" for p in free_ports(4))
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"cluster": {"chief": [chief], "ps": [ps0], "worker": [w0]}}))
    files = ClusterFile(str(path), timeout=120.0)
    supervisor = SimpleNamespace(resizing=False)
    resizer = Resizer(supervisor, files.prepare, checkpoints=True, cluster=lambda: files.cluster)  # type: ignore[arg-type]
    new = {"cluster": {"chief": [chief], "ps": [ps0], "worker": [w0, w1]}}
    request = control_pb2.ScaleRequest(cluster_json=json.dumps(new))
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"not SERVING at .* after 2s; the job goes on"):
        resizer(request, 4.0)
    assert time.monotonic() - started < 4.0
    assert files.cluster.num_workers == 1, "the job goes on on the old cluster"
