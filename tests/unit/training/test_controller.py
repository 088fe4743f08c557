"""The training loop (loop.py) over the parameter-server runner (scheduled.py), driven with
scripted fakes: a fake coordinator whose calls finish, fail or hang as the test says, a fake
step program, the real JobControl and failure policy. No cluster; TensorFlow is only
imported, never connected."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from psctl.coordinator.failures import FailurePolicy
from psctl.coordinator.operations.job_state import JobControl
from psctl.coordinator.operations.state import State
from psctl.coordinator.training.loop import TrainingLoop
from psctl.coordinator.training.scheduled import ScheduledRunner
from psctl.coordinator.training.steps.packing import Packer
from psctl.hooks import LoopHooks
from tests.fakes import FakeOpError

pytestmark = pytest.mark.timeout(60)


WORKER_GONE = FakeOpError(14, "Socket closed: /job:worker/replica:0/task:1")
PS_GONE = FakeOpError(14, "Connection reset: /job:ps/replica:0/task:0")


class FakeRemote:
    def __init__(self, steps: int, *, error: BaseException | None = None) -> None:
        self.steps = steps
        self.error = error
        self._status_available_event = threading.Event()

    def finish(self) -> None:
        self._status_available_event.set()

    def fetch(self) -> float:
        self._status_available_event.wait()
        if self.error is not None:
            raise self.error
        return 0.001 * self.steps  # seconds on the worker


@dataclass
class FakeCoordinator:
    """Calls finish at once, unless the script says to fail or hang the n-th call."""

    fail: dict[int, BaseException] = field(default_factory=dict)
    hang: set[int] = field(default_factory=set)
    calls: list[FakeRemote] = field(default_factory=list)
    joined: bool = False

    def schedule(self, fn: Any, args: tuple[Any, ...]) -> FakeRemote:
        n = len(self.calls)
        steps = int(args[1].numpy())
        remote = FakeRemote(steps, error=self.fail.get(n))
        if n not in self.hang:
            remote.finish()
        self.calls.append(remote)
        return remote

    def join(self) -> None:
        self.joined = True


class FakeProgram:
    progress_total = 0
    function = None
    iterator = None

    def __init__(self, target: int) -> None:
        self.target = target
        self.ran = 0

    def start(self, settle: Callable[[], None]) -> None:
        pass

    def wants_more(self, scheduled: int) -> bool:
        return scheduled < self.target

    def result(self, steps: int, value: Any) -> tuple[int, float]:
        self.ran += steps
        return steps, float(value)

    def stopped_early(self, final_step: int) -> bool:
        return final_step < self.target


class Quiet:
    """Publisher, PublishStatus and Checkpointer stand-ins: record, do nothing."""

    last_values: dict[str, float] = {}  # noqa: RUF012

    def __init__(self) -> None:
        self.published: list[int] = []

    def progress(self, step: int, rate: float, values: dict[str, float]) -> None:
        self.published.append(step)

    def restart_window(self, completed: int) -> None:
        pass

    def serve_requests(self) -> None:
        pass


class Step:
    def __init__(self, program: FakeProgram) -> None:
        self.program = program

    def numpy(self) -> int:
        return self.program.ran


def new_control(
    *, target: int = 100, k: int = 10, on_state: Callable[[str], None] | None = None
) -> JobControl:
    return JobControl(
        job="unit",
        target_steps=target,
        steps_per_execution=k,
        tasks=[],
        can_checkpoint=False,
        on_state=on_state,
    )


def run_loop(
    coordinator: FakeCoordinator,
    *,
    target: int = 100,
    k: int = 10,
    stall_timeout: float = 30.0,
    actions: list[Any] | None = None,
    hooks: LoopHooks | None = None,
    control: JobControl | None = None,
) -> tuple[ScheduledRunner, FakeProgram, JobControl, TrainingLoop]:
    program = FakeProgram(target)
    control = control or new_control(target=target, k=k)
    quiet = Quiet()
    runner = ScheduledRunner(
        SimpleNamespace(control=control, metrics=None, hooks=hooks),
        program,
        packer=Packer(fixed=k, num_workers=2),
        start_step=0,
        coordinator=coordinator,
        policy=FailurePolicy(),
        max_in_flight=4,
        stall_timeout=stall_timeout,
    )
    loop = TrainingLoop(
        runner=runner,
        control=control,
        publisher=quiet,  # type: ignore[arg-type]
        status=quiet,  # type: ignore[arg-type]
        checkpointer=quiet,  # type: ignore[arg-type]
        actions=actions or [],
        hooks=hooks,
    )
    loop.train(0, steps_per_execution=k)  # the run, STOPPING, the runner's end (join)
    return runner, program, control, loop


def test_trains_to_the_target_and_joins():
    coordinator = FakeCoordinator()
    seen: list[State] = []
    control = new_control(on_state=lambda name: seen.append(State[name.upper()]))
    loop, program, control, _ = run_loop(coordinator, control=control)
    assert loop.completed == program.ran == 100
    assert len(coordinator.calls) == 10 and coordinator.joined
    assert seen == [State.RUNNING, State.STOPPING]


def test_a_call_lost_with_its_worker_is_scheduled_again():
    coordinator = FakeCoordinator(fail={2: WORKER_GONE})
    loop, program, _, _ = run_loop(coordinator)
    assert program.ran == 100 and loop.completed == 100
    assert len(coordinator.calls) == 11  # the lost call's 10 steps once more


def test_a_lost_ps_ends_the_loop_for_the_process_to_recover():
    coordinator = FakeCoordinator(fail={1: PS_GONE})
    with pytest.raises(FakeOpError):
        run_loop(coordinator)


def test_the_job_code_raising_ends_the_loop():
    coordinator = FakeCoordinator(fail={0: ValueError("the job's bug")})
    with pytest.raises(ValueError, match="the job's bug"):
        run_loop(coordinator)


def test_a_call_stuck_on_a_frozen_worker_is_given_up_and_its_steps_run_elsewhere():
    # A late call hangs and later ones finish: while the loop drains, the watchdog gives it
    # up and the loop schedules its steps again (seen: a run ended 20 steps short).
    coordinator = FakeCoordinator(hang={6})
    loop, program, _, _ = run_loop(coordinator, stall_timeout=0.3)
    assert loop.abandoned == 1
    assert program.ran == 100
    assert not coordinator.joined  # join() would wait for the frozen worker


def test_hooks_see_every_call_and_can_stop_the_loop():
    class Stopper(LoopHooks):
        def __init__(self) -> None:
            self.scheduled = self.finished = 0

        def after_schedule(self, steps: int) -> None:
            self.scheduled += 1

        def after_call(self, steps: int, seconds: float) -> None:
            self.finished += 1

        def on_poll(self, controller: Any) -> None:
            if controller.completed >= 30:
                controller.request_stop()

    hooks = Stopper()
    loop, program, _, _ = run_loop(FakeCoordinator(), hooks=hooks)
    assert 30 <= program.ran < 100
    assert hooks.scheduled == hooks.finished == len(loop.calls.calls) + hooks.finished


def test_actions_run_every_turn():
    turns: list[int] = []
    run_loop(FakeCoordinator(), actions=[lambda loop: turns.append(loop.completed)])
    assert len(turns) == 10 and turns == sorted(turns)


def test_pause_then_resume():
    states: list[str] = []
    control = new_control(on_state=states.append)
    paused: list[int] = []

    def pause_once(loop: TrainingLoop) -> None:
        if loop.completed >= 20 and not paused:
            paused.append(loop.completed)
            control.request_pause()
            threading.Timer(0.3, control.request_resume).start()

    started = time.monotonic()
    _, program, _, whole = run_loop(FakeCoordinator(), actions=[pause_once], control=control)
    assert program.ran == 100
    elapsed = time.monotonic() - started
    assert elapsed >= 0.3
    assert states == ["running", "paused", "running", "stopping"]
    assert whole.paused_seconds >= 0.3
    assert whole.train_seconds() <= elapsed - 0.3  # a pause is not training time
