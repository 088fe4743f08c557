"""LocalCluster.drop_tasks (psctl local, workers that left): the servers named by their
indices in the cluster as it was, the others renumbered in order, the cluster file rewritten."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from psctl.coordinator.launch.local import LocalCluster, ServerProcess

pytestmark = pytest.mark.timeout(30)


class Alive:
    pid = 1

    def poll(self) -> None:
        return None


def test_two_workers_that_left_are_dropped_by_their_indices_before_any_renumbering(
    tmp_path: Path,
):
    local = LocalCluster(num_ps=1, num_workers=4, workdir=tmp_path)
    tmp_path.mkdir(exist_ok=True)
    local.servers = [
        ServerProcess(t, i, a, 9000 + n, 9100 + n, tmp_path / "log", Alive())  # type: ignore[arg-type]
        for n, (t, i, a) in enumerate(local.cluster.tasks())
        if t in ("ps", "worker")
    ]
    addresses = list(local.cluster.jobs["worker"])
    gone = local.drop_tasks([("worker", 1), ("worker", 2)])
    assert [s.address for s in gone] == addresses[1:3]
    # Their names as they were (seen: "stopping worker:1, worker:1" in psctl local's log).
    assert [s.name for s in gone] == ["worker:1", "worker:2"]
    workers = [s for s in local.servers if s.task_type == "worker"]
    assert [(s.index, s.address) for s in workers] == [(0, addresses[0]), (1, addresses[3])]
    written = json.loads(local.cluster_file.read_text())
    assert written["cluster"]["worker"] == [addresses[0], addresses[3]]
