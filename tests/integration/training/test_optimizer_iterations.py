"""The optimizer's `iterations` (what learning-rate schedules and Adam's bias correction
follow) counts every step once, whatever the workers do at the same time."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import psctl_argv, read_json, run_python

pytestmark = pytest.mark.integration

# The mlp job with Adam over a CosineDecay schedule.
SCHEDULE_JOB = """
import keras
from psctl.jobs.mlp import create_model, dataset_fn, loss_fn

def create_optimizer():
    schedule = keras.optimizers.schedules.CosineDecay(1e-3, decay_steps=1000)
    return keras.optimizers.Adam(schedule)
"""


def counters(ckpt: Path) -> tuple[int, int]:
    """(global step, optimizer iterations) in the latest checkpoint in ``ckpt``."""
    code = (
        "import sys, tensorflow as tf\n"
        "r = tf.train.load_checkpoint(tf.train.latest_checkpoint(sys.argv[1]))\n"
        "print(r.get_tensor('global_step/.ATTRIBUTES/VARIABLE_VALUE'),\n"
        "      r.get_tensor('optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE'))\n"
    )
    step, iterations = run_python(code, str(ckpt)).split()[-2:]
    return int(step), int(iterations)


@pytest.mark.timeout(240)
def test_iterations_equal_the_global_step_in_both_update_modes(run_cli, local_cluster, workdir):
    cluster = local_cluster
    # Before the fix, Keras's read-then-assign increment lost the steps of workers that
    # overlapped: 410-462 of 600 in the default mode, 410-550 in local mode.
    job = workdir / "schedule_job.py"
    job.write_text(SCHEDULE_JOB)
    modes = {"default": [], "local": ["--update-mode", "local", "--local-steps", "5"]}
    for mode, extra in modes.items():
        ckpt, out = workdir / f"ckpt-{mode}", workdir / f"{mode}.json"
        argv = psctl_argv(
            "train",
            "--cluster", str(cluster.cluster_file),
            "--job", str(job),
            "--once",
            "--metrics-port", "0",
            "--control-address", "127.0.0.1:0",
            "--checkpoint-dir", str(ckpt),
            "--summary-json", str(out),
            "--steps", "400",
            *extra,
        )  # fmt: skip
        proc = run_cli(argv, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert read_json(out)["global_step"] == 400
        assert counters(ckpt) == (400, 400), mode
