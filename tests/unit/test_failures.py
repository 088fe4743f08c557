"""The failure policy (coordinator/failures.py) and its callers, driven by scripted fakes:
TensorFlow-like errors, a fake job control and fake training processes. No TensorFlow, no
processes, no sleeping."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from psctl.cluster.errors import EXIT_UNAVAILABLE, ConfigError
from psctl.cluster.ports import free_ports
from psctl.coordinator.failures import (
    CALL_DECISIONS,
    EXIT_GAVE_UP,
    EXIT_INTERRUPTED,
    EXIT_RESTART,
    EXIT_STATUS,
    FINAL_EXIT_STATUSES,
    PROCESS_DECISIONS,
    RESTARTS,
    Decision,
    Failure,
    FailurePolicy,
    PeerLost,
    RestartFromCheckpoint,
    Scope,
    Unreachable,
    classify,
    classify_exit,
    describe,
    exit_status,
    tasks_named,
)
from psctl.coordinator.launch import process
from psctl.coordinator.launch.supervisor import (
    STOP_ECHO,
    Counters,
    RestartPolicy,
    TrainingSupervisor,
)
from psctl.coordinator.operations.state import State
from psctl.coordinator.operations.task_book import TaskInfo
from tests.conftest import child_env, psctl_argv
from tests.fakes import FakeOpError

pytestmark = pytest.mark.timeout(10)

CANCELLED, INVALID_ARGUMENT, DEADLINE_EXCEEDED, NOT_FOUND, ABORTED, UNAVAILABLE = 1, 3, 4, 5, 10, 14
INTERNAL = 13


class FakeWrapper(Exception):
    """ClosureInputError / ClosureAbortedError: not an OpError, carries the original."""

    def __init__(self, original: object) -> None:
        super().__init__(f"Input has an error, the original exception is {original!r}")
        self.original_exception = original


WORKER = "/job:worker/replica:0/task:1"
PS = "/job:ps/replica:0/task:0"


def _cycle() -> FakeWrapper:
    a, b = FakeWrapper(None), FakeWrapper(None)
    a.original_exception, b.original_exception = b, a
    return a


def _self_wrapped() -> FakeWrapper:
    w = FakeWrapper(None)
    w.original_exception = w
    return w


def _with_attrs(**attrs: object) -> Exception:
    err = Exception("/job:ps unavailable")
    for name, value in attrs.items():
        setattr(err, name, value)
    return err


CLASSIFICATION = [
    # A call's error with its worker: the loop runs its steps again.
    (
        "unavailable, worker",
        FakeOpError(UNAVAILABLE, f"Socket closed {WORKER}"),
        Failure.WORKER_LOST,
    ),
    ("aborted, worker", FakeOpError(ABORTED, f"worker {WORKER} gone"), Failure.WORKER_LOST),
    # Cluster failures: a ps, or the links to it.
    ("unavailable, worker and ps", FakeOpError(UNAVAILABLE, f"{WORKER} -> {PS}"), Failure.PS_LOST),
    ("unavailable, ps", FakeOpError(UNAVAILABLE, f"Socket closed {PS}"), Failure.PS_LOST),
    ("unavailable, no task", FakeOpError(UNAVAILABLE, "failed to connect"), Failure.PS_LOST),
    ("aborted, ps", FakeOpError(ABORTED, f"{PS} restarted"), Failure.PS_LOST),
    ("cancelled, worker", FakeOpError(CANCELLED, f"cancelled {WORKER}"), Failure.PS_LOST),
    ("deadline, worker", FakeOpError(DEADLINE_EXCEEDED, WORKER), Failure.PS_LOST),
    ("unknown device", FakeOpError(INVALID_ARGUMENT, f"Unknown device: {PS}"), Failure.PS_LOST),
    ("invalid argument", FakeOpError(INVALID_ARGUMENT, "shapes (2,) and (3,)"), Failure.JOB_ERROR),
    ("not found", FakeOpError(NOT_FOUND, f"no file {WORKER}"), Failure.JOB_ERROR),
    # A request garbled on its way to a task (seen in CI): a new coordinator recovers it.
    (
        "garbled request",
        FakeOpError(INTERNAL, f"Unable to parse request from remote target {WORKER}"),
        Failure.PS_LOST,
    ),
    ("internal", FakeOpError(INTERNAL, "Check failed: 2 == 3"), Failure.JOB_ERROR),
    # Wrappers pass a cluster failure through, never a worker's (the loop never saw it).
    ("wrapped ps", FakeWrapper(FakeOpError(UNAVAILABLE, PS)), Failure.PS_LOST),
    ("wrapped worker", FakeWrapper(FakeOpError(UNAVAILABLE, WORKER)), Failure.PS_LOST),
    ("wrapped twice", FakeWrapper(FakeWrapper(FakeOpError(CANCELLED, ""))), Failure.PS_LOST),
    (
        "wrapped device",
        FakeWrapper(FakeOpError(INVALID_ARGUMENT, "unknown device")),
        Failure.PS_LOST,
    ),
    ("wrapped job error", FakeWrapper(ValueError("bad input")), Failure.JOB_ERROR),
    ("wrapped non-error", FakeWrapper("text"), Failure.JOB_ERROR),
    ("wraps itself", _self_wrapped(), Failure.JOB_ERROR),
    ("wrapper cycle", _cycle(), Failure.JOB_ERROR),
    # Duck typing needs both an int error_code and a str message.
    ("code without message", _with_attrs(error_code=UNAVAILABLE), Failure.JOB_ERROR),
    ("str code", _with_attrs(error_code="14", message="x"), Failure.JOB_ERROR),
    ("bool code", _with_attrs(error_code=True, message="x"), Failure.JOB_ERROR),
    # psctl's own exceptions and the operator's.
    ("non-finite", RestartFromCheckpoint("training loss is nan"), Failure.NON_FINITE),
    ("config", ConfigError("--steps", "is -1", "give a positive number"), Failure.CONFIG_ERROR),
    ("unreachable", Unreachable("servers not reachable after 60s"), Failure.UNREACHABLE),
    ("peer lost", PeerLost("an all-reduce with the other workers failed"), Failure.PEER_LOST),
    ("second stop signal", KeyboardInterrupt(), Failure.STOP_SIGNAL),
    ("job code", ValueError("boom"), Failure.JOB_ERROR),
    ("system exit", SystemExit(3), Failure.JOB_ERROR),
]


@pytest.mark.parametrize(
    ("err", "failure"), [(e, f) for _, e, f in CLASSIFICATION], ids=[c[0] for c in CLASSIFICATION]
)
def test_classify(err: BaseException, failure: Failure) -> None:
    assert classify(err) is failure


def test_classification_rows_cover_every_error_failure() -> None:
    exit_only = {Failure.RESTART_REQUESTED, Failure.TRAINING_CRASHED}
    assert {f for _, _, f in CLASSIFICATION} == set(Failure) - exit_only


# (failure, in the training loop, at the training process's top and in the supervisor)
DECISIONS = [
    (Failure.WORKER_LOST, Decision.RESCHEDULE, Decision.WAIT_FOR_PS_THEN_RESTART),
    (Failure.PS_LOST, Decision.WAIT_FOR_PS_THEN_RESTART, Decision.WAIT_FOR_PS_THEN_RESTART),
    (Failure.STOP_SIGNAL, Decision.ABORT, Decision.ABORT),
    (Failure.NON_FINITE, Decision.RESTART, Decision.RESTART),
    (Failure.JOB_ERROR, Decision.FAIL, Decision.FAIL),
    (Failure.CONFIG_ERROR, Decision.FAIL_CONFIG, Decision.FAIL_CONFIG),
    (Failure.UNREACHABLE, Decision.FAIL_UNREACHABLE, Decision.FAIL_UNREACHABLE),
    (Failure.PEER_LOST, Decision.RESTART, Decision.RESTART),
    (Failure.RESTART_REQUESTED, Decision.RESTART, Decision.RESTART),
    (Failure.TRAINING_CRASHED, Decision.RESTART_WITH_BACKOFF, Decision.RESTART_WITH_BACKOFF),
]


@pytest.mark.parametrize(("failure", "in_call", "in_process"), DECISIONS, ids=lambda v: v.name)
def test_decide(failure: Failure, in_call: Decision, in_process: Decision) -> None:
    policy = FailurePolicy()
    assert policy.decide(failure) is in_call  # Scope.CALL: the loop's `decide(classify(err))`
    assert policy.decide(failure, scope=Scope.CALL) is in_call
    assert policy.decide(failure, scope=Scope.PROCESS) is in_process


def test_decision_rows_cover_every_failure() -> None:
    assert [f for f, _, _ in DECISIONS] == list(Failure)
    assert set(CALL_DECISIONS) == set(PROCESS_DECISIONS) == set(Failure)


def test_only_a_worker_loss_is_rescheduled() -> None:
    policy = FailurePolicy()
    rescheduled = [f for f in Failure if policy.decide(f) is Decision.RESCHEDULE]
    assert rescheduled == [Failure.WORKER_LOST]
    assert not [f for f in Failure if policy.decide(f, scope=Scope.PROCESS) is Decision.RESCHEDULE]


EXITS = [
    (Decision.RESTART, 75),
    (Decision.WAIT_FOR_PS_THEN_RESTART, 75),
    (Decision.FAIL, 1),
    (Decision.FAIL_CONFIG, 78),
    (Decision.FAIL_UNREACHABLE, 69),
    (Decision.GIVE_UP, 70),
    (Decision.ABORT, 130),
]


@pytest.mark.parametrize(("decision", "status"), EXITS, ids=lambda v: str(v))
def test_exit_status(decision: Decision, status: int) -> None:
    assert exit_status(decision) == status


@pytest.mark.parametrize("decision", [Decision.RESCHEDULE, Decision.RESTART_WITH_BACKOFF])
def test_decisions_that_end_no_process_have_no_status(decision: Decision) -> None:
    with pytest.raises(ValueError, match=decision.name):
        exit_status(decision)


def test_exit_rows_cover_the_table() -> None:
    assert dict(EXITS) == dict(EXIT_STATUS)
    assert (EXIT_RESTART, EXIT_INTERRUPTED, EXIT_GAVE_UP) == (75, 130, 70)


def test_every_status_a_job_ends_with_is_final_but_0() -> None:
    """What the coordinator unit puts in RestartPreventExitStatus=: every status the
    supervisor can return, the bad command line's 2 included; never 75, which only asks
    psctl's own supervisor for a fresh training process."""
    assert FINAL_EXIT_STATUSES == (1, 2, 69, 70, 78, 130)
    assert EXIT_RESTART not in FINAL_EXIT_STATUSES


