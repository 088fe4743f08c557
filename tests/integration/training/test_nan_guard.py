"""The NaN guard: a model that goes non-finite is never checkpointed, and a fresh training
process restores the last finite checkpoint and finishes the job."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import REPO, child_env, psctl_argv, read_json, run_python

pytestmark = pytest.mark.integration


def nonfinite_checkpoints(directory: Path) -> list[str]:
    """Checkpoints in ``directory`` holding a NaN or infinite float (TensorFlow runs in a
    separate process)."""
    code = (
        "import sys, glob, numpy as np, tensorflow as tf\n"
        "for index in sorted(glob.glob(sys.argv[1] + '/ckpt-*.index')):\n"
        "    reader = tf.train.load_checkpoint(index[: -len('.index')])\n"
        "    for name in reader.get_variable_to_shape_map():\n"
        "        value = np.asarray(reader.get_tensor(name))\n"
        "        if value.dtype.kind == 'f' and not np.isfinite(value).all():\n"
        "            print(index, name)\n"
    )
    stdout = run_python(code, str(directory))
    return stdout.splitlines()


@pytest.mark.timeout(300)
def test_nan_model_restarts_from_the_last_finite_checkpoint(workdir, run_cli, tmp_path):
    out = tmp_path / "out.json"
    argv = psctl_argv(
        "local",
        "--workdir",
        str(workdir),
        "--job",
        str(REPO / "tests" / "jobs" / "poisoned.py"),
        "--steps",
        "2000",
        "--checkpoint-every",
        "300",
        "--log-every",
        "2",
        "--summary-json",
        str(out),
    )
    proc = run_cli(
        argv, timeout=280, env=child_env(PSCTL_TEST_POISON_MARKER=str(tmp_path / "poisoned"))
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "poisoned").is_file()  # the first process did read the NaN batch
    assert "restarting the training process from the latest checkpoint" in proc.stderr
    assert "training loss is nan" in proc.stderr or "is not finite" in proc.stderr
    summary = read_json(out)
    assert summary["restarts"] == 1
    assert summary["global_step"] >= 2000
    assert summary["eval_accuracy"] >= 0.90, summary
    assert nonfinite_checkpoints(workdir / "checkpoints") == []


@pytest.mark.timeout(90)
def test_sync_job_that_diverges_at_the_last_step_fails_with_exit_70(workdir, run_cli):
    """Sync mode, a loss that is NaN from the first step: the run reaches its last step
    before any status (so before the guard) looks. Every worker must agree that the model
    is not finite and restart together, until the budget is used up (exit 70). Seen before:
    worker 1 ended done, the chief restarted alone and waited for it for good."""
    argv = psctl_argv(
        "local",
        "--strategy",
        "sync",
        "--workers",
        "2",
        "--workdir",
        str(workdir),
        "--control-address",
        "127.0.0.1:0",
        "--job",
        str(REPO / "tests" / "jobs" / "diverging.py"),
        "--steps",
        "100",
        "--max-restarts",
        "1",
        "--connect-timeout",
        "30",
    )
    started = time.monotonic()
    proc = run_cli(argv, timeout=80)
    assert proc.returncode == 70, proc.stderr[-4000:]
    assert "the model is not finite at global step 100" in proc.stderr, proc.stderr[-4000:]
    assert "giving up (job FAILED, exit 70)" in proc.stderr, proc.stderr[-4000:]
    worker_log = (workdir / "logs" / "worker-1.log").read_text()
    assert "done at global step" not in worker_log, worker_log[-4000:]
    assert time.monotonic() - started < 80
