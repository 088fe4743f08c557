"""cluster/processes/logs.py: TensorFlow's per-closure failure reports go to DEBUG, the known
``Executor.__del__`` noise too; everything else is logged and printed as before."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest

from psctl.cluster.processes.logs import configure_logging
from tests.conftest import child_env
from tests.fakes import UNAVAILABLE, FakeOpError

pytestmark = pytest.mark.timeout(10)

CLOSURE_REPORT = (
    " /job:worker/task:%d encountered the following error when processing closure: %r:%s"
)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, sys.unraisablehook)
    tf_logger = logging.getLogger("tensorflow")
    saved_tf = (tf_logger.level, tf_logger.filters[:])
    yield
    root.handlers[:], root.level, sys.unraisablehook = saved
    tf_logger.level, tf_logger.filters[:] = saved_tf


def _log_from_tensorflow(capsys: pytest.CaptureFixture[str], *, verbose: bool) -> str:
    configure_logging(verbose=verbose)
    tf_logger = logging.getLogger("tensorflow")
    tf_logger.error(
        CLOSURE_REPORT, 0, FakeOpError(UNAVAILABLE, "unavailable"), "Graph execution error:"
    )
    tf_logger.error("Remote function on worker %s failed with %r:%s", "/job:worker", 1, 2)
    tf_logger.error("a TensorFlow error psctl does not know")
    tf_logger.warning("In a `ClusterCoordinator`, creating an infinite closure queue ...")
    return capsys.readouterr().err


def test_closure_reports_are_hidden_without_verbose(restore_logging, capsys) -> None:
    err = _log_from_tensorflow(capsys, verbose=False)
    assert "encountered the following error" not in err
    assert "Remote function on worker" not in err
    assert "ERROR tensorflow: a TensorFlow error psctl does not know" in err
    assert "WARNING tensorflow: In a `ClusterCoordinator`" in err


def test_closure_reports_are_debug_with_verbose(restore_logging, capsys) -> None:
    err = _log_from_tensorflow(capsys, verbose=True)
    assert "DEBUG tensorflow:  /job:worker/task:0 encountered the following error" in err
    assert "DEBUG tensorflow: Remote function on worker /job:worker failed" in err
    assert "ERROR tensorflow: a TensorFlow error psctl does not know" in err


def test_configure_logging_twice_keeps_one_filter(restore_logging) -> None:
    configure_logging()
    configure_logging(verbose=True)
    assert len(logging.getLogger("tensorflow").filters) == 1


class Executor:
    """Stands in for tensorflow.python.eager.executor.Executor: its __del__ raises the
    remote call's error."""

    def __init__(self, err: BaseException) -> None:
        self.err = err

    def __del__(self) -> None:
        raise self.err


Executor.__del__.__module__ = "tensorflow.python.eager.executor"


class Other:
    def __init__(self, err: BaseException) -> None:
        self.err = err

    def __del__(self) -> None:
        raise self.err


def test_executor_del_with_a_tensorflow_error_goes_to_debug(restore_logging, capsys) -> None:
    configure_logging(verbose=False)
    Executor(FakeOpError(UNAVAILABLE, "Socket closed\nmore"))  # collected at once: __del__ raises
    assert capsys.readouterr().err == ""
    configure_logging(verbose=True)
    Executor(FakeOpError(UNAVAILABLE, "Socket closed\nmore"))
    err = capsys.readouterr().err
    assert "DEBUG tensorflow: ignored in Executor.__del__: FakeOpError: Socket closed" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("cls", "err"),
    [
        (Executor, ValueError("not a TensorFlow error")),
        (Other, FakeOpError(UNAVAILABLE, "elsewhere")),
    ],
    ids=["other error", "other object"],
)
def test_other_unraisable_exceptions_are_printed_as_python_does(
    restore_logging, capsys, cls: type, err: BaseException
) -> None:
    configure_logging(verbose=False)
    cls(err)
    printed = capsys.readouterr().err
    assert "Exception ignored in" in printed and "Traceback" in printed


