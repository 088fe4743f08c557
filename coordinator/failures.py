"""What went wrong, and what psctl does about it: ``classify(error)`` names the failure, a
``FailurePolicy`` decides, and one table gives the exit status of each decision.

Pure Python: TensorFlow's errors are recognised by their attributes, so this module (and
its tests) never imports TensorFlow.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import re
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from psctl.cluster.errors import (
    EXIT_CONFIG,
    EXIT_FAILURE,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    ConfigError,
)
from psctl.cluster.processes import scratch
from psctl.cluster.processes.logs import end_quiet_import
from psctl.coordinator.data import bad_records

__all__ = [
    "CALL_DECISIONS",
    "EXIT_GAVE_UP",
    "EXIT_INTERRUPTED",
    "EXIT_RESTART",
    "EXIT_STATUS",
    "EXIT_USAGE",
    "FINAL_EXIT_STATUSES",
    "PROCESS_DECISIONS",
    "RESTARTS",
    "Decision",
    "Failure",
    "FailurePolicy",
    "PeerLost",
    "ResizeRequested",
    "RestartFromCheckpoint",
    "Scope",
    "Unreachable",
    "classify",
    "classify_exit",
    "describe",
    "exit_status",
    "tasks_named",
]

EXIT_RESTART = 75  # EX_TEMPFAIL: "start me again" (a ps failed and is back, the model went NaN)
EXIT_INTERRUPTED = 130  # 128 + SIGINT: stopped by the operator without finishing
EXIT_GAVE_UP = 70  # EX_SOFTWARE: the supervisor's restart budget is used up: job FAILED


class RestartFromCheckpoint(Exception):
    """Raised in the training process when only a fresh one can go on: it exits with
    EXIT_RESTART, and the supervisor starts a new one that restores the latest checkpoint."""


class ResizeRequested(Exception):
    """Raised in the training process after its launcher asked for a new cluster (``psctl
    scale``, SIGHUP) and the current step is checkpointed: it exits with EXIT_RESTART, and
    the supervisor starts one on the new cluster, which restores that checkpoint. Not a
    failure: it counts no restart."""


class PeerLost(Exception):
    """Sync mode (--strategy sync): an all-reduce with another worker failed or timed out (a
    worker died, froze or restarted). Collectives cannot go on in this process: it exits
    with EXIT_RESTART, and every worker's supervisor starts the group again from the latest
    checkpoint."""


class Unreachable(Exception):
    """Servers still not listening after --connect-timeout: the job ends with
    EXIT_UNAVAILABLE. The wait was the retry; no layer above tries again."""


class Failure(enum.Enum):
    """What happened."""

    WORKER_LOST = "worker_lost"  # a scheduled call failed with its worker
    PS_LOST = "ps_lost"  # a ps, or the link to it: only a new coordinator recovers
    STOP_SIGNAL = "stop_signal"  # the operator's stop signal (a second one: KeyboardInterrupt)
    NON_FINITE = "non_finite"  # the loss or a variable is not finite: RestartFromCheckpoint
    JOB_ERROR = "job_error"  # the job's code, or anything not recognised, raised
    CONFIG_ERROR = "config_error"  # ConfigError: a mistake only the operator can fix
    UNREACHABLE = "unreachable"  # servers not listening after --connect-timeout: exit 69
    PEER_LOST = "peer_lost"  # sync mode: a collective with another worker failed: PeerLost
    # A training process's exit, as its supervisor sees it:
    RESTART_REQUESTED = "restart_requested"  # it exited EXIT_RESTART
    TRAINING_CRASHED = "training_crashed"  # it was killed by a signal


class Decision(enum.Enum):
    """What to do about it."""

    RESCHEDULE = "reschedule"  # run the call's steps again; training goes on
    RESTART = "restart"  # a fresh training process from the latest checkpoint, at once
    WAIT_FOR_PS_THEN_RESTART = "wait_for_ps_then_restart"  # RECOVERING, bounded; then RESTART
    RESTART_WITH_BACKOFF = "restart_with_backoff"  # a crash: restart after backoff, budgeted
    FAIL = "fail"  # permanent: the job is FAILED
    FAIL_CONFIG = "fail_config"  # permanent, and systemd must not restart it either
    FAIL_UNREACHABLE = "fail_unreachable"  # permanent: the servers were not there in time
    GIVE_UP = "give_up"  # the supervisor's restart budget is used up: the job is FAILED
    ABORT = "abort"  # stopped by the operator before finishing: the job is FAILED


class Scope(enum.Enum):
    """Where a failure is decided on."""

    CALL = "call"  # a scheduled call's error, in the training loop: its steps can run again
    PROCESS = "process"  # an error that ended the training process's run, or a child's exit


# Where it happened. Any decision but RESCHEDULE means "not the loop's to handle": the
# error propagates to the training process, which decides again in Scope.PROCESS.
CALL_DECISIONS: Mapping[Failure, Decision] = MappingProxyType(
    {
        Failure.WORKER_LOST: Decision.RESCHEDULE,
        Failure.PS_LOST: Decision.WAIT_FOR_PS_THEN_RESTART,
        Failure.STOP_SIGNAL: Decision.ABORT,
        Failure.NON_FINITE: Decision.RESTART,
        Failure.JOB_ERROR: Decision.FAIL,
        Failure.CONFIG_ERROR: Decision.FAIL_CONFIG,
        Failure.UNREACHABLE: Decision.FAIL_UNREACHABLE,
        Failure.PEER_LOST: Decision.RESTART,
        Failure.RESTART_REQUESTED: Decision.RESTART,
        Failure.TRAINING_CRASHED: Decision.RESTART_WITH_BACKOFF,
    }
)

# At the training process's top nothing can be run again: a lost worker's error that got
# past the loop (a join, the per-worker datasets) is recovered from as a lost ps is.
PROCESS_DECISIONS: Mapping[Failure, Decision] = MappingProxyType(
    {**CALL_DECISIONS, Failure.WORKER_LOST: Decision.WAIT_FOR_PS_THEN_RESTART}
)

# The exit status of a process that ends on a decision. RESCHEDULE and RESTART_WITH_BACKOFF
# end none: training goes on, or the supervisor starts the training process again.
EXIT_STATUS: Mapping[Decision, int] = MappingProxyType(
    {
        Decision.RESTART: EXIT_RESTART,
        Decision.WAIT_FOR_PS_THEN_RESTART: EXIT_RESTART,
        Decision.FAIL: EXIT_FAILURE,
        Decision.FAIL_CONFIG: EXIT_CONFIG,
        Decision.FAIL_UNREACHABLE: EXIT_UNAVAILABLE,
        Decision.GIVE_UP: EXIT_GAVE_UP,
        Decision.ABORT: EXIT_INTERRUPTED,
    }
)

# The decisions on which a supervisor starts the training process again.
RESTARTS = frozenset(
    {Decision.RESTART, Decision.WAIT_FOR_PS_THEN_RESTART, Decision.RESTART_WITH_BACKOFF}
)

# Every status a supervisor (`psctl train`, `psctl local`) can end a job with but 0: each
# is final, as psctl has retried what can be retried. A service manager above it (the
# coordinator unit's RestartPreventExitStatus=) must not start the job again on any.
FINAL_EXIT_STATUSES = tuple(
    sorted({EXIT_USAGE} | {s for d, s in EXIT_STATUS.items() if d not in RESTARTS})
)


def exit_status(decision: Decision) -> int:
    """The exit status of a process that ends on ``decision``."""
    try:
        return EXIT_STATUS[decision]
    except KeyError:
        raise ValueError(f"decision {decision.name} does not end a process") from None


@dataclass(frozen=True, kw_only=True)
class FailurePolicy:
    """Maps a failure to a decision: ``policy.decide(classify(err))``."""

    call: Mapping[Failure, Decision] = field(default_factory=lambda: CALL_DECISIONS)
    process: Mapping[Failure, Decision] = field(default_factory=lambda: PROCESS_DECISIONS)

    def __post_init__(self) -> None:
        for name, table in (("call", self.call), ("process", self.process)):
            missing = [f.name for f in Failure if f not in table]
            if missing:
                raise ValueError(f"{name}: no decision for {', '.join(missing)}")
        rescheduled = [f.name for f, d in self.process.items() if d is Decision.RESCHEDULE]
        if rescheduled:
            raise ValueError(
                f"process: RESCHEDULE for {', '.join(rescheduled)}; "
                "only a scheduled call can run again"
            )

    def decide(self, failure: Failure, *, scope: Scope = Scope.CALL) -> Decision:
        """What to do about ``failure`` where it was seen (see ``Scope``)."""
        return (self.call if scope is Scope.CALL else self.process)[failure]


# gRPC status codes, as TensorFlow's OpError.error_code carries them.
_CANCELLED = 1
_INVALID_ARGUMENT = 3
_DEADLINE_EXCEEDED = 4
_ABORTED = 10
_UNAVAILABLE = 14
_WORKER_LOSS_CODES = frozenset({_UNAVAILABLE, _ABORTED})
_CLUSTER_CODES = frozenset({_UNAVAILABLE, _ABORTED, _CANCELLED, _DEADLINE_EXCEEDED})
_INTERNAL = 13
# A task that could not read a request the coordinator sent: the request was garbled on its
# way (seen once in CI, on a worker just added by psctl scale, beside the coordinator's
# "String field 'tensorflow.eager.Operation.device' contains invalid UTF-8 data"). Nothing
# of the job's code is wrong: a new coordinator, from the latest checkpoint, recovers it.
_GARBLED = "Unable to parse request"


def unstaged(err: BaseException) -> BaseException:
    """The error itself where TensorFlow's autograph re-raised it as a ``StagingError`` (it
    does so for an exception whose constructor takes more than a message, ConfigError's
    included: a too-small eval set found while ``--eval-every``'s function was traced was
    exit 1 and a traceback): the original, its ``__context__``."""
    while type(err).__name__ == "StagingError" and isinstance(err.__context__, BaseException):
        err = err.__context__
    return err


def classify(err: BaseException) -> Failure:
    """Names what ``err`` means for the job (see ``Failure``)."""
    err = unstaged(err)
    if isinstance(err, RestartFromCheckpoint):
        return Failure.NON_FINITE
    if isinstance(err, ConfigError) or bad_records.found_in(err) is not None:
        return Failure.CONFIG_ERROR  # a bad record a worker's reader found: as a bad file
    if isinstance(err, Unreachable):
        return Failure.UNREACHABLE
    if isinstance(err, PeerLost):
        return Failure.PEER_LOST
    if isinstance(err, KeyboardInterrupt):
        return Failure.STOP_SIGNAL
    if _op_error_code(err) in _WORKER_LOSS_CODES:
        text = str(err)
        if "/job:worker" in text and "/job:ps" not in text:
            return Failure.WORKER_LOST
    if _is_cluster_failure(err, seen=set()):
        return Failure.PS_LOST
    return Failure.JOB_ERROR


# Sync mode: the signal that ends a training process whose workers did not all join within
# --connect-timeout (training/sync.py arms it; default action: the process ends). TensorFlow
# waits for the group holding the GIL, so nothing in Python could end the wait.
JOIN_DEADLINE = signal.SIGALRM


def classify_exit(code: int) -> Failure | None:
    """What a training process's exit status (``Popen.returncode``) says; None: it finished."""
    if code == 0:
        return None
    if code == -JOIN_DEADLINE:
        return Failure.UNREACHABLE
    if code < 0:
        return Failure.TRAINING_CRASHED
    if code == EXIT_RESTART:
        return Failure.RESTART_REQUESTED
    if code == EXIT_CONFIG:
        return Failure.CONFIG_ERROR
    if code == EXIT_UNAVAILABLE:
        return Failure.UNREACHABLE
    if code == EXIT_INTERRUPTED:
        return Failure.STOP_SIGNAL
    return Failure.JOB_ERROR  # 1, a bad command line (2), anything else


