"""TensorFlow's multi-worker tutorial code as a psctl job (tests/jobs/tutorial.py): a
compiled model and an AutoShardPolicy.DATA dataset function, trained by ``psctl local`` in
the default parameter-server mode and in sync mode, with no other change."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, local_argv, processes_mentioning, read_json

pytestmark = pytest.mark.integration

TUTORIAL = str(REPO / "tests" / "jobs" / "tutorial.py")


def train_tutorial(run_cli, workdir: Path, *args: str) -> dict:
    out = workdir.parent / "summary.json"
    argv = local_argv(workdir, "--job", TUTORIAL, "--summary-json", str(out), *args)
    proc = run_cli(argv, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert processes_mentioning(str(workdir)) == []
    summary = read_json(out)
    # The metric is the compiled SparseCategoricalAccuracy(), under its Keras name.
    assert summary["eval_metrics"]["sparse_categorical_accuracy"] >= 0.90, summary
    assert summary["metrics"]["sparse_categorical_accuracy"] > 0.5, summary
    assert summary["eval_accuracy"] == summary["eval_metrics"]["sparse_categorical_accuracy"]
    return summary


@pytest.mark.timeout(240)
def test_tutorial_job_trains_in_ps_mode(run_cli, workdir):
    summary = train_tutorial(run_cli, workdir, "--steps", "400")
    assert summary["global_step"] == 400
    assert summary["num_ps"] == 1


@pytest.mark.timeout(240)
def test_tutorial_job_trains_in_sync_mode(run_cli, workdir):
    summary = train_tutorial(
        run_cli, workdir, "--strategy", "sync", "--workers", "2", "--steps", "400"
    )
    assert summary["global_step"] == 400


@pytest.mark.timeout(120)
def test_uncompiled_model_without_optimizer_exits_78_in_one_line(run_cli, workdir, tmp_path):
    job = tmp_path / "bare_job.py"
    job.write_text(
        "import keras\n"
        "from tests.jobs.tutorial import dataset_fn\n"
        "def create_model():\n"
        "    return keras.Sequential([keras.Input((28, 28)), keras.layers.Flatten(),"
        " keras.layers.Dense(10)])\n"
    )
    proc = run_cli(local_argv(workdir, "--job", str(job), "--steps", "20"), timeout=100)
    assert proc.returncode == 78, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("psctl: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "create_model() returns a model that is not compiled" in errors[0]
    assert "Traceback" not in proc.stderr
    assert processes_mentioning(str(workdir)) == []
