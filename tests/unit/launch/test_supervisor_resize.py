"""The supervisor's side of a resize (psctl scale): the training process is signalled until
it exits, its exit for the resize starts the next one at once with no restart counted, and
a resize between two processes is recorded for the next one."""

from __future__ import annotations

import json
import signal

import pytest

from psctl.cluster.processes.signals import RESIZE_SIGNAL
from psctl.coordinator.failures import EXIT_RESTART
from psctl.coordinator.launch.supervisor import Counters, RestartPolicy, TrainingSupervisor

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Child:
    """A training process that ignores the first ``ignored`` resize signals (still
    starting), then exits EXIT_RESTART after the next; or exits ``code`` at its turn."""

    def __init__(self, clock: Clock, *, ignored: int = 0, code: int | None = None) -> None:
        self.clock, self.ignored, self.code = clock, ignored, code
        self.signals: list[int] = []
        self.returncode: int | None = None

    def send_signal(self, signum: int) -> None:
        self.signals.append(signum)
        if len(self.signals) > self.ignored:
            self.returncode = EXIT_RESTART

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        if self.code is not None:
            self.returncode = self.code
        if self.returncode is None:
            self.clock.now += timeout or 0.0
            raise subprocess.TimeoutExpired("train", timeout or 0.0)
        return self.returncode


def test_a_resize_signals_until_the_process_exits_and_counts_no_restart():
    clock = Clock()
    children: list[Child] = []
    supervisor: TrainingSupervisor

    def start(counters: Counters) -> Child:
        child = Child(clock, ignored=2) if not children else Child(clock, code=0)
        children.append(child)
        return child

    def tick() -> None:  # the operator's psctl scale, once the first process runs
        if len(children) == 1 and not supervisor.resizing and not children[0].signals:
            assert supervisor.request_resize(old="1 ps + 2 workers", new="1 ps + 3 workers")

    supervisor = TrainingSupervisor(
        start,  # type: ignore[arg-type]
        policy=RestartPolicy(max_restarts=1),
        tick=tick,
        clock=clock,
        sleep=lambda _: None,
    )
    assert supervisor.run() == 0
    assert children[0].signals == [RESIZE_SIGNAL] * 3  # sent again while it was starting
    assert supervisor.counters.restarts == 0
    (resize,) = supervisor.counters.resizes
    assert (resize["from"], resize["to"], resize["reason"]) == (
        "1 ps + 2 workers",
        "1 ps + 3 workers",
        "psctl scale",
    )
    assert resize["seconds"] >= 4.0  # two resends, 2 s apart


def test_a_resize_between_two_processes_is_recorded_for_the_next():
    supervisor = TrainingSupervisor(
        lambda counters: Child(Clock(), code=0),  # type: ignore[arg-type,return-value]
        policy=RestartPolicy(),
    )
    assert supervisor.request_resize(old="a", new="b")  # no child yet
    assert [(r["from"], r["to"], r["seconds"]) for r in supervisor.counters.resizes] == [
        ("a", "b", 0.0)
    ]
    assert not supervisor.resizing


def test_a_worker_that_left_is_taken_out_while_the_process_trains_on(tmp_path):
    """The training process reports a departure (its report file); the supervisor takes
    it out of the launcher's cluster at its next look, once, without signalling the process
    (no pause), and records a resize of 0 s."""
    clock = Clock()
    child = Child(clock)
    taken: list[list[tuple[str, int, str]]] = []
    counters = Counters(report_file=str(tmp_path / "report.json"))
    looks = [0]

    def tick() -> None:
        looks[0] += 1
        if looks[0] == 2:  # the training process saw worker:1 stop
            counters.left.append(["worker", 1, "127.0.0.1:2"])
            counters.leave_report()
        if looks[0] == 6:
            child.code = 0  # it trains to its last step

    def on_left(tasks: list[tuple[str, int, str]]) -> tuple[str, str]:
        taken.append(tasks)
        return "1 ps + 3 workers", "1 ps + 2 workers"

    supervisor = TrainingSupervisor(
        lambda c: child,  # type: ignore[arg-type,return-value]
        policy=RestartPolicy(),
        tick=tick,
        counters=counters,
        clock=clock,
        sleep=lambda _: None,
    )
    supervisor.on_left = on_left
    assert supervisor.run() == 0
    assert taken == [[("worker", 1, "127.0.0.1:2")]]  # once, though the report stays
    assert child.signals == []
    (resize,) = supervisor.counters.resizes
    assert (resize["to"], resize["reason"], resize["seconds"]) == (
        "1 ps + 2 workers",
        "worker:1 left",
        0.0,
    )
    assert supervisor.counters.restarts == 0


