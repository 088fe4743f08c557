"""A ps failure counts once, whoever sees it first: the health checks (SERVING, then down)
or TensorFlow's error naming the ps (a ps server restarted between two checks, as systemd
restarts one within a second: seen in bench/soak.py --netns, where the job's summary said
ps_failures 0 after a ps was killed)."""

from __future__ import annotations

import pytest

from psctl.coordinator.launch.process import recover
from psctl.coordinator.operations.job_state import JobControl
from psctl.coordinator.operations.task_book import SERVING, UNREACHABLE, TaskInfo

pytestmark = pytest.mark.timeout(30)

PS0 = TaskInfo("ps", 0, "10.0.0.1:2222", health_address="10.0.0.1:3222")
PS1 = TaskInfo("ps", 1, "10.0.0.2:2222", health_address="10.0.0.2:3222")
WORKER = TaskInfo("worker", 0, "10.0.0.3:2222", health_address="10.0.0.3:3222")
LOST_PS1 = RuntimeError(
    "UnavailableError: Socket closed. Encountered when executing an operation using "
    "EagerExecutor. /job:ps/replica:0/task:1 /job:worker/replica:0/task:0"
)


def serving_job() -> tuple[JobControl, list[str]]:
    control = JobControl(
        job="j", target_steps=10, steps_per_execution=1, tasks=[PS0, PS1, WORKER],
        can_checkpoint=True,
    )  # fmt: skip
    seen: list[str] = []
    control.on_task_failure = seen.append
    for task in (PS0, PS1, WORKER):
        control.set_health(task, SERVING)
    return control, seen


def recover_now(control: JobControl, err: BaseException, checks: list[str]) -> None:
    """``recover`` with a clock that does not wait; each of its sleeps runs the next health
    check of ps:1 (``checks``, in order)."""
    clock = [0.0]

    def sleep(seconds: float) -> None:
        clock[0] += seconds
        if checks:
            control.set_health(PS1, checks.pop(0))

    recover(control, err, timeout=60, clock=lambda: clock[0], sleep=sleep)


def test_a_ps_back_before_its_health_check_is_counted_from_the_error():
    control, seen = serving_job()
    recover_now(control, LOST_PS1, [SERVING])  # restarted: its next check finds it serving
    assert control.failure_counts() == {"ps": 1, "worker": 0}  # ps:1; not the worker named
    assert seen == ["ps"]
    assert control.recoveries == 1


def test_a_ps_the_checks_saw_go_down_is_not_counted_again():
    control, seen = serving_job()
    control.set_health(PS1, UNREACHABLE)  # the checks saw it first
    recover_now(control, LOST_PS1, [UNREACHABLE, SERVING])
    assert control.failure_counts() == {"ps": 1, "worker": 0}
    assert seen == ["ps"]


def test_after_the_error_the_next_check_finding_it_down_counts_nothing_more():
    control, seen = serving_job()
    recover_now(control, LOST_PS1, [UNREACHABLE, UNREACHABLE, SERVING])
    assert control.failure_counts()["ps"] == 1
    assert seen == ["ps"]


def test_recovery_waits_for_a_check_after_the_error():
    """Its health reads UNKNOWN until a check: the ps is not taken for back on the check
    from before it failed."""
    control, _ = serving_job()
    control.failed_by_error("ps", 1)
    assert not control.all_ps_serving()
    assert control.unhealthy_tasks() == ["ps:1"]
    control.failed_by_error("ps", 1)  # named again before a check: still one failure
    assert control.failure_counts()["ps"] == 1