CHILD_EXITS = [
    (0, None),
    (-signal.SIGKILL, Failure.TRAINING_CRASHED),
    (-signal.SIGSEGV, Failure.TRAINING_CRASHED),
    (75, Failure.RESTART_REQUESTED),
    (78, Failure.CONFIG_ERROR),
    (130, Failure.STOP_SIGNAL),
    (1, Failure.JOB_ERROR),
    (2, Failure.JOB_ERROR),  # argparse: a bad command line
    (69, Failure.UNREACHABLE),
    (70, Failure.JOB_ERROR),  # only a supervisor ends with it
]


@pytest.mark.parametrize(("code", "failure"), CHILD_EXITS, ids=lambda v: str(v))
def test_classify_exit(code: int, failure: Failure | None) -> None:
    assert classify_exit(code) is failure


@pytest.mark.parametrize("failure", list(Failure), ids=lambda f: f.name)
def test_the_supervisor_restarts_exactly_what_the_training_process_asks(failure: Failure) -> None:
    """Round trip through the exit status: the process's decision, its status, what the
    supervisor reads from it and decides."""
    policy = FailurePolicy()
    decision = policy.decide(failure, scope=Scope.PROCESS)
    if decision not in EXIT_STATUS:
        return  # the training process never ends on it
    seen = classify_exit(exit_status(decision))
    assert seen is not None
    again = policy.decide(seen, scope=Scope.PROCESS)
    assert (again in RESTARTS) == (decision in RESTARTS)
    if decision not in RESTARTS:
        assert again is decision


