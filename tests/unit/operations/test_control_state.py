"""The job-state table (operations/state.py) and JobControl's enforcement of it, activities
included: no gRPC, no TensorFlow."""

from __future__ import annotations

import itertools
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from psctl.cluster.address import Address
from psctl.cluster.errors import ConfigError
from psctl.cluster.ports import HealthAddresses
from psctl.control.v1 import control_pb2
from psctl.coordinator.operations.job_state import JobControl, Rejected
from psctl.coordinator.operations.metrics import STATES
from psctl.coordinator.operations.state import (
    ACTIVITIES,
    ACTIVITY_HOST_STATES,
    FINAL_STATES,
    TRANSITIONS,
    InvalidTransition,
    State,
    check_transition,
)

pytestmark = pytest.mark.timeout(30)

ALLOWED = [
    (old, new)
    for old, targets in TRANSITIONS.items()
    for new in sorted(targets, key=str)
    if old is not State.CHECKPOINTING  # never set, so never left
]
FORBIDDEN = [
    (old, new)
    for old, new in itertools.product(State, State)
    if new is not old and new not in TRANSITIONS[old] and old is not State.CHECKPOINTING
]


def _paths() -> dict[State, list[State]]:
    """A shortest path of set_state calls from STARTING to every reachable state."""
    paths: dict[State, list[State]] = {State.STARTING: []}
    queue = [State.STARTING]
    while queue:
        old = queue.pop(0)
        for new in sorted(TRANSITIONS[old], key=str):
            if new not in paths:
                paths[new] = [*paths[old], new]
                queue.append(new)
    return paths


PATHS = _paths()


def new_control(on_state: Callable[[str], None] | None = None) -> JobControl:
    return JobControl(
        job="unit",
        target_steps=10,
        steps_per_execution=1,
        tasks=[],
        can_checkpoint=True,
        on_state=on_state,
    )


def control_in(state: State, on_state: Callable[[str], None] | None = None) -> JobControl:
    control = new_control(on_state)
    for step in PATHS[state]:
        control.set_state(step)
    assert control.state is state
    return control


# -- the table ---------------------------------------------------------------------------


def test_the_table_covers_every_state_and_matches_the_wire_values():
    assert set(TRANSITIONS) == set(State)
    for state in State:
        assert control_pb2.JobState.Name(state.value) == f"JOB_STATE_{state.name}"
        assert state not in TRANSITIONS[state]  # the same state is not a transition
    # CHECKPOINTING is only reported (the checkpointing activity), never set.
    assert set(PATHS) == set(State) - {State.CHECKPOINTING}, "reachable from STARTING"


def test_metrics_states_are_the_enums_names():
    assert [s.name.lower() for s in State] == STATES


@pytest.mark.parametrize(("old", "new"), ALLOWED, ids=lambda s: s.name)
def test_every_allowed_transition_is_accepted(old: State, new: State):
    assert old.can_become(new)
    check_transition(old, new)
    control = control_in(old)
    control.set_state(new, "why")
    assert control.state is new
    assert control.view().board.message == "why"


@pytest.mark.parametrize(("old", "new"), FORBIDDEN, ids=lambda s: s.name)
def test_every_other_transition_is_refused(old: State, new: State):
    assert not old.can_become(new)
    with pytest.raises(InvalidTransition, match=f"from {old.name} to {new.name}"):
        check_transition(old, new)
    control = control_in(old)
    control.set_message("before")
    with pytest.raises(InvalidTransition) as err:
        control.set_state(new, "after")
    assert (err.value.old, err.value.new) == (old, new)
    assert isinstance(err.value, ValueError)
    assert control.state is old
    assert control.view().board.message == "before"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (State.STARTING, State.DONE),
        (State.RUNNING, State.DONE),  # DONE comes after STOPPING (final checkpoint, eval)
        (State.RUNNING, State.STARTING),
        (State.STOPPING, State.RUNNING),  # a save putting back a stale state
        (State.RECOVERING, State.RUNNING),  # recovery is a new process
        (State.RUNNING, State.CHECKPOINTING),  # an activity, never a state
    ],
    ids=lambda s: s.name,
)
def test_some_forbidden_transitions(old: State, new: State):
    assert (old, new) in FORBIDDEN


@pytest.mark.parametrize("final", sorted(FINAL_STATES, key=str), ids=lambda s: s.name)
def test_final_states_are_final(final: State):
    assert final.final and not TRANSITIONS[final]
    control = control_in(final)
    for other in State:
        if other is not final:
            with pytest.raises(InvalidTransition):
                control.set_state(other)
    assert control.state is final


def test_every_unfinished_state_can_fail():
    for state in State:
        assert state.final or state.can_become(State.FAILED), state


def test_the_same_state_again_is_no_transition_and_sets_the_message():
    seen: list[str] = []
    control = new_control(on_state=seen.append)
    control.set_state(State.RUNNING)
    control.set_state(State.RUNNING, "again")
    assert control.state is State.RUNNING
    assert control.view().board.message == "again"
    assert seen == ["running", "running"]