def _op_error_code(err: BaseException) -> int | None:
    """TensorFlow's OpError (``tf.errors.*``) by its attributes: an int ``error_code`` (a
    gRPC status code) and a str ``message``."""
    code: object = getattr(err, "error_code", None)
    if not isinstance(code, int) or isinstance(code, bool):
        return None
    return code if isinstance(getattr(err, "message", None), str) else None


def _is_cluster_failure(err: BaseException, *, seen: set[int]) -> bool:
    """A task became unreachable (a ps, or the links to it): recoverable by a new
    coordinator. A wrapper (ClosureInputError, ClosureAbortedError) is one when what it
    wraps is."""
    seen.add(id(err))
    code = _op_error_code(err)
    if code in _CLUSTER_CODES:
        return True
    original = getattr(err, "original_exception", None)
    if original is not None and original is not err:
        return (
            isinstance(original, BaseException)
            and id(original) not in seen
            and _is_cluster_failure(original, seen=seen)
        )
    if code == _INTERNAL and _GARBLED in str(err):
        return True
    return code == _INVALID_ARGUMENT and "unknown device" in str(err).lower()


# Lines TensorFlow puts around the one that says what went wrong.
_BOILERPLATE = re.compile(
    r"Graph execution error:|Detected at node |<stack traces unavailable>|\d+ root error\(s\) "
    r"found|Additional GRPC error information|:UNKNOWN:Error received from peer|\[\[|"
    r"\d+ successful operations|\d+ derived errors ignored|File \"|"
    r"Exception encountered when calling "  # Keras's wrapper of a layer's error
)
_TASK = re.compile(r"/job:(ps|worker|chief)/replica:\d+/task:(\d+)")


