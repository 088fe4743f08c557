"""Local-step mode and automatic packing on one real cluster, driven by `psctl train` runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from psctl.coordinator.launch.local import LocalCluster
from tests.conftest import psctl_argv, read_json

pytestmark = pytest.mark.integration


def train(run_cli, cluster: LocalCluster, ckpt: Path, out: Path, *args: str) -> dict:
    argv = psctl_argv(
        "train",
        "--cluster", str(cluster.cluster_file),
        "--once",
        "--metrics-port", "0",
        "--control-address", "127.0.0.1:0",
        "--checkpoint-dir", str(ckpt),
        "--checkpoint-every", "300",
        "--summary-json", str(out),
        *args,
    )  # fmt: skip
    proc = run_cli(argv, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_json(out)


@pytest.mark.timeout(300)
def test_local_steps_train_and_checkpoints_cross_modes(run_cli, local_cluster, workdir):
    cluster = local_cluster
    ckpt = workdir / "ckpt"
    local = ["--update-mode", "local", "--local-steps", "50"]
    first = train(run_cli, cluster, ckpt, workdir / "1.json", "--steps", "1200", *local)
    assert first["start_step"] == 0 and first["global_step"] == 1200
    assert first["eval_accuracy"] >= 0.90, first
    assert first["steps_per_execution"] == 50
    # Local mode's checkpoint restores in the default mode (auto packing), and back.
    second = train(run_cli, cluster, ckpt, workdir / "2.json", "--steps", "1500")
    assert second["start_step"] == 1200 and second["global_step"] == 1500
    assert second["eval_accuracy"] >= 0.90, second
    # auto: K stays within its bounds (<= steps between checkpoints here).
    assert 1 <= second["steps_per_execution"] <= 300
    third = train(run_cli, cluster, ckpt, workdir / "3.json", "--steps", "1700", *local)
    assert third["start_step"] == 1500 and third["global_step"] == 1700
    assert third["eval_accuracy"] >= 0.90, third
