"""The job's task health, checked in the background: every task's grpc.health.v1 service
every ``HEALTH_POLL_SECONDS``, all at once over kept channels (cluster/health.py's
HealthChecker: a round costs at most its deadline, however many tasks), reported into the
job's state (``JobControl.set_health``). Status must answer fast, so it never checks itself."""

from __future__ import annotations

import threading

from psctl.cluster.health import HealthChecker
from psctl.coordinator.operations.job_state import JobControl
from psctl.coordinator.operations.task_book import HEALTH, SERVING, UNKNOWN

HEALTH_POLL_SECONDS = 2.0


def poll_health_forever(job: JobControl, stop: threading.Event) -> None:
    """Check every task's health until ``stop``; the chief (this process) is SERVING."""
    checker = HealthChecker()
    try:
        while not stop.is_set():
            tasks = list(job.tasks)
            addresses = [t.health_address for t in tasks if t.type != "chief" and t.health_address]
            results = checker.check_all(addresses, timeout=1.0)
            for task in tasks:
                instance = ""
                if task.type == "chief":
                    result = SERVING
                elif task.health_address:
                    answer = results[task.health_address]
                    result = answer.status if answer.status in HEALTH else UNKNOWN
                    instance = answer.instance
                else:
                    continue
                job.set_health(task, result, instance)
            stop.wait(HEALTH_POLL_SECONDS)
    finally:
        checker.close()
