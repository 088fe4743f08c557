"""A coordinator's status as a feed: one JSON object per poll (null while it does not answer).

In-process for a coordinator this process can reach; `python -m bench.harness.status_feed
ADDRESS` prints the feed for one it can't (another network namespace), one line per poll.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator

from psctl.control.v1 import control_pb2
from psctl.coordinator.operations.client import ControlError, call, status_dict


def status(address: str) -> dict | None:
    """`psctl status --json` as a dict; None while the coordinator does not answer."""
    try:
        return status_dict(call(address, "GetStatus", control_pb2.GetStatusRequest(), timeout=5))
    except ControlError:
        return None


def poll(address: str, every: float = 0.3) -> Iterator[dict | None]:
    while True:
        yield status(address)
        time.sleep(every)


def main() -> None:
    for status in poll(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 0.3):
        print(json.dumps(status), flush=True)


if __name__ == "__main__":
    main()
