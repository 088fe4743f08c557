"""Errors a user can cause, and the exit statuses psctl uses for them.

The training process's other statuses (EXIT_RESTART, EXIT_INTERRUPTED), and which status
each failure decision ends with, are in psctl.coordinator.failures.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import Any, NoReturn

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
    ``PROGRAM: error: WHAT; see 'PROG --help'``. Subcommands' parsers inherit it.

    Flags are taken as written, never by a prefix (argparse's ``allow_abbrev``): a prefix
    that is the start of one flag is a mistake as often as a shorthand (``--checkpoint`` was
    read as ``--checkpoint-dir``, and the run waited for a checkpoint that could not
    appear). A flag the command does not have is named with the closest one it has, and the
    hint names the subcommand's help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            chosen = self._chosen(parsed)
            chosen.error(chosen.unrecognized(extras))
        return parsed

    def _chosen(self, parsed: argparse.Namespace) -> OneLineParser:
        """The (sub)command the command line chose: where its flags are."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                name = getattr(parsed, action.dest, None)
                sub = action.choices.get(name) if name else None
                if isinstance(sub, OneLineParser):
                    return sub._chosen(parsed)
        return self

    def unrecognized(self, extras: Sequence[str]) -> str:
        """``unrecognized arguments: --checkpoint-evry (did you mean --checkpoint-every?)``."""
        flags = [f for a in self._actions for f in a.option_strings if f.startswith("--")]
        hints = []
        for extra in extras:
            flag = extra.split("=", 1)[0]
            close = difflib.get_close_matches(flag, flags, n=1, cutoff=0.6)
            if flag.startswith("-") and not close:
                close = [f for f in flags if f.startswith(flag)][:1]
            if flag.startswith("-") and close:
                hints.append(f"{flag} (did you mean {close[0]}?)")
            else:
                hints.append(extra)
        return f"unrecognized arguments: {' '.join(hints)}"

    def error(self, message: str) -> NoReturn:
        text = " ".join(message.split())
        if len(text) > 200:  # argparse repeats the bad value whole
            text = f"{text[:197]}... ({len(text)} characters)"
        program = self.prog.split()[0]  # "psctl train" -> "psctl"
        self.exit(EXIT_USAGE, f"{program}: error: {text}; see '{self.prog} --help'\n")
