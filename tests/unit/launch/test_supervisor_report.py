"""What a training process leaves for its supervisor (a non-finite loss), handed on to the
next one: psctl_nonfinite_loss_total counts on across restarts."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from psctl.coordinator.failures import EXIT_RESTART
from psctl.coordinator.launch.supervisor import Counters, RestartPolicy, TrainingSupervisor

pytestmark = pytest.mark.timeout(30)


def test_a_report_is_taken_once_and_removed(tmp_path: Path):
    report = tmp_path / "report.json"
    child = Counters(nonfinite_losses=2, report_file=str(report))
    child.leave_report()
    supervisor = Counters(restarts=1, nonfinite_losses=1, report_file=str(report))
    supervisor.take_report()
    assert supervisor == Counters(restarts=1, nonfinite_losses=2)
    assert not report.exists()
    supervisor.take_report()  # nothing left: nothing changes
    assert supervisor.nonfinite_losses == 2


def test_a_bad_report_is_ignored_with_a_warning(tmp_path: Path, caplog):
    report = tmp_path / "report.json"
    report.write_text("{not json")
    counters = Counters(nonfinite_losses=1, report_file=str(report))
    with caplog.at_level(logging.WARNING):
        counters.take_report()
    assert counters.nonfinite_losses == 1
    assert "ignoring the training process's report" in caplog.text


class Child:
    """A training process that exits at once with ``code``, leaving ``nonfinite`` more
    non-finite losses in its report as the real one does (train.count_nonfinite)."""

    def __init__(self, counters: Counters, code: int, nonfinite: int) -> None:
        self.returncode: int | None = None
        self.code = code
        if nonfinite:
            mine = dataclasses.replace(counters)
            mine.nonfinite_losses += nonfinite
            mine.leave_report()

    def wait(self, timeout: float | None = None) -> int:
        self.returncode = self.code
        return self.code

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        pass


def test_the_next_training_process_gets_the_non_finite_count():
    script = [(EXIT_RESTART, 1), (EXIT_RESTART, 1), (0, 0)]
    handed: list[dict[str, object]] = []

    def start(counters: Counters) -> Child:
        # What train.py and local.py pass on the command line (--supervisor-counters).
        handed.append(json.loads(counters.handed()))
        code, nonfinite = script[len(handed) - 1]
        return Child(Counters(**handed[-1]), code, nonfinite)  # type: ignore[arg-type]

    supervisor = TrainingSupervisor(
        start,  # type: ignore[arg-type]
        policy=RestartPolicy(max_restarts=5),
        sleep=lambda _: None,
    )
    assert supervisor.run() == 0
    assert [h["nonfinite_losses"] for h in handed] == [0, 1, 2]
    assert [h["restarts"] for h in handed] == [0, 1, 2]
    report_file = str(handed[0]["report_file"])
    assert report_file and all(h["report_file"] == report_file for h in handed)
    assert not Path(report_file).exists()  # taken after each exit


def test_a_process_started_before_its_supervisor_reports_to_it():
    """psctl local starts its first training process with the servers, before the
    supervisor exists. It was handed no report file, so the supervisor never saw its start,
    the tasks it saw leave or its failures, and ended it 5 s after a worker left, as if it
    were still starting (test_scale's SIGTERM test, in a fresh-clone run)."""
    counters = Counters()
    child = Counters(**json.loads(counters.handed()))  # before any supervisor
    assert child.report_file and child.report_file == counters.report_file
    child.process_started = 12.0
    child.left.append(["worker", 1, "127.0.0.1:2222"])
    child.leave_report()
    supervisor = TrainingSupervisor(
        lambda _: None,  # type: ignore[arg-type,return-value]
        policy=RestartPolicy(max_restarts=1),
        counters=counters,
    )
    assert supervisor.counters.report_file == child.report_file
    assert supervisor.counters.peek_started()
    assert supervisor.counters.peek_left() == [("worker", 1, "127.0.0.1:2222")]


def test_a_non_finite_loss_is_counted_and_left_for_the_supervisor(tmp_path: Path):
    from prometheus_client import CollectorRegistry

    from psctl.coordinator.launch.process import count_nonfinite
    from psctl.coordinator.operations.metrics import CoordinatorMetrics

    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(
        registry=registry, job="mlp", num_workers=1, num_ps=1, batch_size=8
    )
    metrics.carry_over(restarts=1, ps_failures=0, nonfinite_losses=1)  # the earlier process
    counters = Counters(restarts=1, nonfinite_losses=1, report_file=str(tmp_path / "r.json"))
    count_nonfinite(counters, metrics)
    assert registry.get_sample_value("psctl_nonfinite_loss_total") == 2
    supervisor = Counters(restarts=1, nonfinite_losses=1, report_file=counters.report_file)
    supervisor.take_report()
    assert supervisor.nonfinite_losses == 2
    count_nonfinite(Counters(), None)  # no /metrics, no supervisor: nothing to do


def test_task_failures_seen_by_each_training_process_add_up_across_restarts(tmp_path: Path):
    """On a cluster psctl does not run (psctl train), the training processes' health checks
    are the only count of ps and worker failures: each process's goes to the supervisor as
    it sees it (it may be killed next) and the next one counts on from the sum."""
    report = str(tmp_path / "report.json")
    supervisor = Counters(report_file=report)
    for seen in ({"ps": 1, "worker": 0}, {"ps": 0, "worker": 2}, {"ps": 1, "worker": 0}):
        child = Counters(**json.loads(json.dumps(dataclasses.asdict(supervisor))))
        assert child.process_failures == {}  # its own start at zero
        child.process_failures = seen
        child.leave_report()
        supervisor.take_report()
    assert supervisor.seen_failures == {"ps": 2, "worker": 2}
    last = Counters(**json.loads(json.dumps(dataclasses.asdict(supervisor))))
    assert last.failures_seen({"ps": 0, "worker": 1}) == {"ps": 2, "worker": 3}
    # psctl local counts the servers it restarted too: one failure, seen both ways, once.
    local = dataclasses.replace(last, ps_failures=2, worker_failures=1)
    assert local.failures_seen({}) == {"ps": 2, "worker": 2}
    assert dataclasses.replace(local, ps_failures=4).failures_seen({}) == {"ps": 4, "worker": 2}


def test_each_tasks_failures_carry_over_to_the_next_process_by_address(tmp_path: Path):
    """psctl status's FAILURES column goes on from the earlier training processes' counts
    (it restarted from 0 in each), following a task by address when a resize renumbers it."""
    from psctl.coordinator.operations.job_state import JobControl
    from psctl.coordinator.operations.task_book import TaskInfo

    def control_with(tasks: list[TaskInfo], counters: Counters) -> JobControl:
        control = JobControl(
            job="mlp", target_steps=10, steps_per_execution=1, tasks=tasks, can_checkpoint=False
        )
        control.carry_failures(counters.seen_task_failures)
        return control

    ps0, w0, w1 = (
        TaskInfo("ps", 0, "h:1"),
        TaskInfo("worker", 0, "h:2"),
        TaskInfo("worker", 1, "h:3"),
    )
    supervisor = Counters(report_file=str(tmp_path / "report.json"))
    for failed in (["ps:0", "worker:1"], ["worker:1"]):
        child = Counters(**json.loads(json.dumps(dataclasses.asdict(supervisor))))
        control = control_with([ps0, w0, w1], child)
        for name in failed:
            task_type, index = name.split(":")
            control.task_failed(task_type, int(index))
        child.process_task_failures = control.failures_by_address()
        child.leave_report()
        supervisor.take_report()
    assert supervisor.seen_task_failures == {"h:1": 1, "h:3": 2}
    next_one = Counters(**json.loads(json.dumps(dataclasses.asdict(supervisor))))
    shown = control_with([ps0, w0, w1], next_one)
    assert shown.view().failures == {("ps", 0): 1, ("worker", 1): 2}
    shown.task_failed("worker", 1)
    assert shown.view().failures == {("ps", 0): 1, ("worker", 1): 3}
    assert shown.failure_counts() == {"ps": 0, "worker": 1}, "its own, for the supervisor"
    # worker 0 left: the one at h:3 is worker 0 now, with its failures.
    resized = control_with([ps0, TaskInfo("worker", 0, "h:3")], next_one)
    assert resized.view().failures == {("ps", 0): 1, ("worker", 0): 2}


def test_the_next_process_metrics_count_on_from_the_failures_seen_before(tmp_path: Path):
    from prometheus_client import CollectorRegistry

    from psctl.coordinator.operations.metrics import CoordinatorMetrics

    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(
        registry=registry, job="mlp", num_workers=2, num_ps=1, batch_size=8
    )
    counters = Counters(seen_failures={"ps": 1, "worker": 2})
    earlier = counters.failures_seen({})
    metrics.carry_over(
        restarts=1, ps_failures=earlier["ps"], worker_failures=earlier["worker"], nonfinite_losses=0
    )
    assert registry.get_sample_value("psctl_ps_failures_total") == 1
    assert registry.get_sample_value("psctl_worker_failures_total") == 2


def test_task_recoveries_carry_over_so_the_counter_never_goes_back(tmp_path: Path):
    """A worker seen back after its failure is a recovery; a resize starts a new training
    process (no restart), whose psctl_recoveries_total went back to the restarts alone."""
    from prometheus_client import CollectorRegistry

    from psctl.coordinator.operations.metrics import CoordinatorMetrics

    supervisor = Counters(restarts=1, report_file=str(tmp_path / "report.json"))
    child = Counters(**json.loads(json.dumps(dataclasses.asdict(supervisor))))
    child.process_recoveries = 2
    child.leave_report()
    supervisor.take_report()
    assert supervisor.task_recoveries == 2
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(
        registry=registry, job="mlp", num_workers=2, num_ps=1, batch_size=8
    )
    metrics.carry_over(
        restarts=supervisor.restarts,
        task_recoveries=supervisor.task_recoveries,
        ps_failures=0,
        nonfinite_losses=0,
    )
    assert registry.get_sample_value("psctl_recoveries_total") == 3


def test_the_summary_spans_the_job_from_its_first_training_process(tmp_path: Path):
    """After a restart or a resize the summary's start_step and wall_seconds are the
    job's (where and when the first process's loop started), not the last process's."""
    supervisor = Counters(report_file=str(tmp_path / "report.json"))
    for step, started in ((100, 1000.0), (900, 1400.0)):
        child = Counters(**json.loads(json.dumps(dataclasses.asdict(supervisor))))
        child.process_start_step, child.process_started = step, started
        child.leave_report()
        supervisor.take_report()
    assert (supervisor.job_start_step, supervisor.job_started) == (100, 1000.0)
    # A first process killed before its loop started reports none: the next one counts.
    fresh = Counters(report_file=str(tmp_path / "other.json"))
    Counters(report_file=fresh.report_file).leave_report()
    fresh.take_report()
    assert (fresh.job_start_step, fresh.job_started) == (-1, 0.0)
