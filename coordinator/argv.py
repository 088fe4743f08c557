"""One builder for every command line psctl starts itself with (re-exec of `psctl`, and
the ps/worker servers of a local cluster), so that they run this interpreter and this
install whatever the PATH says."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from psctl.coordinator.settings import settings_argv


def psctl_argv(*args: str) -> list[str]:
    """``psctl ARGS...`` as this interpreter runs it (``python -m psctl``)."""
    return [sys.executable, "-m", "psctl", *args]


def server_argv(task_type: str, args: Sequence[str] = ()) -> list[str]:
    """``ps-server ARGS...`` or ``worker-server ARGS...`` as this interpreter runs them."""
    if task_type not in ("ps", "worker"):
        raise ValueError(f"task_type must be 'ps' or 'worker', got {task_type!r}")
    return [sys.executable, "-m", f"psctl.{task_type}_server.main", *args]


def run_settings_argv(args: argparse.Namespace, flags: Mapping[str, Any]) -> list[str]:
    """What a launcher hands on to the training processes it starts: its --config file, the
    run settings given as flags, and --verbose."""
    argv = ["--config", args.config] if args.config else []
    argv += settings_argv(flags)
    if args.verbose:
        argv.append("--verbose")
    return argv
