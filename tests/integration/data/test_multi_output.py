"""A model of two outputs, a dict of them (tests/jobs/multi_output.py), on a real local
cluster: trained, its final evaluation, `psctl evaluate` and
`psctl export` report each output's metrics under the output's name, and the exported
serving_default signature returns one output per model output, as the model predicts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, local_argv, psctl_argv, read_json, run_python

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

JOB = "tests/jobs/multi_output.py"
NAMES = ["c_accuracy", "c_auc", "loss", "r_mean_absolute_error"]
COMPARE = """
import sys
import numpy as np
import tensorflow as tf
from psctl.coordinator.job import load_job
from psctl.coordinator.data.context import DataContext
from psctl.coordinator.training.job_model.model import JobModel

serve = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
job = load_job(sys.argv[3])
dataset = job.eval_dataset_fn(DataContext(worker_index=0, num_workers=1, batch_size=64, seed=0))
features, _ = next(iter(dataset))
got = serve(features=features)
built = JobModel(job, *dataset.element_spec)
built.checkpoint(tf.Variable(0, dtype=tf.int64)).restore(sys.argv[2]).expect_partial()
want = built.model(features, training=False)
print(",".join(sorted(got)))
print(max(float(np.abs(got[k].numpy() - want[k].numpy()).max()) for k in want))
"""


def test_two_outputs_train_evaluate_and_export(run_cli, workdir: Path):
    ckpt, summary = workdir / "checkpoints", workdir / "summary.json"
    proc = run_cli(
        local_argv(
            workdir / "a",
            *("--job", JOB, "--steps", "60"),
            *("--checkpoint-dir", str(ckpt), "--summary-json", str(summary)),
        ),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = read_json(summary)
    assert sorted(done["metrics"]) == NAMES and sorted(done["eval_metrics"]) == NAMES
    assert done["eval_metrics"]["c_accuracy"] > 0.9  # measured 0.99

    out = workdir / "eval.json"
    proc = run_cli(
        psctl_argv(
            "evaluate",
            *("--job", JOB, "--checkpoint-dir", str(ckpt), "--max-evaluations", "1"),
            *("--summary-json", str(out)),
        ),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    evaluated = read_json(out)
    assert evaluated["global_step"] == 60
    assert evaluated["eval_metrics"]["c_accuracy"] == pytest.approx(
        done["eval_metrics"]["c_accuracy"]
    )

    exported = workdir / "export"
    proc = run_cli(
        psctl_argv("export", "--job", JOB, "--checkpoint-dir", str(ckpt), "--out", str(exported)),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "serving_default takes features and returns c, r" in proc.stderr
    names, diff = run_python(
        COMPARE, str(exported / "60"), str(ckpt / "ckpt-60"), str(REPO / JOB), timeout=120
    ).split()[-2:]
    assert names == "c,r"
    assert float(diff) < 1e-5
