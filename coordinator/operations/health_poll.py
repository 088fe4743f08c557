"""The job's task health, checked in the background: every task's grpc.health.v1 service
(cluster/health.py's bounded check) every ``HEALTH_POLL_SECONDS``, reported into the job's
state (``JobControl.set_health``). Status must answer fast, so it never checks itself."""

from __future__ import annotations

import threading

from psctl.cluster import health as health_check
from psctl.coordinator.operations.job_state import HEALTH, SERVING, UNKNOWN, JobControl

HEALTH_POLL_SECONDS = 2.0


def poll_health_forever(job: JobControl, stop: threading.Event) -> None:
    """Check every task's health until ``stop``; the chief (this process) is SERVING."""
    while not stop.is_set():
        for task in job.tasks:
            if task.type == "chief":
                result = SERVING
            elif task.health_address:
                status = health_check.check(task.health_address, timeout=1.0).status
                result = status if status in HEALTH else UNKNOWN
            else:
                continue
            job.set_health(task, result)
        stop.wait(HEALTH_POLL_SECONDS)
