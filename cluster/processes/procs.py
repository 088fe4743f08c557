"""Child processes of a launcher (psctl local, the benchmarks, tests): each gets a
parent-death signal, so none outlives its launcher, even one killed by SIGKILL."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from psctl.cluster import netns

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STOP_TIMEOUT = 5.0


def command_lines(text: str) -> dict[int, str]:
    """pid -> command line of every process (but this one) whose command line contains
    ``text`` (e.g. a job's work dir)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found[int(entry.name)] = cmdline
    return found


def die_with_parent(sig: int = signal.SIGTERM, *, nice: int = 0) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets ``sig`` when its parent dies, even by SIGKILL; in
    a job with a private network namespace, it joins the job's user namespace
    (``netns.join_user``), so that it may enter the network namespace later.

    The kernel sends it when the *thread* that started the child ends: start children from
    a thread that lives as long as they should. ``nice`` lowers the child's priority: its
    own, and its autogroup's (``spawn`` starts a new session, so with autogroup scheduling,
    the default on desktop and many server kernels, the child is a group of its own, and
    the scheduler shares CPU between groups by the group's nice, not the process's).
    """
    parent = os.getpid()

    def arm() -> None:  # runs in the child between fork and exec
        if nice:
            os.nice(nice)
            try:  # Linux with CONFIG_SCHED_AUTOGROUP; raising it needs no privilege
                with open("/proc/self/autogroup", "w") as f:
                    f.write(str(nice))
            except OSError:
                pass  # no autogroups here: the process's nice is what counts
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)
        netns.join_user()  # single-threaded here, as joining a user namespace must be

    return arm


class TrainingProcess(subprocess.Popen[bytes]):
    """A training process, its stderr passed on by ``forward_stderr`` (TensorFlow's C++
    reports of a lost task left out unless ``verbose``); ``wait`` returns once all of it
    is out, so the supervisor's next line comes after the child's last. ``popen``: more of
    Popen's arguments (``spawn``'s session and parent-death signal)."""

    def __init__(self, argv: Sequence[str], *, verbose: bool, **popen: Any) -> None:
        from psctl.cluster.processes.logs import forward_stderr

        super().__init__(argv, stderr=subprocess.PIPE, **popen)
        assert self.stderr is not None
        self._forwarder = forward_stderr(self.stderr, verbose=verbose)

    def wait(self, timeout: float | None = None) -> int:
        code = super().wait(timeout)
        self._forwarder.join(timeout=5.0)
        return code


def child_session(death_signal: int, *, nice: int = 0) -> dict[str, Any]:
    """Popen arguments for a child of psctl's: no stdin, its own session (the terminal's
    Ctrl-C goes to the launcher only), ``death_signal`` when the launcher dies."""
    return {
        "stdin": subprocess.DEVNULL,
        "start_new_session": True,
        "preexec_fn": die_with_parent(death_signal, nice=nice),
    }


def spawn_training(
    argv: Sequence[str], *, verbose: bool, death_signal: int = signal.SIGKILL
) -> TrainingProcess:
    """``spawn`` for a training process: its own session, ``death_signal`` when the
    launcher dies, and its stderr filtered as ``TrainingProcess`` does."""
    return TrainingProcess(argv, verbose=verbose, **child_session(death_signal))


def spawn(
    argv: Sequence[str],
    *,
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
    death_signal: int = signal.SIGTERM,
    nice: int = 0,
) -> subprocess.Popen[bytes]:
    """Start a child (``child_session``); its output appended to ``log_path``."""
    out: Any = None
    if log_path is not None:
        out = log_path.open("ab")
    try:
        return subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            env=env,
            **child_session(death_signal, nice=nice),
        )
    finally:
        if out is not None:
            out.close()


def stop_processes(
    procs: Sequence[subprocess.Popen[bytes]],
    *,
    timeout: float = STOP_TIMEOUT,
    signum: int = signal.SIGTERM,
) -> None:
    """``signum`` (SIGTERM), wait, then SIGKILL whatever is left. Never leaves a child
    behind."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