_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Keras's bold in the messages it wraps
_TEXT_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')


def describe(err: BaseException) -> str:
    """One line for a log or a status: the error's type, where in the job's own code it
    was raised (if it was), and the line that says what went wrong (TensorFlow's messages
    open with "Graph execution error:" and node names; a traced function's, "in user
    code:", end with it after the frames)."""
    name, text = type(err).__name__, str(err)
    message = ""
    if text.lstrip().startswith("in user code:"):
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        message = lines[-1].removeprefix(f"{name}: ")
        frames = [m.groups() for m in map(_TEXT_FRAME.match, lines) if m]
    else:
        for line in _ANSI.sub("", text).splitlines():
            line = re.sub(r"^\(\d+\)\s*", "", line.strip())
            line = re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", line)  # TF's op prefix
            if line and not _BOILERPLATE.match(line):
                message = line
                break
        frames = []
        tb = err.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            frames.append((code.co_filename, str(tb.tb_lineno), code.co_name))
            tb = tb.tb_next
    mine = [(path, line, function) for path, line, function in frames if _users_file(path)]
    if mine:
        path, line, function = mine[-1]
        name = f"{name} in {function} ({os.path.basename(path)}, line {line})"
    return f"{name}: {message}" if message else name


def _users_file(path: str) -> bool:
    """Whether ``path`` is the job's own code: not psctl's, TensorFlow's, Keras's or any
    other installed package's, nor Python's, nor AutoGraph's generated copies."""
    if path.startswith("<") or "__autograph_generated_file" in path:
        return False
    roots = _library_roots()
    return not any(p.startswith(roots) for p in (path, os.path.realpath(path)))


