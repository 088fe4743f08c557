"""Logging set-up for psctl entry points (library modules only call getLogger)."""

from __future__ import annotations

import logging
import os
import sys


def configure_logging(*, verbose: bool = False, name: str = "psctl") -> None:
    """Log to stderr; under systemd's journal drop timestamps (journald adds its own)."""
    level = logging.DEBUG if verbose else logging.INFO
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
    for noisy in ("tensorflow", "absl", "h5py"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if verbose else logging.WARNING)


def quiet_tensorflow(*, verbose: bool = False) -> None:
    """Keep TensorFlow's C++ start-up chatter out of operators' logs unless asked for.

    Must run before TensorFlow is imported. An explicit setting in the environment wins.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0" if verbose else "2")
    # Every task of a PS cluster must report errors to the caller instead of retrying forever.
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
