"""Errors a user can cause, and the exit statuses psctl uses for them.

The training process's other statuses (EXIT_RESTART, EXIT_INTERRUPTED), and which status
each failure decision ends with, are in psctl.coordinator.failures.
"""

from __future__ import annotations

EXIT_CONFIG = 78  # EX_CONFIG: systemd units set RestartPreventExitStatus=78.
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE: a server or coordinator could not be reached.
EXIT_FAILURE = 1


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
