"""What a job's supervisor counts across its training processes (``Counters``): handed to
each new training process (``--supervisor-counters``), which goes on from them and leaves
its own counts in a report file for the supervisor to take in. The restarts, failures,
recoveries and resizes that /metrics, status and the summary count on come from here.
"""

from __future__ import annotations

import atexit
import json
import logging
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from psctl.cluster.processes.files import write_json_atomic

# The supervisor's lines, as before the move from launch/supervisor.py.
log = logging.getLogger("psctl.coordinator.launch.supervisor")


@dataclass
class Counters:
    """What the supervisor saw, handed to each new training process."""

    restarts: int = 0
    ps_failures: int = 0  # training restarts for a ps failure, or ps servers restarted
    coordinator_failures: int = 0
    worker_failures: int = 0  # worker servers psctl local restarted
    nonfinite_losses: int = 0  # training processes ended by a NaN/inf loss (or model)
    # Task failures ({"ps": n, "worker": n}) the health checks of the job's earlier
    # training processes saw, summed by the supervisor from their reports: on a cluster
    # psctl does not run (psctl train), the only count of them that outlives a restart.
    seen_failures: dict[str, int] = field(default_factory=dict)
    # This training process's own (reported, not handed on: the supervisor's stays empty).
    process_failures: dict[str, int] = field(default_factory=dict)
    # The same by task, keyed by address (a resize may renumber a task, never move it):
    # psctl status's FAILURES column goes on from them in the next training process.
    seen_task_failures: dict[str, int] = field(default_factory=dict)
    process_task_failures: dict[str, int] = field(default_factory=dict)
    # Tasks seen SERVING again after a failure by the earlier training processes, and by
    # this one (psctl_recoveries_total and the summary's recoveries count on from them, as
    # from the restarts: a resize is no restart).
    task_recoveries: int = 0
    process_recoveries: int = 0
    # The job as a whole, for its summary (wall_seconds, start_step), whichever training
    # process ends it: when and where the first training process's loop started (Unix
    # seconds, 0, and -1: none reported yet, as for the first process itself).
    job_started: float = 0.0
    # When the command started (Unix seconds: psctl local's own start, else its training
    # supervisor's): the summary's start-up is from here to the first loop's start.
    launched: float = field(default=0.0, compare=False)
    job_start_step: int = -1
    process_started: float = 0.0
    process_start_step: int = -1
    resizes: list[dict[str, object]] = field(default_factory=list)  # Summary.resizes
    # The job was stopped while a training process exited for a fresh start (a resize, a
    # ps recovery): the next one restores the latest checkpoint, trains no step, and ends
    # as a stop does (final evaluation, summary, exit 0).
    stop_at_start: bool = False
    # Tasks the training process saw leave ([type, index, address]: a worker stopping or
    # lost), reported at once (``leave_report``); the supervisor takes them out of the
    # launcher's cluster while training goes on.
    left: list[list[object]] = field(default_factory=list)
    # Where a training process leaves what only it sees (nonfinite_losses, the task failures
    # its health checks saw) as it sees it: it may be killed next; the supervisor reads and
    # removes it once the process exited, and hands the counts to the next one.
    report_file: str = field(default="", compare=False)

    def handed(self) -> str:
        """What a new training process is handed (``--supervisor-counters``), as JSON, with
        the report file it leaves its counts in: made here the first time, since psctl local
        starts its first training process before the supervisor exists (that process was
        handed none: its departures, failures and start never reached the supervisor)."""
        if not self.report_file:
            self.report_file = new_report_file()
        return json.dumps(asdict(self))

    def leave_report(self) -> None:
        """In the training process: leave its counts for the supervisor."""
        if self.report_file:
            report = {
                "nonfinite_losses": self.nonfinite_losses,
                "left": self.left,
                "failures": self.process_failures,
                "task_failures": self.process_task_failures,
                "recoveries": self.process_recoveries,
                "start_step": self.process_start_step,
                "started": self.process_started,
            }
            write_json_atomic(self.report_file, report)

    def failures_seen(self, this_process: Mapping[str, int]) -> dict[str, int]:
        """The job's task failures by type: the larger of what psctl local counted (the
        servers it restarted) and what every training process's health checks saw (the
        earlier ones' and ``this_process``'s): both may see one failure."""
        seen = {t: self.seen_failures.get(t, 0) + this_process.get(t, 0) for t in ("ps", "worker")}
        return {
            "ps": max(self.ps_failures, seen["ps"]),
            "worker": max(self.worker_failures, seen["worker"]),
        }

    def peek_left(self) -> list[tuple[str, int, str]]:
        """In the supervisor, while the training process runs: the tasks it saw leave so
        far, (type, index, address); the report stays for ``take_report``."""
        try:
            return [(str(t), int(i), str(a)) for t, i, a in self._peek().get("left", [])]
        except (ValueError, TypeError) as err:
            log.debug("the training process's report is not readable yet: %s", err)
            return []

    def peek_started(self) -> bool:
        """In the supervisor, while the training process runs: whether its loop started
        (it reported its first step's time)."""
        try:
            return float(self._peek().get("started", 0.0)) > 0
        except (ValueError, TypeError) as err:
            log.debug("the training process's report is not readable yet: %s", err)
            return False

    def _peek(self) -> dict[str, Any]:
        """The training process's report as it is now ({} while there is none, or it cannot
        be read); the file stays for ``take_report``."""
        if not self.report_file:
            return {}
        try:
            report = json.loads(Path(self.report_file).read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            log.debug("the training process's report is not readable yet: %s", err)
            return {}
        return report if isinstance(report, dict) else {}

    def take_report(self) -> None:
        """In the supervisor, after a training process exited: take in what it left."""
        if not self.report_file:
            return
        path = Path(self.report_file)
        try:
            report = json.loads(path.read_text())
            path.unlink()
            count = int(report["nonfinite_losses"])
            left = [[str(t), int(i), str(a)] for t, i, a in report.get("left", [])]
            failures = {str(t): int(n) for t, n in report.get("failures", {}).items()}
            by_task = {str(a): int(n) for a, n in report.get("task_failures", {}).items()}
            recoveries = int(report.get("recoveries", 0))
            start_step = int(report.get("start_step", -1))
            started = float(report.get("started", 0.0))
        except FileNotFoundError:
            return  # it left nothing
        except (OSError, ValueError, TypeError, KeyError) as err:
            log.warning("ignoring the training process's report %s: %s", path, err)
            return
        self.nonfinite_losses = max(self.nonfinite_losses, count)
        self.left = list(left)
        for task_type, n in failures.items():
            self.seen_failures[task_type] = self.seen_failures.get(task_type, 0) + n
        for address, n in by_task.items():
            self.seen_task_failures[address] = self.seen_task_failures.get(address, 0) + n
        self.task_recoveries += recoveries
        if self.job_start_step < 0 and start_step >= 0:
            self.job_start_step, self.job_started = start_step, started


def new_report_file() -> str:
    """A path in a private temporary directory, removed when this process exits."""
    directory = tempfile.mkdtemp(prefix="psctl-supervisor-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return str(Path(directory) / "report.json")