def test_a_refused_transition_is_logged(caplog: pytest.LogCaptureFixture):
    control = control_in(State.DONE)
    with caplog.at_level(logging.ERROR), pytest.raises(InvalidTransition):
        control.set_state(State.RUNNING)
    assert "from DONE to RUNNING" in caplog.text


# -- what the trainer and train.py do today ----------------------------------------------


def test_checkpointing_is_never_set_only_reported():
    for state in (State.STARTING, State.RUNNING, State.PAUSED, State.STOPPING):
        with pytest.raises(InvalidTransition):
            control_in(state).set_state(State.CHECKPOINTING)
    control = control_in(State.RUNNING)
    with control.activity("checkpointing"):
        assert control.view().state.value == control_pb2.JOB_STATE_CHECKPOINTING
        control.set_state(State.PAUSED, "paused by request")  # the loop moves on meanwhile
    assert control.state is State.PAUSED


def test_a_typical_run():
    control = new_control()
    for state in (State.RUNNING, State.PAUSED, State.RUNNING, State.STOPPING):
        control.set_state(state)
    control.finish(State.DONE)
    assert control.state is State.DONE


@pytest.mark.parametrize("state", [s for s in State if not s.final], ids=lambda s: s.name)
def test_recovering_and_failed_come_from_any_unfinished_state(state: State):
    assert state.can_become(State.FAILED)
    if state not in (State.RECOVERING, State.CHECKPOINTING):
        assert state.can_become(State.RECOVERING)


def test_finish_rejects_pending_checkpoints_and_a_second_outcome_is_ignored(
    caplog: pytest.LogCaptureFixture,
):
    control = control_in(State.RUNNING)
    pending = control.request_checkpoint()
    control.set_state(State.STOPPING)
    control.finish(State.DONE)
    with pytest.raises(Rejected, match="DONE"):
        pending.future.result(timeout=1)
    with caplog.at_level(logging.ERROR):
        control.finish(State.FAILED, "late")  # an error handler after DONE: logged, no raise
    assert control.state is State.DONE
    assert "finish(FAILED) ignored" in caplog.text
    control.finish(State.DONE)  # the same outcome again: nothing happens
    assert control.state is State.DONE


def test_finish_takes_only_final_states_and_follows_the_table():
    control = control_in(State.RUNNING)
    with pytest.raises(ValueError, match="DONE or FAILED"):
        control.finish(State.STOPPING)
    pending = control.request_checkpoint()
    with pytest.raises(InvalidTransition):
        control.finish(State.DONE)  # not after STOPPING
    assert control.state is State.RUNNING
    assert not pending.future.done()  # a refused finish answers nothing
    control.finish(State.FAILED)
    assert control.state is State.FAILED


# -- activities --------------------------------------------------------------------------


@pytest.mark.parametrize("host", sorted(ACTIVITY_HOST_STATES, key=str), ids=lambda s: s.name)
def test_an_activity_is_reported_over_its_host_state(host: State):
    seen: list[str] = []
    control = control_in(host, on_state=seen.append)
    seen.clear()
    control.begin_activity("checkpointing")
    assert control.state is host
    assert control.reported_state is State.CHECKPOINTING
    assert control.view().state.value == control_pb2.JOB_STATE_CHECKPOINTING
    control.end_activity("checkpointing")
    assert control.reported_state is host
    assert control.view().state.value == host.value
    assert seen == ["checkpointing", host.name.lower()]


@pytest.mark.parametrize(
    "state",
    [s for s in State if s not in ACTIVITY_HOST_STATES and s is not State.CHECKPOINTING],
    ids=lambda s: s.name,
)
def test_other_states_are_reported_as_they_are_during_an_activity(state: State):
    control = control_in(state)
    with control.activity("checkpointing"):
        assert control.reported_state is state
        assert control.view().state.value == state.value


def test_the_state_moves_under_a_running_activity():
    seen: list[str] = []
    control = control_in(State.RUNNING, on_state=seen.append)
    seen.clear()
    control.begin_activity("checkpointing")
    control.set_state(State.PAUSED, "paused by request")  # the loop pauses during a save
    assert control.reported_state is State.CHECKPOINTING
    control.set_state(State.STOPPING)
    control.end_activity("checkpointing")
    assert control.reported_state is State.STOPPING
    assert control.view().board.message == ""
    control.finish(State.DONE)
    assert seen == ["checkpointing", "checkpointing", "checkpointing", "stopping", "done"]


def test_activities_nest_and_a_stray_end_is_logged(caplog: pytest.LogCaptureFixture):
    control = control_in(State.RUNNING)
    control.begin_activity("checkpointing")
    control.begin_activity("checkpointing")
    control.end_activity("checkpointing")
    assert control.reported_state is State.CHECKPOINTING
    control.end_activity("checkpointing")
    assert control.reported_state is State.RUNNING
    with caplog.at_level(logging.ERROR):
        control.end_activity("checkpointing")
    assert "without begin_activity" in caplog.text
    assert control.reported_state is State.RUNNING