@functools.cache
def _library_roots() -> tuple[str, ...]:
    import sysconfig

    import psctl

    # psctl's subpackages may be links to elsewhere (an editable install of the repo).
    roots = {os.path.realpath(e.path) for p in psctl.__path__ for e in os.scandir(p) if e.is_dir()}
    roots |= set(psctl.__path__)
    paths = sysconfig.get_paths()
    roots |= {os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots |= {os.path.realpath(p) for p in sys.path if "-packages" in p}
    return tuple(root.rstrip(os.sep) + os.sep for root in roots)


def tasks_named(err: BaseException) -> list[str]:
    """The tasks ("ps:0", "worker:1") that ``err`` and the errors it wraps name, in order."""
    found: dict[str, None] = {}
    seen: set[int] = set()
    current: object = err
    while isinstance(current, BaseException) and id(current) not in seen:
        seen.add(id(current))
        for task_type, index in _TASK.findall(str(current)):
            found[f"{task_type}:{index}"] = None
        current = getattr(current, "original_exception", None)
    return list(found)


def restart_if_starting(starting: bool, why: str) -> None:
    """A training process that learns its cluster changed (a task left, a resize) before it
    trained a step: it may be blocked in TensorFlow's connection to a task that is gone,
    where no flag is ever read (seen in bench/soak.py: 140 s, until it was killed), and it
    has nothing to save. So it exits at once with EXIT_RESTART; its supervisor starts the
    next one on the new cluster, which restores the latest checkpoint."""
    if not starting:
        return
    logging.getLogger(__name__).warning(
        "%s while this process starts: it exits for a fresh start on the new cluster "
        "(nothing trained yet)",
        why,
    )
    sys.stderr.flush()
    end_quiet_import()
    scratch.remove_private_tempdir()
    os._exit(EXIT_RESTART)
