"""Fixtures the integration tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from psctl.coordinator.launch.local import LocalCluster


@pytest.fixture
def local_cluster(workdir: Path) -> Iterator[LocalCluster]:
    """1 ps + 2 workers, SERVING, for `psctl train --cluster` runs; stopped at teardown."""
    local = LocalCluster(num_ps=1, num_workers=2, workdir=workdir / "cluster")
    try:
        local.start()
        local.wait_serving(timeout=120)
        yield local
    finally:
        local.stop()