def test_policy_tables_are_validated() -> None:
    partial = {f: Decision.FAIL for f in Failure if f is not Failure.PS_LOST}
    with pytest.raises(ValueError, match="call: no decision for PS_LOST"):
        FailurePolicy(call=partial)
    with pytest.raises(ValueError, match="process: RESCHEDULE for WORKER_LOST"):
        FailurePolicy(process=CALL_DECISIONS)
    strict = FailurePolicy(call={**CALL_DECISIONS, Failure.WORKER_LOST: Decision.FAIL})
    assert strict.decide(Failure.WORKER_LOST) is Decision.FAIL


def test_no_tensorflow_import() -> None:
    code = (
        "import sys\n"
        "import psctl.coordinator.failures, psctl.coordinator.launch.supervisor\n"
        "import psctl.coordinator.launch.train, psctl.coordinator.launch.process\n"
        "from psctl.coordinator.failures import classify\n"
        "classify(ValueError())\n"
        "assert 'tensorflow' not in sys.modules, 'tensorflow imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=8)
    assert proc.returncode == 0, proc.stderr


# ---- The training process: process.end_on_error, as train_main calls it -----------------


class FakeControl:
    def __init__(self, *, ps_back_after: int = 1, unhealthy: list[str] | None = None) -> None:
        self.calls: list[tuple[str, State, str]] = []
        self.ps_back_after = ps_back_after  # all_ps_serving() checks until True; 0: never
        self.checks = 0
        self.unhealthy = unhealthy or []
        self.failed_by_error_calls: list[str] = []  # the ps tasks an error named
        self.operator_stop = False  # the operator's stop (or SIGTERM)
        self.tasks = [
            TaskInfo("chief", 0, "10.0.0.1:2222"),
            TaskInfo("ps", 0, "10.0.0.2:2222", "10.0.0.2:3222"),
            TaskInfo("worker", 1, "10.0.0.4:2222", "10.0.0.4:3222"),
        ]

    def set_state(self, state: State, message: str = "") -> None:
        self.calls.append(("set_state", state, message))

    def finish(self, state: State, message: str = "") -> None:
        self.calls.append(("finish", state, message))

    def unhealthy_tasks(self) -> list[str]:
        return self.unhealthy

    def failed_by_error(self, task_type: str, index: int) -> None:
        self.failed_by_error_calls.append(f"{task_type}:{index}")

    def all_ps_serving(self) -> bool:
        self.checks += 1
        return self.ps_back_after > 0 and self.checks >= self.ps_back_after


class FakeTime:
    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _end(err: BaseException, control: FakeControl, fake: FakeTime, timeout: float = 60.0) -> int:
    return process.end_on_error(
        err,
        control,  # type: ignore[arg-type]
        FailurePolicy(),
        recovery_timeout=timeout,
        clock=fake.clock,
        sleep=fake.sleep,
    )


def test_non_finite_restarts_at_once(caplog: pytest.LogCaptureFixture) -> None:
    control, fake = FakeControl(), FakeTime()
    with caplog.at_level(logging.ERROR):
        status = _end(
            RestartFromCheckpoint("training loss is nan near global step 7"), control, fake
        )
    assert status == EXIT_RESTART
    assert control.calls == [
        ("set_state", State.RECOVERING, "training loss is nan near global step 7")
    ]
    assert fake.sleeps == []
    assert "restarting the training process from the latest checkpoint" in caplog.text


def test_servers_not_there_in_time_fail_the_job_with_exit_69(
    capsys: pytest.CaptureFixture[str],
) -> None:
    control, fake = FakeControl(), FakeTime()
    err = Unreachable("not every worker joined within 5s (--connect-timeout): a:1, b:2")
    assert _end(err, control, fake) == EXIT_UNAVAILABLE
    assert control.calls == [("finish", State.FAILED, str(err))]
    assert capsys.readouterr().err.strip() == f"psctl: error: {err}; giving up (exit 69)"


@pytest.mark.parametrize(
    "err",
    [
        FakeOpError(UNAVAILABLE, f"Socket closed {PS}"),
        FakeOpError(UNAVAILABLE, f"Socket closed {WORKER}"),  # got past the loop
        FakeWrapper(FakeOpError(ABORTED, PS)),
    ],
    ids=["ps", "worker past the loop", "wrapped"],
)
def test_cluster_failure_waits_for_the_ps_then_restarts(
    err: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    control, fake = FakeControl(ps_back_after=3, unhealthy=["ps:0", "worker:1"]), FakeTime()
    with caplog.at_level(logging.WARNING):
        assert _end(err, control, fake) == EXIT_RESTART
    assert control.calls[0][:2] == ("set_state", State.RECOVERING)
    assert control.calls[0][2].startswith("waiting for the ps tasks: ")
    assert len(control.calls) == 1
    # The ps the error names is a failure of it (counted once, by JobControl).
    assert control.failed_by_error_calls == ([] if "worker" in str(err) else ["ps:0"])
    assert control.checks == 3
    # Backoff 0.5, 1, 2 s, each with up to half again of jitter.
    assert all(d <= s <= d * 1.5 for d, s in zip([0.5, 1.0, 2.0], fake.sleeps, strict=True))
    # Two lines: what failed (the task and its address), what psctl does about it.
    assert len(caplog.records) == 2, caplog.text
    failed, action = (r.getMessage() for r in caplog.records)
    assert failed.startswith("ps:0 (10.0.0.2:2222) failed: ") or failed.startswith(
        "worker:1 (10.0.0.4:2222) failed: "
    ), failed
    assert action.startswith("restarting the training process from the latest checkpoint")
    assert "not SERVING after" not in caplog.text


def test_recovery_is_bounded(caplog: pytest.LogCaptureFixture) -> None:
    control, fake = FakeControl(ps_back_after=0), FakeTime()
    with caplog.at_level(logging.WARNING):
        assert _end(FakeOpError(UNAVAILABLE, PS), control, fake, timeout=30.0) == EXIT_RESTART
    assert 30.0 <= sum(fake.sleeps) <= 30.0 + 2.0 * 1.5
    assert max(fake.sleeps) <= 2.0 * 1.5  # backoff capped at 2 s, the health checks' period
    assert "ps tasks not SERVING after 30s (--recovery-timeout): restarting anyway" in caplog.text
    assert "then the job ends with exit 69" in caplog.text
    assert "ps:0 (10.0.0.2:2222) failed: FakeOpError: /job:ps/replica:0/task:0" in caplog.text


def test_a_stop_while_the_ps_stays_down_ends_the_job_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """docs/operations.md: a stop while the training process is being replaced ends the
    job as SIGTERM would, on the latest checkpoint. With a ps still down no new training
    process could restore or evaluate: the wait ends STOP_GRACE after the stop, not at
    --recovery-timeout."""
    control, fake = FakeControl(ps_back_after=0, unhealthy=["ps:0"]), FakeTime()
    fake_sleep = fake.sleep

    def sleep(seconds: float) -> None:
        fake_sleep(seconds)
        if len(fake.sleeps) == 2:
            control.operator_stop = True

    fake.sleep = sleep  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING):
        assert _end(FakeOpError(UNAVAILABLE, PS), control, fake, timeout=300.0) == 0
    stopped_after = sum(fake.sleeps[:2])
    waited = sum(fake.sleeps) - stopped_after  # for the ps, after the stop
    assert process.STOP_GRACE <= waited <= process.STOP_GRACE + 2.0 * 1.5, fake.sleeps
    assert "stop requested while waiting for the ps tasks: 30s more for them" in caplog.text
    assert control.calls[-1] == ("finish", State.DONE, "stopped while waiting for the ps tasks")
    assert (
        "stopped while waiting for the ps tasks (ps:0 not SERVING): the job ends on the latest "
        "checkpoint, with no final evaluation" in caplog.text
    )


def test_a_stop_before_the_ps_serve_again_restarts_for_the_final_evaluation() -> None:
    """A ps back within STOP_GRACE of the stop (psctl local restarts it): the stop is left
    to one more training process, which restores the latest checkpoint and ends with the
    final evaluation and summary (supervisor.py)."""
    control, fake = FakeControl(ps_back_after=6), FakeTime()
    control.operator_stop = True
    assert _end(FakeOpError(UNAVAILABLE, PS), control, fake) == EXIT_RESTART
    assert [c[0] for c in control.calls] == ["set_state"] and control.checks == 6


@pytest.mark.parametrize(
    "err",
    [
        ValueError("boom\nsecond line"),
        ConfigError("--job", "no job 'nope'", "give a built-in name"),
        KeyboardInterrupt(),
        FakeOpError(INVALID_ARGUMENT, "shapes differ"),
    ],
    ids=["job error", "config", "second stop signal", "op error"],
)
def test_permanent_failure_marks_failed_and_raises(err: BaseException) -> None:
    control, fake = FakeControl(), FakeTime()
    said = describe(err)  # before it is raised here (from this file: the "job's" code)
    with pytest.raises(type(err)) as raised:
        _end(err, control, fake)
    assert raised.value is err
    assert control.calls == [("finish", State.FAILED, said)]
    assert fake.sleeps == []


@pytest.mark.parametrize(
    "err",
    [ValueError("boom"), ConfigError("f", "p", "fix"), KeyboardInterrupt()],
    ids=["job error", "config", "second stop signal"],
)
def test_cli_status_of_a_raised_failure_is_the_tables(
    err: BaseException, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """end_on_error raises permanent failures for the CLI's one-line report: the status
    the CLI gives them is the one the table gives their decision."""
    from psctl.coordinator.cli import main

    def command(_args: argparse.Namespace) -> int:
        raise err

    monkeypatch.setitem(main.COMMANDS, "fake-train", command)
    status = main.run_command(argparse.Namespace(command="fake-train"))
    assert status == exit_status(FailurePolicy().decide(classify(err), scope=Scope.PROCESS))
    assert capsys.readouterr().err.startswith("psctl: ")


# ---- The supervisor: TrainingSupervisor.run with scripted training processes -------------


class FakeChild:
    """A Popen-like training process that exits with ``code`` after ``runs_for`` seconds
    of the fake clock; ``on_wait`` runs once while it is still running."""

    def __init__(
        self,
        code: int,
        fake: FakeTime,
        *,
        runs_for: float = 0.0,
        on_wait: Callable[[], None] | None = None,
    ) -> None:
        self.code = code
        self.fake = fake
        self.runs_for = runs_for
        self.on_wait = on_wait
        self.returncode: int | None = None
        self.signals: list[int] = []

    def wait(self, timeout: float | None = None) -> int:
        if self.on_wait is not None:
            on_wait, self.on_wait = self.on_wait, None
            on_wait()
        self.fake.now += self.runs_for
        self.returncode = self.code
        return self.code

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        self.signals.append(signum)


@dataclasses.dataclass(frozen=True)
class NoJitter(RestartPolicy):
    def delay(self, consecutive: int) -> float:
        return float(consecutive)  # crash n waits n seconds


class Script:
    """Starts the scripted children in turn; records the fake time and counters at each."""

    def __init__(self, fake: FakeTime, codes: list[int], *, runs_for: float = 0.0) -> None:
        self.fake = fake
        self.children = [FakeChild(c, fake, runs_for=runs_for) for c in codes]
        self.started_at: list[float] = []
        self.seen: list[Counters] = []

    def __call__(self, counters: Counters) -> FakeChild:
        assert len(self.started_at) < len(self.children), "started once too often"
        self.started_at.append(self.fake.now)
        self.seen.append(dataclasses.replace(counters))
        return self.children[len(self.started_at) - 1]

    def gaps(self) -> list[float]:
        return [round(b - a, 6) for a, b in zip(self.started_at, self.started_at[1:], strict=False)]


def supervise(
    codes: list[int], *, policy: RestartPolicy | None = None, runs_for: float = 0.0
) -> tuple[int, Script, TrainingSupervisor]:
    fake = FakeTime()
    script = Script(fake, codes, runs_for=runs_for)
    supervisor = TrainingSupervisor(
        script,  # type: ignore[arg-type]
        policy=policy or NoJitter(),
        clock=fake.clock,
        sleep=fake.sleep,
    )
    return supervisor.run(), script, supervisor


def test_supervisor_done() -> None:
    status, script, sup = supervise([0])
    assert (status, len(script.started_at), sup.counters) == (0, 1, Counters())


@pytest.mark.parametrize("code", [78, 1, 2, 69, 130], ids=lambda c: f"exit {c}")
def test_supervisor_permanent_failure_ends_with_the_childs_status(code: int) -> None:
    status, script, sup = supervise([code])
    assert (status, len(script.started_at), sup.counters.restarts) == (code, 1, 0)


def test_supervisor_restart_requested(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        status, script, sup = supervise([75, 75, 0])
    assert status == 0
    assert script.gaps() == [0.5, 0.5]
    assert sup.counters == Counters(restarts=2)
    assert [c.restarts for c in script.seen] == [0, 1, 2]
    assert "the training process asked for a fresh start: restarting it in 0.5s" in caplog.text


def test_supervisor_crash_restarts_with_backoff(caplog: pytest.LogCaptureFixture) -> None:
    kill = -signal.SIGKILL
    with caplog.at_level(logging.WARNING):
        status, script, sup = supervise([kill, kill, 75, kill, 0])
    assert status == 0
    # Backoff grows with consecutive crashes; a requested restart resets it.
    assert script.gaps() == [1.0, 2.0, 0.5, 1.0]
    assert sup.counters == Counters(restarts=4, coordinator_failures=3)
    assert "the training process ended with killed by SIGKILL: restarting it in 1.0s" in caplog.text


def test_default_backoff_has_jitter_within_bounds() -> None:
    status, script, _ = supervise([-signal.SIGKILL, -signal.SIGKILL, 0], policy=RestartPolicy())
    assert status == 0
    first, second = script.gaps()
    assert 0.5 <= first <= 1.0 and 1.0 <= second <= 2.0


def test_supervisor_gives_up_after_the_budget(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        status, script, sup = supervise([75, -signal.SIGKILL, 75], policy=NoJitter(max_restarts=2))
    # Its own status: not the job's code raising (1), not a configuration error (78).
    assert status == EXIT_GAVE_UP == 70
    assert len(script.started_at) == 3
    assert sup.counters.restarts == 2
    assert "2 restarts within 600s already: giving up (job FAILED, exit 70)" in caplog.text


def test_supervisor_budget_is_per_window() -> None:
    # Runs of 700 s: never 2 restarts in a 600 s window; runs of 100 s: the second is.
    policy = NoJitter(max_restarts=1, window=600.0)
    status, _, sup = supervise([75, 75, 75, 0], policy=policy, runs_for=700.0)
    assert (status, sup.counters.restarts) == (0, 3)
    status, _, sup = supervise([75, 75], policy=policy, runs_for=100.0)
    assert (status, sup.counters.restarts) == (EXIT_GAVE_UP, 1)


def test_supervisor_never_retries_unreachable_servers() -> None:
    """A ps that stays down: the training process waits --recovery-timeout and asks for a
    restart (75); the next one finds the ps's port closed for --connect-timeout and exits
    69, which ends the job however much budget is left."""
    status, script, sup = supervise([75, EXIT_UNAVAILABLE], policy=NoJitter(max_restarts=10))
    assert (status, len(script.started_at), sup.counters.restarts) == (69, 2, 1)


@pytest.mark.parametrize(
    ("code", "status"),
    [(0, 0), (-signal.SIGTERM, 130), (-signal.SIGKILL, 130), (75, 75), (1, 1)],
    ids=["graceful", "killed by SIGTERM", "killed by SIGKILL", "asked restart", "failed"],
)
def test_supervisor_never_restarts_after_a_stop(code: int, status: int) -> None:
    fake = FakeTime()
    holder: list[TrainingSupervisor] = []
    child = FakeChild(code, fake, on_wait=lambda: holder[0].request_stop(signal.SIGTERM))
    starts: list[Counters] = []

    def start(counters: Counters) -> FakeChild:
        starts.append(counters)
        return child

    sup = TrainingSupervisor(
        start,  # type: ignore[arg-type]
        policy=NoJitter(),
        clock=fake.clock,
        sleep=fake.sleep,
    )
    holder.append(sup)
    assert sup.run() == status
    assert len(starts) == 1
    assert child.signals == [signal.SIGTERM]  # forwarded while it ran
    assert sup.counters.restarts == 0


def test_a_stop_signal_sent_twice_at_once_is_one_stop() -> None:
    """`timeout` signals the command and then its process group: the launcher gets SIGTERM
    twice at once. Forwarded twice, the training process took the second as the abort
    (exit 130, no checkpoint). Once within STOP_ECHO; a later one is the second stop."""
    fake = FakeTime()
    holder: list[TrainingSupervisor] = []

    def stops() -> None:
        holder[0].request_stop(signal.SIGTERM)
        holder[0].request_stop(signal.SIGTERM)  # the process group's copy
        fake.now += STOP_ECHO / 2
        holder[0].request_stop(signal.SIGTERM)
        assert child.signals == [signal.SIGTERM]
        fake.now += STOP_ECHO
        holder[0].request_stop(signal.SIGTERM)  # an operator's second stop

    child = FakeChild(0, fake, on_wait=stops)
    sup = TrainingSupervisor(
        lambda counters: child,  # type: ignore[arg-type,return-value]
        policy=NoJitter(),
        clock=fake.clock,
        sleep=fake.sleep,
    )
    holder.append(sup)
    assert sup.run() == 0
    assert child.signals == [signal.SIGTERM, signal.SIGTERM]


def test_supervisor_stop_during_backoff() -> None:
    fake = FakeTime()
    sup_ref: list[TrainingSupervisor] = []
    ticks: list[float] = []

    def tick() -> None:
        ticks.append(fake.now)
        if len(ticks) == 3:
            sup_ref[0].request_stop(signal.SIGINT)

    script = Script(fake, [-signal.SIGKILL, 0])
    sup = TrainingSupervisor(
        script,  # type: ignore[arg-type]
        policy=NoJitter(),
        tick=tick,
        clock=fake.clock,
        sleep=fake.sleep,
    )
    sup_ref.append(sup)
    assert sup.run() == EXIT_INTERRUPTED
    assert len(script.started_at) == 1  # never started again
    assert max(fake.sleeps) <= 0.2  # slept in slices, ticking


# ---- Servers that never come up: the real `psctl train`, end to end ---------------------


@pytest.mark.timeout(30)
def test_psctl_train_against_servers_that_never_listen_exits_69_after_connect_timeout(
    tmp_path: Path,
) -> None:
    """The documented rule: exit 69 within --connect-timeout plus start-up, one attempt
    (no restart by the supervisor, whatever --max-restarts allows)."""
    chief, ps, worker = free_ports(3)  # free a moment ago: nobody listens there
    cluster = tmp_path / "cluster.json"
    cluster.write_text(
        json.dumps(
            {
                "cluster": {
                    "chief": [f"127.0.0.1:{chief}"],
                    "ps": [f"127.0.0.1:{ps}"],
                    "worker": [f"127.0.0.1:{worker}"],
                }
            }
        )
    )
    argv = psctl_argv("train", "--cluster", str(cluster), "--connect-timeout", "2")
    argv += ["--max-restarts", "10", "--metrics-port", "0", "--control-address", "127.0.0.1:0"]
    started = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=25, env=child_env())
    elapsed = time.monotonic() - started
    assert proc.returncode == EXIT_UNAVAILABLE == 69, proc.stderr
    assert 2.0 <= elapsed < 2.0 + 10.0, elapsed
    assert proc.stderr.count("waiting up to 2s for 2 server(s) to listen") == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        f"psctl: error: servers not reachable after 2s (--connect-timeout): "
        f"ps:0 (127.0.0.1:{ps}), worker:0 (127.0.0.1:{worker}); giving up (exit 69)"
    ), proc.stderr
    assert "Traceback" not in proc.stderr


# ---- What the logs say: one line per error, the tasks it names -------------------------

TF_PS_KILLED = (
    "Graph execution error:\n\nDetected at node while/body/_1/ReadVariableOp/_22 defined at "
    "(most recent call last):\n<stack traces unavailable>\n2 root error(s) found.\n"
    "  (0) UNAVAILABLE:  failed to connect to all addresses; last error: UNKNOWN: "
    "ipv4:10.0.0.2:2222: Failed to connect to remote host: Connection refused\n"
    "Additional GRPC error information from remote target /job:ps/replica:0/task:0/device:CPU:0"
    " while calling /tensorflow.eager.EagerService/RunComponentFunction:\n"
    ":UNKNOWN:Error received from peer  {grpc_status:14}\n"
    "\t [[{{node while/body/_1/ReadVariableOp/_22}}]]\n"
    "Additional GRPC error information from remote target /job:worker/replica:0/task:1 while "
    "calling /tensorflow.eager.EagerService/Enqueue:\n"
)


def test_describe_skips_tensorflows_boilerplate() -> None:
    err = FakeOpError(UNAVAILABLE, TF_PS_KILLED)
    assert describe(err) == (
        "FakeOpError: UNAVAILABLE:  failed to connect to all addresses; last error: UNKNOWN: "
        "ipv4:10.0.0.2:2222: Failed to connect to remote host: Connection refused"
    )
    assert describe(ValueError("boom\nsecond line")) == "ValueError: boom"
    assert describe(KeyboardInterrupt()) == "KeyboardInterrupt"
    assert describe(FakeOpError(UNAVAILABLE, "Graph execution error:\n")) == "FakeOpError"
    job_bug = (
        "Graph execution error:\n\nDetected at node while/assert_less/Assert defined at (most "
        'recent call last):\n  File "/usr/lib/python3.11/threading.py", line 1002, in '
        "_bootstrap\n\nassertion failed: [the loss is below 0.3]\n\t [[{{node while/Assert}}]]"
    )
    assert describe(FakeOpError(INVALID_ARGUMENT, job_bug)) == (
        "FakeOpError: assertion failed: [the loss is below 0.3]"
    )


def test_tasks_named_follows_wrappers_in_order() -> None:
    assert tasks_named(FakeOpError(UNAVAILABLE, TF_PS_KILLED)) == ["ps:0", "worker:1"]
    wrapped = FakeWrapper(FakeOpError(UNAVAILABLE, f"{WORKER} -> {PS}"))
    assert tasks_named(wrapped) == ["worker:1", "ps:0"]
    assert tasks_named(_cycle()) == []
    assert tasks_named(ValueError("no task")) == []


def test_failed_tasks_prefers_the_ps_the_error_names() -> None:
    control = FakeControl(unhealthy=["worker:1"])
    named = FakeOpError(UNAVAILABLE, TF_PS_KILLED)
    assert process.failed_tasks(named, control) == "ps:0 (10.0.0.2:2222)"  # type: ignore[arg-type]
    assert process.failed_tasks(ValueError(), control) == "worker:1 (10.0.0.4:2222)"  # type: ignore[arg-type]
    assert process.failed_tasks(ValueError(), FakeControl()) == "a task TensorFlow did not name"  # type: ignore[arg-type]


def test_a_failure_psctl_does_not_handle_is_logged_in_full(
    caplog: pytest.LogCaptureFixture,
) -> None:
    err = FakeOpError(
        INVALID_ARGUMENT, "Graph execution error:\n\nIncompatible shapes: [2] vs. [3]"
    )
    with caplog.at_level(logging.ERROR), pytest.raises(FakeOpError):
        _end(err, FakeControl(), FakeTime())
    assert "job FAILED, not restarted: FakeOpError: Graph execution error:" in caplog.text
    assert "Incompatible shapes: [2] vs. [3]" in caplog.text


def test_describe_names_where_a_traced_function_of_the_job_failed(tmp_path) -> None:
    """AutoGraph's errors open with "in user code:" and the frames; the line names the
    job's function, file and line, then what went wrong (was: 'ValueError: in user
    code:')."""
    import importlib.util

    import tensorflow as tf

    path = tmp_path / "my_job.py"
    path.write_text(
        "def loss_fn(labels):\n    if labels > 0:\n        return labels\n    return -labels\n"
    )
    spec = importlib.util.spec_from_file_location("my_job_for_describe", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(Exception) as caught:
        tf.function(module.loss_fn)(tf.constant([1.0, 2.0]))
    line = describe(caught.value)
    name = type(caught.value).__name__
    assert line.startswith(f"{name} in loss_fn (my_job.py, line 2): condition of if statement")
    assert "\n" not in line
    # Raised in the job's code outside a traced function: from the traceback.
    path.write_text("def dataset_fn(ctx):\n    return ctx.bogus\n")
    spec.loader.exec_module(module)
    with pytest.raises(AttributeError) as caught:
        module.dataset_fn(object())
    assert describe(caught.value) == (
        "AttributeError in dataset_fn (my_job.py, line 2): 'object' object has no attribute 'bogus'"
    )
    # Raised in psctl's, TensorFlow's or Python's code alone: no place named.
    with pytest.raises(ValueError) as caught:
        int("x")
    assert describe(caught.value).startswith("ValueError in test_describe_names_where")


def test_describe_reads_the_error_keras_wraps_from_a_layers_call() -> None:
    """Keras 3 wraps a layer's error as 'Exception encountered when calling X.call()', the
    message in bold (ANSI) below: the one line is the message (was the wrapper line)."""
    import keras
    import numpy as np

    class Picky(keras.layers.Layer):
        def call(self, ids):
            dtype = keras.backend.standardize_dtype(ids.dtype)
            raise TypeError(f"{self.name}: takes integer ids, got {dtype}")

    with pytest.raises(Exception) as caught:
        Picky(name="users")(np.zeros((2, 1), np.float32))
    assert "Exception encountered when calling" in str(caught.value)  # what Keras does
    line = describe(caught.value)
    assert line.endswith(": users: takes integer ids, got float32"), line
    assert "\x1b" not in line
