"""cluster.procs: children that die with their launcher, and stopping them (real processes)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from psctl.cluster.processes.procs import spawn, stop_processes
from tests.conftest import REPO, child_env

pytestmark = pytest.mark.timeout(30)

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def alive(pid: int) -> bool:
    """Running, and not a zombie nobody has reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_child_dies_with_its_launcher_even_by_sigkill() -> None:
    launcher_code = (
        "import sys, time\n"
        "from psctl.cluster.processes.procs import spawn\n"
        f"child = spawn({SLEEP!r})\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", launcher_code],
        stdout=subprocess.PIPE,
        cwd=REPO,
        env=child_env(),
    )
    child = 0
    try:
        assert launcher.stdout is not None
        child = int(launcher.stdout.readline())
        assert alive(child)
        launcher.kill()
        launcher.wait()
        assert wait_gone(child), "the child outlived its SIGKILLed launcher"
    finally:
        launcher.kill()
        launcher.wait()
        if child and alive(child):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def test_spawn_appends_output_to_the_log_and_applies_nice(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    log.write_text("earlier\n")
    proc = spawn([sys.executable, "-c", "import os; print(os.nice(0))"], log_path=log, nice=3)
    assert proc.wait(timeout=20) == 0
    assert log.read_text() == f"earlier\n{min(19, os.nice(0) + 3)}\n"


def _autogroup() -> str:
    """This process's autogroup line; empty where autogroups do not schedule it (a kernel
    without them, or a task in a cpu cgroup of its own, as in most containers)."""
    try:
        return Path("/proc/self/autogroup").read_text().strip()
    except OSError:
        return ""


@pytest.mark.skipif(not _autogroup(), reason="autogroup scheduling does not apply here")
def test_spawn_applies_nice_to_the_childs_own_autogroup(tmp_path: Path) -> None:
    """A child in a session of its own is an autogroup of its own: its nice only counts
    against other groups (an operator's shell) when the group's nice is set too."""
    log = tmp_path / "child.log"
    code = "print(open('/proc/self/autogroup').read().strip())"
    proc = spawn([sys.executable, "-c", code], log_path=log, nice=7)
    assert proc.wait(timeout=20) == 0
    group, _, nice = log.read_text().strip().partition(" nice ")
    mine = _autogroup().split()[0]
    assert group != mine and int(nice) == 7, log.read_text()


def test_stop_processes_terminates_then_kills() -> None:
    stubborn = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    polite = subprocess.Popen(SLEEP)
    assert stubborn.stdout is not None
    assert stubborn.stdout.readline() == b"ready\n"
    stop_processes([stubborn, polite], timeout=0.5)
    assert polite.returncode == -signal.SIGTERM
    assert stubborn.returncode == -signal.SIGKILL
    stubborn.stdout.close()
