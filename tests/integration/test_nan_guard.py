"""The NaN guard: a model that goes non-finite is never checkpointed, and a fresh training
process restores the last finite checkpoint and finishes the job."""

from __future__ import annotations

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
