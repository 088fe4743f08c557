"""Numbers on psctl's command line that are not run settings (those go through
coordinator/settings.py): ASCII only, as the settings take them (``int()`` and ``float()``
also read ``1_000``, other scripts' digits and spaces), and in range (``check_ranges``: one
line naming the flag, exit 78; a timer past a week overflows, a negative one gives up at
once, nan never ends)."""

from __future__ import annotations

import argparse
import math
import re

from psctl.cluster.errors import ConfigError
from psctl.coordinator.settings import INT32_MAX, MAX_SECONDS

MAX_LOCAL_TASKS = 1000  # psctl local --ps / --workers: servers on this one machine
_WHOLE = re.compile(r"[+-]?[0-9]{1,30}")
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_NOT_FINITE = re.compile(r"[+-]?(?:inf|infinity|nan)", re.IGNORECASE)


def whole_number(text: str) -> int:
    """A whole number: ASCII digits with an optional sign."""
    if not _WHOLE.fullmatch(text.strip(" \t")):
        raise ValueError(text)
    return int(text)


whole_number.__name__ = "whole number"  # argparse names the type in its error line


def decimal(text: str) -> float:
    """A number in ASCII; inf and nan are parsed, and refused by ``check_ranges``."""
    number = text.strip(" \t")
    if not (_DECIMAL.fullmatch(number) or _NOT_FINITE.fullmatch(number)):
        raise ValueError(text)
    return float(number)


decimal.__name__ = "number"

_SECONDS = "seconds above 0"
# Flag (argparse dest) -> (lowest, highest, what is meant). A dest means the same in every
# command that has it. "seconds above 0" excludes its lowest value; the others include it.
RANGES: dict[str, tuple[float, float, str]] = {
    "ps": (1, MAX_LOCAL_TASKS, "a whole number"),
    "workers": (1, MAX_LOCAL_TASKS, "a whole number"),
    "task_index": (0, INT32_MAX, "a whole number"),
    "metrics_port": (0, 65535, "a port number (0: off)"),
    "health_port_offset": (1, 65535, "a whole number"),
    "count": (0, INT32_MAX, "a whole number (0: no limit)"),
    "max_evaluations": (1, INT32_MAX, "a whole number"),
    "start_timeout": (0, MAX_SECONDS, _SECONDS),
    "timeout": (0, MAX_SECONDS, _SECONDS),
    "poll_interval": (0, MAX_SECONDS, _SECONDS),
    "interval": (0.1, 60, "seconds"),
    "duration": (0, MAX_SECONDS, "seconds (0: no limit)"),
    "jobs": (1, 1024, "a whole number"),
}


def check_ranges(args: argparse.Namespace) -> None:
    """ConfigError (one line, exit 78) for a flag of ``RANGES`` out of its range."""
    for name, (low, high, what) in RANGES.items():
        value = getattr(args, name, None)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        above = what == _SECONDS
        in_range = low < value if above else low <= value
        if math.isfinite(value) and in_range and value <= high:
            continue
        flag = f"--{name.replace('_', '-')}"
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        bound = f"at most {high:,.12g}" if above else f"from {low:,.12g} to {high:,.12g}"
        raise ConfigError(flag, f"got {shown}", f"give {what}, {bound}")
