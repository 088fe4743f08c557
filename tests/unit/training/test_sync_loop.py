"""The training loop (loop.py) over the synchronous runner (sync.py's CollectiveRunner): its
decisions, with a scripted agreement and step function (the real ones are all-reduces over
worker processes: tests/integration/training/test_sync.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from psctl.coordinator.failures import RestartFromCheckpoint
from psctl.coordinator.operations.job_state import JobControl
from psctl.coordinator.operations.state import State
from psctl.coordinator.training.loop import TrainingLoop
from psctl.coordinator.training.steps.packing import Packer
from psctl.coordinator.training.sync import CollectiveRunner


class ScriptedAgreement:
    """What the other workers say: rows of (stop, pause, k) from "the others", MAXed with
    this worker's own, as the all-gather does."""

    def __init__(self, others: list[list[float]]) -> None:
        self.others = others
        self.sent: list[list[float]] = []

    def max(self, values: list[float]) -> list[float]:
        self.sent.append(values)
        other = self.others.pop(0) if self.others else [0.0, 0.0, 0.0]
        return [max(a, b) for a, b in zip(values, other, strict=True)]

    def min(self, values: list[float]) -> list[float]:
        self.sent.append(values)
        other = self.others.pop(0) if self.others else [1.0]
        return [min(a, b) for a, b in zip(values, other, strict=True)]


class Program:
    iterator = object()

    def __init__(self, target: int = 100) -> None:
        self.calls: list[int] = []
        self.target = target

    def start(self, settle: Any) -> None:
        pass

    def function(self, iterator: Any, num: Any) -> float:
        self.calls.append(int(num))
        return 0.01


class Checkpointer:
    def serve_requests(self) -> None:
        pass


class Publisher:
    def progress(self, step: int, rate: float, values: dict[str, float]) -> None:
        pass


class SyncLoop(TrainingLoop):
    """The loop with its runner's agreement at hand, for the assertions."""

    agreement: ScriptedAgreement


def make_loop(others: list[list[float]], *, chief: bool, k: int = 5) -> tuple[SyncLoop, Any]:
    control = JobControl(
        job="t", target_steps=100, steps_per_execution=k, tasks=[], can_checkpoint=False
    )
    program = Program()
    agreement = ScriptedAgreement(others)
    owner = SimpleNamespace(
        control=control,
        metrics=None,
        hooks=None,
        agreement=agreement,
        is_chief=chief,
        model_finite=lambda: True,
    )
    runner = CollectiveRunner(owner, program, packer=Packer(fixed=k), start_step=0)
    loop = SyncLoop(
        runner=runner,
        control=control,
        publisher=Publisher(),  # type: ignore[arg-type]
        status=None,
        checkpointer=Checkpointer(),  # type: ignore[arg-type]
        actions=[],
    )
    loop.agreement = agreement
    return loop, program


def test_a_worker_runs_the_chiefs_steps_per_call_and_stops_at_the_target():
    loop, program = make_loop([[0, 0, 7]] * 10, chief=False, k=3)
    program.target = 20
    loop.run()
    assert program.calls == [7, 7, 6]  # the chief's K, the last call clipped to the target
    assert loop.completed == 20
    assert loop.agreement.sent[0] == [0.0, 0.0, 0.0]  # a worker proposes no K, no pause


def test_another_workers_stop_stops_this_one_at_the_same_turn():
    loop, program = make_loop([[0, 0, 0], [1, 0, 0]], chief=True)
    program.target = 100
    loop.run()
    assert program.calls == [5]
    assert loop.control.stop_requested.is_set()


def test_a_stop_here_is_sent_to_the_others():
    loop, program = make_loop([], chief=False)
    loop.control.stop_requested.set()
    program.target = 100
    loop.run()
    assert program.calls == []
    assert loop.agreement.sent == [[1.0, 0.0, 0.0]]


def test_the_chiefs_pause_holds_every_worker_until_resumed():
    loop, program = make_loop([[0, 1, 5], [0, 1, 5], [0, 0, 5]] + [[0, 0, 5]] * 10, chief=False)
    program.target = 10
    loop.run()
    assert program.calls == [5, 5]  # nothing ran while paused
    assert loop.control.state is State.RUNNING
    assert loop.paused_seconds > 0


def test_every_worker_restarts_when_any_model_is_not_finite_at_the_end():
    """The last step's outcome is agreed: a worker whose model is finite still restarts when
    another's is not (the all-gather's min), never ending done alone."""
    loop, _ = make_loop([], chief=False)
    loop.runner.completed = 100
    loop.agreement.others = [[0.0]]  # another worker: not finite
    with pytest.raises(RestartFromCheckpoint, match="not finite at global step 100"):
        loop.runner.finish()
    assert loop.agreement.sent[-1] == [1.0]
    loop.agreement.others = [[1.0]]
    loop.runner.finish()  # every worker finite: done
