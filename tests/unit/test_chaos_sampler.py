"""The chaos tests' status sampler (tests/chaos/conftest.py): a server restarted between two
of the coordinator's health checks is SERVING in every status it gives, and still counts as
back (a new run of SERVING) from the status that shows its new failure count or pid."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from tests.chaos.conftest import Sampler

pytestmark = pytest.mark.timeout(30)


def _status(failures: int, pid: int) -> dict:
    task = {"type": "worker", "index": 1, "health": "TASK_HEALTH_SERVING"}
    return {"state": "JOB_STATE_RUNNING", "global_step": 1, "tasks": [
        {**task, "failures": failures, "pid": pid}]}  # fmt: skip


def _feed(statuses: list[dict], go: threading.Event) -> Iterator[dict | None]:
    yield statuses[0]
    go.wait(10)
    yield from statuses[1:]
    while True:
        time.sleep(0.05)
        yield statuses[-1]


@pytest.mark.parametrize("after", [_status(1, 10), _status(0, 11)], ids=["failures", "pid"])
def test_a_restart_seen_only_in_the_status_counts_as_serving_again(after: dict):
    go = threading.Event()
    sampler = Sampler(_feed([_status(0, 10), after], go))
    try:
        time.sleep(0.2)
        fault_at = time.monotonic()
        go.set()
        assert sampler.wait_serving("worker:1", after=fault_at, timeout=5) > fault_at
    finally:
        sampler.stop()


def test_the_same_process_serving_on_is_not_back_again():
    go = threading.Event()
    sampler = Sampler(_feed([_status(0, 10), _status(0, 10)], go))
    try:
        time.sleep(0.2)
        fault_at = time.monotonic()
        go.set()
        with pytest.raises(AssertionError, match="not SERVING again"):
            sampler.wait_serving("worker:1", after=fault_at, timeout=1)
    finally:
        sampler.stop()