IMPORT_OUTPUT = r"""
import os
from psctl.cluster.processes.logs import tensorflow_import_quietly
with tensorflow_import_quietly():
    os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called are written"
                b" to STDERR\n")
    os.write(2, b"I0000 00:00:1796098195.242420    2792 port.cc:153] oneDNN custom ops on.\n")
    os.write(2, b"W0000 00:00:1796098195.242420    2792 x.cc:1] a warning\n")
    os.write(2, b"E0000 00:00:1796098195.242420    2792 x.cc:1] an error\n")
    os.write(2, b"a line of its own\n")
os.write(2, b"I0000 00:00:1796098195.242420    2792 y.cc:2] after the import\n")
"""


@pytest.mark.parametrize(
    ("level", "kept"),
    [
        ("2", ["E0000", "a line of its own", "after the import"]),
        ("1", ["W0000", "E0000", "a line of its own", "after the import"]),
        ("0", ["WARNING: All", "I0000", "W0000", "E0000", "a line of its own", "after"]),
    ],
)
def test_tensorflow_import_keeps_what_tf_cpp_min_log_level_asks_for(
    level: str, kept: list[str]
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_OUTPUT],
        capture_output=True,
        text=True,
        timeout=8,
        env=child_env(TF_CPP_MIN_LOG_LEVEL=level),
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == len(kept), proc.stderr
    assert all(line.startswith(k) or k in line for line, k in zip(lines, kept, strict=True))


CHILD_STDERR = (
    "04:30:19 psctl INFO psctl.coordinator.training.controller: steps per call: 9\n"
    "E0000 00:00:1796099420.805358   25609 context.cc:873] Failed to register function "
    "remotely due to failed to connect to all addresses; last error: UNKNOWN: "
    "ipv4:10.77.0.4:2222: Failed to connect to remote host: Connection refused\n"
    "Additional GRPC error information from remote target /job:worker/replica:0/task:1 while "
    "calling /tensorflow.eager.EagerService/Enqueue:\n"
    ':UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"failed to connect"}\n'
    "This could happen if the remote target has been disconnected from the client.\n"
    "E0000 00:00:1796099515.989084   30924 context.cc:911] Failed to remove function remotely "
    "due to failed to connect to all addresses\n"
    "Additional GRPC error information from remote target /job:worker/replica:0/task:1 while "
    "calling /tensorflow.eager.EagerService/Enqueue:\n"
    "E0000 00:00:1796099420.805358   25609 other.cc:1] an error psctl does not know\n"
    "Additional GRPC error information from remote target /job:ps/replica:0/task:0 while\n"
    "04:30:20 psctl INFO psctl.coordinator.training.saving.checkpoints: checkpoint ckpt-514\n"
)
KEPT = [
    "04:30:19 psctl INFO psctl.coordinator.training.controller: steps per call: 9",
    "E0000 00:00:1796099420.805358   25609 other.cc:1] an error psctl does not know",
    "Additional GRPC error information from remote target /job:ps/replica:0/task:0 while",
    "04:30:20 psctl INFO psctl.coordinator.training.saving.checkpoints: checkpoint ckpt-514",
]


@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
def test_training_process_stderr_less_tensorflows_reports_of_a_lost_task(
    capfd: pytest.CaptureFixture[str], verbose: bool
) -> None:
    from psctl.cluster.processes.procs import TrainingProcess

    code = f"import sys; sys.stderr.write({CHILD_STDERR!r}); sys.exit(3)"
    child = TrainingProcess([sys.executable, "-c", code], verbose=verbose)
    assert child.wait(timeout=8) == 3  # returns once every line is out
    err = capfd.readouterr().err
    assert err.splitlines() == (CHILD_STDERR.splitlines() if verbose else KEPT)
