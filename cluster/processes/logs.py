"""Logging set-up for psctl entry points (library modules only call getLogger)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator
from typing import IO, Any

# What TensorFlow's ClusterCoordinator logs at ERROR, once per closure, when a task fails:
# pages of gRPC error text for a failure psctl handles (and reports in a few lines of its
# own). Kept at DEBUG (-v). A failure psctl does not handle is logged by psctl in full.
_TF_CLOSURE_REPORTS = (
    "Remote function on worker ",
    " /job:worker/task:%d encountered the following error when processing",
    "Worker %s failed with ",
    "Start cancelling closures due to error ",
    "Cluster update failed with error: ",
)


def configure_logging(*, verbose: bool = False, name: str = "psctl") -> None:
    """Log to stderr; under systemd's journal drop timestamps (journald adds its own)."""
    level = logging.DEBUG if verbose else logging.INFO
    if not isinstance(sys.stderr, StderrWithoutReader):
        sys.stderr = StderrWithoutReader(sys.stderr)  # type: ignore[assignment]
    if os.environ.get("JOURNAL_STREAM"):
        fmt = f"{name}: %(levelname)s %(name)s: %(message)s"
    else:
        fmt = f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # TensorFlow's Python side logs every device placement and closure at INFO.
    for noisy in ("tensorflow", "absl", "h5py", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if verbose else logging.WARNING)
    tf_logger = logging.getLogger("tensorflow")
    tf_logger.filters[:] = [f for f in tf_logger.filters if not isinstance(f, _ClosureReports)]
    tf_logger.addFilter(_ClosureReports())
    sys.unraisablehook = _unraisable_hook


class StderrWithoutReader:
    """``sys.stderr`` that drops what it cannot write once its reader is gone, instead of
    raising BrokenPipeError where a line is printed. A training process's stderr is a pipe to
    its launcher: when the launcher was killed, the next progress line ended the process
    before the final checkpoint its stop owes (measured: the steps since the last periodic
    checkpoint lost)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._gone = False

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return int(self._stream.write(text))
            except BrokenPipeError:
                self._gone = True
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._gone = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _ClosureReports(logging.Filter):
    """TensorFlow's per-closure failure reports, demoted to DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno <= logging.DEBUG or not isinstance(record.msg, str):
            return True
        if not record.msg.startswith(_TF_CLOSURE_REPORTS):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def _unraisable_hook(unraisable: Any) -> None:
    """TensorFlow's ``Executor.__del__`` re-raises a remote call's error when a failed
    cluster's executor is collected ("Exception ignored in: <function Executor.__del__
    ...>" and a traceback): a failure already handled. That one case goes to DEBUG; any
    other unraisable exception is printed as Python does."""
    obj = unraisable.object
    err = unraisable.exc_value
    if (
        getattr(obj, "__qualname__", "") == "Executor.__del__"
        and str(getattr(obj, "__module__", "")).startswith("tensorflow.")
        and isinstance(getattr(err, "error_code", None), int)
    ):
        text = str(err).strip().splitlines()
        logging.getLogger("tensorflow").debug(
            "ignored in Executor.__del__: %s: %s", type(err).__name__, text[0] if text else ""
        )
        return
    sys.__unraisablehook__(unraisable)


# absl's log lines before its logging is set up ("I0000 00:00:1796097453.164812  24590
# port.cc:153] oneDNN custom operations are on. ...") and the notice that precedes them.
_ABSL_LINE = re.compile(r"([IWEF])\d{4} \d\d:\d\d:[\d.]+ +\d+ \S+:\d+\] ")
_ABSL_NOTICE = "WARNING: All log messages before absl::InitializeLog() is called are written"
_ABSL_SEVERITY = {"I": 0, "W": 1, "E": 2, "F": 3}


# The import's redirection of stderr while one is in progress: (the real stderr, the thread
# forwarding the pipe to it). Process-wide, as fd 2 is.
_redirect: list[tuple[int, threading.Thread]] = []
_redirect_lock = threading.Lock()


@contextlib.contextmanager
def tensorflow_import_quietly() -> Iterator[None]:
    """Around ``import tensorflow``: TensorFlow 2.21 writes C++ log lines to stderr before
    its logging reads TF_CPP_MIN_LOG_LEVEL (the oneDNN notice, twice per process, each after
    absl's notice). Drop those below the level the variable asks for, as TensorFlow does
    for later ones; everything else written meanwhile passes through."""
    try:
        level = int(os.environ.get("TF_CPP_MIN_LOG_LEVEL") or 0)
    except ValueError:
        level = 0
    if level <= 0:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def forward() -> None:
        with os.fdopen(read_end, "rb") as pipe:
            for raw in pipe:
                line = raw.decode(errors="replace")
                absl = _ABSL_LINE.match(line)
                if line.startswith(_ABSL_NOTICE) or (absl and _ABSL_SEVERITY[absl[1]] < level):
                    continue
                view = memoryview(raw)
                while view:
                    view = view[os.write(saved, view) :]

    thread = threading.Thread(target=forward, name="tf-import-stderr", daemon=True)
    thread.start()
    with _redirect_lock:
        _redirect.append((saved, thread))
    try:
        yield
    finally:
        end_quiet_import()


def end_quiet_import() -> None:
    """Put the real stderr back and let out what the import's pipe holds, at once (the
    import's end does it too). Before ``os._exit``: a training process that ends while
    its job loads on another thread (--connect-timeout shorter than the import) wrote its
    one error line into the pipe, and it was lost with the process."""
    with _redirect_lock:
        if not _redirect:
            return
        saved, thread = _redirect.pop()
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last write end closes: forward() ends
    thread.join(timeout=5.0)
    os.close(saved)


def import_tensorflow_quietly() -> None:
    """``import tensorflow`` (seconds), its start-up lines filtered as
    ``tensorflow_import_quietly`` does: a command's one error line comes alone."""
    with tensorflow_import_quietly():
        import tensorflow  # noqa: F401


# TensorFlow's C++ reports (absl ERROR lines, then gRPC details) of a task that went away, a
# failure psctl handles and reports itself: a few per scheduled function while it is down.
_TF_CPP_REPORT = re.compile(r"\] Failed to (register|remove) function remotely due to ")
_TF_CPP_DETAILS = re.compile(
    r"Additional GRPC error information from remote target |:UNKNOWN:Error received from "
    r"peer |This could happen if the remote target has been disconnected from the client"
)


def forward_stderr(source: IO[bytes], *, verbose: bool = False) -> threading.Thread:
    """Copy a child's stderr to ours, line by line, from a thread of its own (it ends at the
    child's end of output): all of it with ``verbose``, else less TensorFlow's C++ reports of
    a lost task and their detail lines. Nothing else is held back, so a crashing child's
    last words still get out."""

    def forward() -> None:
        dropping = False
        with source:
            for raw in source:
                line = raw.decode(errors="replace")
                if not verbose:
                    if _ABSL_LINE.match(line) and _TF_CPP_REPORT.search(line):
                        dropping = True
                        continue
                    if dropping and _TF_CPP_DETAILS.match(line):
                        continue
                dropping = False
                view = memoryview(raw)
                while view:
                    view = view[os.write(2, view) :]

    thread = threading.Thread(target=forward, name="child-stderr", daemon=True)
    thread.start()
    return thread


def quiet_tensorflow(*, verbose: bool = False) -> None:
    """Keep TensorFlow's C++ start-up chatter out of operators' logs unless asked for.

    Must run before TensorFlow is imported. An explicit setting in the environment wins.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0" if verbose else "2")
    # Every task of a PS cluster must report errors to the caller instead of retrying forever.
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