def test_the_activity_context_ends_on_error():
    control = control_in(State.RUNNING)
    with pytest.raises(OSError), control.activity("checkpointing"):
        raise OSError("disk full")
    assert control.reported_state is State.RUNNING


def test_unknown_activities_are_refused():
    assert set(ACTIVITIES) == {"checkpointing"}
    control = control_in(State.RUNNING)
    with pytest.raises(ValueError, match="unknown activity"):
        control.begin_activity("saving")
    with pytest.raises(ValueError, match="unknown activity"):
        control.end_activity("saving")


def test_operator_requests_during_an_activity_follow_the_underlying_state():
    control = control_in(State.RUNNING)
    with control.activity("checkpointing"):
        assert control.request_pause() is State.CHECKPOINTING  # the reported state
        assert control.request_resume() is State.CHECKPOINTING
        control.request_checkpoint()
        assert control.request_stop() is State.CHECKPOINTING
    control = control_in(State.STOPPING)
    with control.activity("checkpointing"):  # the final checkpoint
        with pytest.raises(Rejected, match="STOPPING"):
            control.request_pause()
        with pytest.raises(Rejected, match="STOPPING"):
            control.request_checkpoint()


def test_the_state_callback_ends_on_the_latest_state():
    seen: list[str] = []
    control = control_in(State.RUNNING, on_state=seen.append)

    def save() -> None:
        for _ in range(200):
            with control.activity("checkpointing"):
                pass

    thread = threading.Thread(target=save)
    thread.start()
    for _ in range(100):
        control.set_state(State.PAUSED)
        control.set_state(State.RUNNING)
    thread.join()
    assert seen[-1] == "running"


# -- the cluster file's health section (psctl health, psctl deploy) -----------------------


def test_health_addresses_from_the_cluster_file_else_tf_port_plus_offset(tmp_path: Path):
    assert HealthAddresses.of_file(None).explicit == {}
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"cluster": {}}))
    assert HealthAddresses.of_file(str(path)).explicit == {}
    path.write_text(
        json.dumps({"cluster": {}, "health": {"ps": ["h:1", "h:2"], "worker": ["w:3"]}})
    )
    health = HealthAddresses.of_file(str(path))
    assert health.explicit == {
        ("ps", 0): Address("h", 1),
        ("ps", 1): Address("h", 2),
        ("worker", 0): Address("w", 3),
    }
    assert health.get("ps", 1, Address("p", 2222)) == Address("h", 2)
    assert health.get("worker", 1, Address("w", 2222)) == Address("w", 3222)
    # No port past 65535: none where a lookup may do without, one line where it may not.
    assert health.get("worker", 1, Address("w", 65000)) is None
    with pytest.raises(ConfigError, match="worker:1: default port 65000"):
        health.require("worker", 1, Address("w", 65000), field="worker:1")
    assert HealthAddresses(offset=7).get("ps", 0, Address("p", 10)) == Address("p", 17)
    with pytest.raises(ConfigError, match=r"health.worker\[0\]: names a task the cluster"):
        health.check_tasks({"ps": 2, "worker": 0})
    health.check_tasks({"ps": 2, "worker": 1})


@pytest.mark.parametrize("stop", ["request_stop", "stop_on_signal"])
def test_an_operators_stop_wins_over_a_resize(stop):
    """A stop and a resize both end the loop; with both asked for, in either order, the
    run ends as a stop (evaluation, summary, exit 0): the launcher starts no process after
    a stop, so an exit for the resize would lose the summary (found by bench/soak.py)."""
    before = control_in(State.RUNNING)
    before.request_resize()
    getattr(before, stop)()
    after = control_in(State.RUNNING)
    getattr(after, stop)()
    after.request_resize()
    for control in (before, after):
        assert control.stop_requested.is_set() and control.operator_stop
        assert not control.resize_requested.is_set()
    alone = control_in(State.RUNNING)
    alone.request_resize()
    assert alone.stop_requested.is_set() and alone.resize_requested.is_set()
    # A resize is no operator's stop: a recovery waiting for a lost ps goes on waiting.
    assert not alone.operator_stop


def test_psctl_stop_says_the_final_step_only_when_it_saw_the_end():
    """The steps in flight at a stop finish after it: a status seen before DONE is not the
    final step (was printed as 'coordinator stopped at step 11794' for a job ending 12190)."""
    from psctl.control.v1 import control_pb2
    from psctl.coordinator.operations.client import stopped_at

    done = control_pb2.Status(state=control_pb2.JOB_STATE_DONE, global_step=12190)
    stopping = control_pb2.Status(state=control_pb2.JOB_STATE_STOPPING, global_step=11794)
    assert stopped_at(done) == " at step 12190"
    assert stopped_at(stopping) == (
        " (last seen STOPPING at step 11794; the summary has the final step)"
    )
    assert stopped_at(None) == ""
