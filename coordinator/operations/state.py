"""The job's life-cycle states and the transitions between them.

The values are the wire values of ``psctl.control.v1.JobState``: GetStatus reports them as
they are, and ``psctl_coordinator_state`` exports their lower-case names.

``TRANSITIONS`` lists every transition the coordinator makes (see its comments for where);
``JobControl.set_state`` refuses any other with ``InvalidTransition``. Setting the state a
job already has is not a transition and is always allowed.

CHECKPOINTING is never set: a checkpoint is an activity that runs beside training, and
CHECKPOINTING is the state *reported* while it runs beside one of ``ACTIVITY_HOST_STATES``
(``JobControl.activity("checkpointing")``, training/saving/checkpoints.py).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

from psctl.control.v1 import control_pb2


class State(enum.Enum):
    STARTING = control_pb2.JOB_STATE_STARTING
    RUNNING = control_pb2.JOB_STATE_RUNNING
    PAUSED = control_pb2.JOB_STATE_PAUSED
    CHECKPOINTING = control_pb2.JOB_STATE_CHECKPOINTING
    RECOVERING = control_pb2.JOB_STATE_RECOVERING
    STOPPING = control_pb2.JOB_STATE_STOPPING
    DONE = control_pb2.JOB_STATE_DONE
    FAILED = control_pb2.JOB_STATE_FAILED

    @property
    def final(self) -> bool:
        """DONE or FAILED: nothing follows."""
        return self in FINAL_STATES

    def can_become(self, other: State) -> bool:
        """Whether ``self -> other`` is an allowed transition (``other is self`` is none)."""
        return other in TRANSITIONS[self]


class InvalidTransition(ValueError):
    """A state change the table does not allow; the state is left as it was."""

    def __init__(self, old: State, new: State) -> None:
        allowed = ", ".join(s.name for s in sorted(TRANSITIONS[old], key=_order)) or "none"
        super().__init__(
            f"job state cannot go from {old.name} to {new.name} (from {old.name}: {allowed})"
        )
        self.old = old
        self.new = new


def _order(state: State) -> int:
    return int(state.value)


FINAL_STATES: frozenset[State] = frozenset({State.DONE, State.FAILED})
# States in which the loop schedules steps, or will: pause and resume make sense there.
SCHEDULING_STATES: frozenset[State] = frozenset({State.STARTING, State.RUNNING, State.PAUSED})
# States in which the loop serves a requested checkpoint.
CHECKPOINT_STATES: frozenset[State] = frozenset({State.RUNNING, State.PAUSED})

# Where each transition happens: loop = TrainingLoop in coordinator/training/loop.py (both
# strategies; train() sets STOPPING), process = the training process's end in
# coordinator/launch/process.py (end_on_error, recover; complete, from
# coordinator/training/reporting/summary.py). No other code sets one.
# Every non-final state may fail: end_on_error calls finish(FAILED) whatever the state was.
TRANSITIONS: Mapping[State, frozenset[State]] = MappingProxyType(
    {
        State.STARTING: frozenset(
            {
                State.RUNNING,  # loop.run: steps left to train
                State.STOPPING,  # loop.train: nothing to train, or a stop came first
                State.RECOVERING,  # process: cluster failure or RestartFromCheckpoint
                State.FAILED,
            }
        ),
        State.RUNNING: frozenset(
            {
                State.PAUSED,  # loop.run: pause requested
                State.STOPPING,  # loop.train: all scheduled, or a stop requested
                State.RECOVERING,
                State.FAILED,
            }
        ),
        State.PAUSED: frozenset(
            {
                State.RUNNING,  # loop.run: resume requested
                State.STOPPING,  # loop.train: a stop requested while paused
                State.RECOVERING,
                State.FAILED,
            }
        ),
        # Only reported (the checkpointing activity), never set: nothing leads here.
        State.CHECKPOINTING: frozenset({State.FAILED}),
        State.STOPPING: frozenset(
            {
                State.DONE,  # complete: DONE after the final checkpoint and eval
                State.RECOVERING,  # process: the final save refused a NaN, or a ps failed
                State.FAILED,
            }
        ),
        # The process exits and its supervisor starts a new one (which starts STARTING).
        State.RECOVERING: frozenset(
            {
                State.DONE,  # process.recover: stopped while a ps is down (no new process)
                State.FAILED,
            }
        ),
        State.DONE: frozenset(),
        State.FAILED: frozenset(),
    }
)

# Activities that run beside a state rather than replacing it, and the state GetStatus and
# psctl_coordinator_state report while one runs.
ACTIVITIES: Mapping[str, State] = MappingProxyType({"checkpointing": State.CHECKPOINTING})
# The states an activity is reported over; in any other (STARTING, RECOVERING, DONE, FAILED)
# the state itself is reported.
ACTIVITY_HOST_STATES: frozenset[State] = frozenset({State.RUNNING, State.PAUSED, State.STOPPING})


def check_transition(old: State, new: State) -> None:
    """Raise ``InvalidTransition`` unless ``old -> new`` is allowed or ``new is old``."""
    if new is not old and not old.can_become(new):
        raise InvalidTransition(old, new)
