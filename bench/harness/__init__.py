"""What every bench shares: where results go, and how a bench starts the processes it
measures (psctl itself, a cluster's servers, a child run): killed with the bench, in a
session of their own (Ctrl-C reaches the bench, which stops them), from the repository
root."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from psctl.cluster.processes.procs import die_with_parent

REPO = Path(__file__).resolve().parents[2]


def results_dir(given: str | None, name: str) -> Path:
    """``given``, or ``bench/results/NAME-<time>/``; made."""
    out = Path(given or REPO / "bench" / "results" / time.strftime(f"{name}-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def spawn(
    argv: Sequence[str],
    *,
    stdout: IO[Any] | int,
    stderr: IO[Any] | int = subprocess.STDOUT,
    env: Mapping[str, str] | None = None,
    text: bool = False,
) -> subprocess.Popen[Any]:
    """``argv`` started as a bench's child: SIGKILLed if the bench dies, in its own session,
    in the repository root, reading nothing."""
    return subprocess.Popen(
        list(argv),
        stdout=stdout,
        stderr=stderr,
        stdin=subprocess.DEVNULL,
        cwd=REPO,
        env=None if env is None else dict(env),
        text=text,
        start_new_session=True,
        preexec_fn=die_with_parent(signal.SIGKILL),
    )
