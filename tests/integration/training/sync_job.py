"""A ``psctl local --strategy sync`` job as a child process, for the sync tests (integration
and chaos): start it, wait for what it reports, wait for its processes to be gone."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tests.conftest import child_env, processes_mentioning, psctl_argv, status_or_none


def start_sync_job(
    workdir: Path, address: str, *options: str, summary: Path | None = None
) -> tuple[subprocess.Popen[bytes], Path]:
    """``psctl local --strategy sync`` on 2 workers in ``workdir`` (created here) with
    ``options``, its control service at ``address``; returns the process and its log."""
    workdir.mkdir(parents=True)
    argv = psctl_argv(
        "local",
        "--strategy",
        "sync",
        "--workers",
        "2",
        *options,
        "--log-every",
        "1",
        "--workdir",
        str(workdir),
        "--control-address",
        address,
        *(["--summary-json", str(summary)] if summary is not None else []),
    )
    log = workdir / "local.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=child_env())
    return proc, log


def wait_for(
    predicate: Callable[[], object],
    timeout: float,
    what: str,
    proc: subprocess.Popen[bytes],
    log: Path,
) -> object:
    """The first true value of ``predicate``; fails if the job ends or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        assert proc.poll() is None, f"psctl local ended before {what}:\n{log.read_text()[-4000:]}"
        time.sleep(0.3)
    raise AssertionError(f"no {what} after {timeout:.0f}s:\n{log.read_text()[-4000:]}")


def wait_for_state(
    address: str, state: str, timeout: float, proc: subprocess.Popen[bytes], log: Path
) -> object:
    """The job's ``psctl status --json`` once it reports ``state`` (``JOB_STATE_...``)."""
    return wait_for(
        lambda: (s := status_or_none(address)) and s.get("state") == state and s,
        timeout,
        f"{state.removeprefix('JOB_STATE_')} status",
        proc,
        log,
    )


def wait_until_gone(workdir: Path, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for every process mentioning ``workdir`` to exit."""
    deadline = time.monotonic() + timeout
    while processes_mentioning(str(workdir)) and time.monotonic() < deadline:
        time.sleep(0.2)