@pytest.mark.parametrize("finish_after_stop", [True, False])
def test_a_stop_during_a_resize_ends_with_one_more_process_for_the_summary(finish_after_stop):
    """Found by bench/soak.py: ``psctl stop`` while the training process exited for a resize
    ended ``psctl local`` with 75 and no summary. The launcher's supervisor starts one more
    (``stop_at_start``: restore, evaluate, summary, exit 0), once; sync mode's does not."""
    clock = Clock()
    children: list[Child] = []
    handed: list[bool] = []
    supervisor: TrainingSupervisor

    def start(counters: Counters) -> Child:
        handed.append(counters.stop_at_start)
        child = Child(clock) if not children else Child(clock, code=0)
        children.append(child)
        return child

    def tick() -> None:  # psctl scale, then psctl stop while the process exits for it
        if len(children) == 1 and not children[0].signals:
            assert supervisor.request_resize(old="1 ps + 2 workers", new="1 ps + 3 workers")
            supervisor.control_stop(forwarded=True)

    supervisor = TrainingSupervisor(
        start,  # type: ignore[arg-type]
        policy=RestartPolicy(max_restarts=1),
        tick=tick,
        clock=clock,
        sleep=lambda _: None,
        finish_after_stop=finish_after_stop,
    )
    if finish_after_stop:
        assert supervisor.run() == 0
        assert handed == [False, True]
        assert supervisor.counters.restarts == 0
        assert [r["to"] for r in supervisor.counters.resizes] == ["1 ps + 3 workers"]
    else:
        assert supervisor.run() == EXIT_RESTART
        assert handed == [False]


def test_a_second_exit_for_a_fresh_start_after_a_stop_ends_the_job():
    """The process started for a stopped job's summary exits for a fresh start too (its ps
    lost again): no third one."""
    starts: list[bool] = []

    def start(counters: Counters) -> Child:
        starts.append(counters.stop_at_start)
        return Child(Clock(), code=EXIT_RESTART)

    supervisor = TrainingSupervisor(
        start,  # type: ignore[arg-type]
        policy=RestartPolicy(),
        clock=Clock(),
        sleep=lambda _: None,
        finish_after_stop=True,
    )
    supervisor.stopping = True
    assert supervisor.run() == EXIT_RESTART
    assert starts == [False, True]


@pytest.mark.parametrize(
    ("died", "want"), [(-signal.SIGTERM, [False, True]), (-signal.SIGKILL, [False])]
)
def test_a_process_killed_by_the_stop_signal_it_was_sent_gets_one_more(died, want):
    """SIGTERM forwarded to a training process still starting (no handler yet) kills it:
    the supervisor starts one more with ``stop_at_start``, for the summary. One that dies
    by another signal after a stop is not replaced."""
    clock = Clock()
    handed: list[bool] = []
    supervisor: TrainingSupervisor

    def start(counters: Counters) -> Child:
        handed.append(counters.stop_at_start)
        if len(handed) > 1:
            return Child(clock, code=0)
        child = Child(clock)
        supervisor.child = child  # type: ignore[assignment]
        supervisor.request_stop(signal.SIGTERM)
        child.code = died
        return child

    supervisor = TrainingSupervisor(
        start,  # type: ignore[arg-type]
        policy=RestartPolicy(),
        clock=clock,
        sleep=lambda _: None,
        finish_after_stop=True,
    )
    supervisor.run()
    assert handed == want


class StuckChild(Child):
    """A training process held in TensorFlow's connection: no signal moves it; SIGKILL
    ends it (-9). ``trains`` writes its report's first-step time when it starts."""

    def __init__(self, clock: Clock, counters: Counters, *, trains: bool = False) -> None:
        super().__init__(clock, ignored=10**6)
        if trains:  # as the real process does, with what it is handed
            handed = Counters(**json.loads(counters.handed()))
            handed.process_started = 1.0
            handed.leave_report()

    def kill(self) -> None:
        self.returncode = -signal.SIGKILL


@pytest.mark.parametrize("trained", [False, True], ids=["starting", "training"])
def test_a_process_still_starting_after_a_task_left_is_ended_for_a_fresh_start(trained: bool):
    clock = Clock()
    children: list[Child] = []
    supervisor: TrainingSupervisor

    def start(counters: Counters) -> Child:
        child: Child = (
            StuckChild(clock, counters, trains=trained) if not children else Child(clock, code=0)
        )
        children.append(child)
        return child

    def tick() -> None:  # psctl local saw worker:2's server exit 0 (a preemption)
        if len(children) == 1 and clock.now >= 1.0:
            supervisor.depart([("worker", 2, "127.0.0.1:3")])
        if trained and clock.now >= 30.0:  # a process that trains on is left alone
            children[0].returncode = 0

    supervisor = TrainingSupervisor(
        start,  # type: ignore[arg-type]
        policy=RestartPolicy(max_restarts=1),
        tick=tick,
        clock=clock,
        sleep=lambda _: None,
    )
    supervisor.on_left = lambda tasks: ("1 ps + 3 workers", "1 ps + 2 workers")
    assert supervisor.run() == 0
    if trained:
        assert len(children) == 1 and children[0].returncode == 0
        return
    # Ended DEPART_GRACE after the departure, then one fresh start, no restart counted.
    assert len(children) == 2 and children[0].returncode == -signal.SIGKILL
    assert 5.0 <= clock.now < 8.0
    assert supervisor.counters.restarts == 0
