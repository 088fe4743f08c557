"""Workers that leave (operations/job_state.py): a worker's NOT_SERVING is a departure, not a
failure; a worker down for longer than --drop-after is taken out once; a ps is a failure
either way; a task that left counts nothing more and shows DRAINING, then LEFT."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from psctl.coordinator.launch.process import follow_tasks_file, let_workers_leave
from psctl.coordinator.operations.counters import Counters
from psctl.coordinator.operations.job_state import JobControl
from psctl.coordinator.operations.task_book import (
    DRAINING,
    LEFT,
    NOT_SERVING,
    SERVING,
    UNKNOWN,
    UNREACHABLE,
    TaskInfo,
)
from psctl.coordinator.settings import TrainSettings

pytestmark = pytest.mark.timeout(30)

WORKER = TaskInfo("worker", 1, "127.0.0.1:2")
PS = TaskInfo("ps", 0, "127.0.0.1:1")
WORKER2 = TaskInfo("worker", 0, "127.0.0.1:3")


def control_with(
    clock: list[float], drop_after: float = 0.0, *, allow: bool = True
) -> tuple[JobControl, list]:
    control = JobControl(
        job="j", target_steps=10, steps_per_execution=1, tasks=[PS, WORKER], can_checkpoint=True
    )
    control.clock = lambda: clock[0]
    control.drop_after = drop_after
    leaving: list[TaskInfo] = []

    def leave(task: TaskInfo) -> bool:
        leaving.append(task)
        return allow

    control.on_task_leaving = leave
    return control, leaving


def state(control: JobControl, task: TaskInfo) -> str:
    return control.view().states[(task.type, task.index)]


def test_a_stopping_worker_leaves_and_is_no_failure():
    control, leaving = control_with([0.0])
    control.set_health(WORKER, SERVING)
    assert state(control, WORKER) == SERVING
    control.set_health(WORKER, NOT_SERVING)  # SIGTERM: health NOT_SERVING, then exit
    assert state(control, WORKER) == DRAINING
    control.set_health(WORKER, UNREACHABLE)
    assert state(control, WORKER) == LEFT
    control.set_health(WORKER, UNREACHABLE)
    assert leaving == [WORKER]
    assert control.failure_counts() == {"worker": 0, "ps": 0}
    control.set_health(PS, SERVING)
    control.set_health(PS, NOT_SERVING)  # a ps is never "leaving"
    assert control.failure_counts()["ps"] == 1 and leaving == [WORKER]


def test_a_worker_restarted_between_two_polls_is_a_failure_not_a_departure():
    # SIGKILL, and psctl local restarted it before the next poll: the new server, still
    # starting, answers UNKNOWN (not NOT_SERVING, which only a stopping server says).
    control, leaving = control_with([0.0])
    control.set_health(WORKER, SERVING)
    control.set_health(WORKER, UNKNOWN)
    assert leaving == [] and state(control, WORKER) != DRAINING
    assert control.failure_counts()["worker"] == 1
    control.set_health(WORKER, SERVING)
    assert control.recoveries == 1


def test_a_task_restarted_unseen_between_two_polls_is_a_failure_and_a_recovery():
    # Servers start in half a second: SIGKILL and psctl local's restart can both fall
    # between two polls, each SERVING; only the answering process (its instance) differs.
    control, leaving = control_with([0.0])
    for recovered, task in enumerate((WORKER, PS)):
        control.set_health(task, SERVING, "100-1")
        control.set_health(task, SERVING, "100-1")  # the same process: nothing
        control.set_health(task, SERVING)  # no instance said: nothing either
        assert control.failure_counts()[task.type] == 0 and control.recoveries == recovered
        control.set_health(task, SERVING, "200-2")
        assert control.failure_counts()[task.type] == 1
        assert control.recoveries == recovered + 1 and state(control, task) == SERVING
    assert leaving == []
    control.failed_by_error("ps", 0)  # TensorFlow's error of that same restart, later
    assert control.failure_counts()["ps"] == 1
    control.failed_by_error("ps", 0)  # another error: another failure the checks missed
    assert control.failure_counts()["ps"] == 2
    control.set_health(PS, SERVING, "300-3")  # back: its recovery
    assert control.failure_counts()["ps"] == 2 and control.recoveries == 3
    control.set_health(PS, UNREACHABLE)  # seen down, then back as a new process: counted once
    control.set_health(PS, SERVING, "400-4")
    assert control.failure_counts()["ps"] == 3 and control.recoveries == 4


def test_another_server_given_a_tasks_index_is_no_restart():
    # A resize renumbers the workers: index 1 is now another server, at another address.
    control, leaving = control_with([0.0])
    control.set_health(WORKER, SERVING, "100-1")
    renumbered = TaskInfo("worker", 1, "127.0.0.1:9")
    control.set_tasks([PS, renumbered])
    control.set_health(renumbered, SERVING, "900-9")
    assert control.failure_counts()["worker"] == 0 and control.recoveries == 0
    control.set_health(renumbered, SERVING, "901-9")  # that one restarted: counted
    assert control.failure_counts()["worker"] == 1 and control.recoveries == 1
    assert leaving == []


def test_a_worker_down_past_drop_after_is_taken_out_once():
    clock = [0.0]
    control, leaving = control_with(clock, drop_after=900.0)
    control.set_health(WORKER, SERVING)
    control.set_health(WORKER, UNREACHABLE)  # a failure, retried at its address
    assert control.failure_counts()["worker"] == 1 and leaving == []
    clock[0] = 899.0
    control.set_health(WORKER, UNREACHABLE)
    assert leaving == []
    clock[0] = 901.0
    control.set_health(WORKER, UNREACHABLE)
    assert leaving == [WORKER]
    clock[0] = 2000.0
    control.set_health(WORKER, UNREACHABLE)
    assert leaving == [WORKER]  # once


def test_a_worker_back_in_time_keeps_its_slot():
    clock = [0.0]
    control, leaving = control_with(clock, drop_after=900.0)
    control.set_health(WORKER, SERVING)
    control.set_health(WORKER, UNREACHABLE)
    clock[0] = 600.0
    control.set_health(WORKER, SERVING)  # a reboot: back at its address
    clock[0] = 1200.0
    control.set_health(WORKER, UNREACHABLE)
    clock[0] = 1800.0
    control.set_health(WORKER, UNREACHABLE)
    assert leaving == []  # down 600 s this time


def test_the_last_worker_may_not_leave_and_its_loss_is_a_failure():
    control, leaving = control_with([0.0], allow=False)
    control.set_health(WORKER, SERVING)
    control.set_health(WORKER, NOT_SERVING)
    control.set_health(WORKER, UNREACHABLE)
    assert leaving == [WORKER]  # asked, refused
    assert state(control, WORKER) == SERVING  # still a member, failing
    assert control.failure_counts()["worker"] == 1


def test_a_task_the_launcher_marked_left_counts_nothing():
    control, leaving = control_with([0.0])
    control.set_health(WORKER, SERVING)
    gone = TaskInfo("worker", 1, "127.0.0.1:2", left=True)  # psctl local saw it exit 0
    control.set_tasks([PS, gone])
    assert leaving == [gone]  # reported as leaving, as if its checks had seen it stop
    control.set_tasks([PS, gone])
    control.set_health(gone, UNREACHABLE)
    assert control.failure_counts() == {"worker": 0, "ps": 0} and leaving == [gone]
    assert state(control, gone) == LEFT


def test_a_worker_marked_left_in_the_tasks_file_before_it_is_followed_leaves(tmp_path):
    """Seen in tests/integration/operations/test_scale.py: psctl local marked a worker left
    between the training process's first read of its tasks file and the start of its
    follower, which took that version as already read: the departure was never acted on, and
    the process hung connecting to the worker that was gone. The follower reads the file at
    once."""
    control, leaving = control_with([0.0])
    tasks_file = tmp_path / "tasks.json"
    gone = dataclasses.replace(WORKER, left=True)
    tasks_file.write_text(json.dumps([dataclasses.asdict(PS), dataclasses.asdict(gone)]))
    follow_tasks_file(str(tasks_file), control, every=60.0)  # no second read in this test
    deadline = time.monotonic() + 10
    while not leaving and time.monotonic() < deadline:
        time.sleep(0.01)
    assert leaving == [gone]
    assert state(control, WORKER) in (DRAINING, LEFT)


@pytest.mark.parametrize(
    ("settings", "leaves"),
    [
        (TrainSettings(), True),
        (TrainSettings.of(epochs=1), False),  # the tf.data service: its data worker stays needed
        (TrainSettings.of(follow=True, train_data="d/*", checkpoint_dir="c"), False),
        (TrainSettings.of(strategy="sync"), False),
    ],
)
def test_workers_leave_unless_the_tf_data_service_feeds_the_job(settings, leaves):
    control = JobControl(
        job="j", target_steps=10, steps_per_execution=1, tasks=[PS, WORKER, WORKER2],
        can_checkpoint=True,
    )  # fmt: skip
    let_workers_leave(control, settings, Counters())
    assert (control.on_task_leaving is not None) == leaves
    assert control.drop_after == (settings.elastic.drop_after if leaves else 0.0)
    if not leaves:  # a stopping worker is a failure, retried at its address
        control.set_health(WORKER, SERVING)
        control.set_health(WORKER, NOT_SERVING)
        assert state(control, WORKER) == SERVING  # in the cluster still, its health failing
        assert control.failure_counts()["worker"] == 1
