"""Errors a user can cause, and the exit statuses psctl uses for them.

The training process's other statuses (EXIT_RESTART, EXIT_INTERRUPTED), and which status
each failure decision ends with, are in psctl.coordinator.failures.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

EXIT_USAGE = 2  # argparse's status for a bad command line
EXIT_CONFIG = 78  # EX_CONFIG: systemd units set RestartPreventExitStatus=78.
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: a server or coordinator could not be reached.
EXIT_FAILURE = 1
ECHO_LIMIT = 80  # characters of a user's value that an error line repeats


def echo(value: object, limit: int = ECHO_LIMIT) -> str:
    """A user's value as an error line repeats it: ``repr()`` (one line, quotes and escapes
    shown), cut to about ``limit`` characters with an ellipsis and the full length, so a
    20 MB bad cell or a 5,000-digit number still makes a short line."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4 * limit:
        # repr() of a huge int is slow, and refused past sys.get_int_max_str_digits().
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    size = len(value) if isinstance(value, (str, bytes)) else None
    try:
        text = repr(value[: limit + 1] if size is not None else value)  # type: ignore[index]
    except (ValueError, RecursionError):
        return f"a {type(value).__name__}"
    if len(text) <= limit:
        return text
    suffix = f" ({size} characters)" if size is not None and size > limit else ""
    return text[: limit - 3] + "..." + suffix


class ConfigError(Exception):
    """A configuration mistake: names the field, what is wrong, and how to fix it.

    ``str(err)`` is one line, fit to print as is.
    """

    exit_status = EXIT_CONFIG

    def __init__(self, field: str, problem: str, fix: str) -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}: {problem}; {fix}")


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line (not the whole usage) and exit 2:
    ``PROGRAM: error: WHAT; see 'PROG --help'``. Subcommands' parsers inherit it."""

    def error(self, message: str) -> NoReturn:
        text = " ".join(message.split())
        if len(text) > 200:  # argparse repeats the bad value whole
            text = f"{text[:197]}... ({len(text)} characters)"
        program = self.prog.split()[0]  # "psctl train" -> "psctl"
        self.exit(EXIT_USAGE, f"{program}: error: {text}; see '{self.prog} --help'\n")
