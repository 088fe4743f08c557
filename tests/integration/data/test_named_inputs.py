"""A model over named inputs (a dict of string, int64 and float features; tests/jobs/named.py)
on real local clusters: trained with sharded tables and inline evaluation, continued in sync
mode from the same checkpoints, read by the sidecar evaluator, exported with one signature
input per keras.Input and served raw strings by a fresh process; a dataset key the model
has no input for is one line and exit 78."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, local_argv, psctl_argv, read_json, run_python

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

JOB = "tests/jobs/named.py"
COMPARE = """
import sys
import numpy as np
import tensorflow as tf
from psctl.coordinator.job import load_job
from psctl.coordinator.data.context import DataContext
from psctl.coordinator.training.job_model.model import JobModel

serve = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
print(",".join(sorted(serve.structured_input_signature[1])))
job = load_job(sys.argv[3])
dataset = job.eval_dataset_fn(DataContext(worker_index=0, num_workers=1, batch_size=64, seed=0))
features, _ = next(iter(dataset))
got = serve(**features)["outputs"].numpy()  # raw strings and ids, as a client sends them
built = JobModel(job, *dataset.element_spec)
built.checkpoint(tf.Variable(0, dtype=tf.int64)).restore(sys.argv[2]).expect_partial()
print(float(np.abs(got - built.model(features, training=False).numpy()).max()))
"""


def test_named_inputs_train_both_ways_evaluate_and_export(run_cli, workdir: Path):
    ckpt = workdir / "checkpoints"
    first, second = workdir / "async.json", workdir / "sync.json"
    proc = run_cli(
        local_argv(
            workdir / "a",
            *("--job", JOB, "--ps", "2", "--max-shards", "2", "--steps", "400"),
            *("--eval-every", "100", "--checkpoint-dir", str(ckpt), "--summary-json", str(first)),
        ),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "table countries_table: 20000 x 8 in 2 shard(s)" in proc.stderr
    assert "table tag_table_table: 50000 x 8 in 2 shard(s)" in proc.stderr
    # --eval-every on the workers (the named features through the distributed evaluation).
    inline = [line for line in proc.stderr.splitlines() if "shards on the workers" in line]
    assert inline and all("4000 examples" in line for line in inline), proc.stderr[-3000:]
    summary = read_json(first)
    assert summary["global_step"] == 400
    assert summary["eval_accuracy"] > 0.78  # measured 0.86-0.88
    assert summary["eval_metrics"]["auc"] > 0.8  # AUC: label and prediction shapes fit

    # Sync mode reads the async run's checkpoint (tables whole in it) and goes on.
    proc = run_cli(
        local_argv(
            workdir / "b",
            *("--job", JOB, "--strategy", "sync", "--workers", "2", "--steps", "600"),
            *("--checkpoint-dir", str(ckpt), "--summary-json", str(second)),
        ),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_json(second)
    assert summary["start_step"] == 400 and summary["global_step"] == 600
    assert summary["eval_accuracy"] > 0.8  # measured 0.87-0.89

    out = workdir / "eval.json"
    proc = run_cli(
        psctl_argv(
            "evaluate",
            *("--job", JOB, "--checkpoint-dir", str(ckpt), "--max-evaluations", "1"),
            *("--summary-json", str(out)),
        ),
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    evaluated = read_json(out)
    assert evaluated["global_step"] == 600 and evaluated["eval_metrics"]["accuracy"] > 0.8

    exported = workdir / "export"
    proc = run_cli(
        psctl_argv("export", "--job", JOB, "--checkpoint-dir", str(ckpt), "--out", str(exported)),
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "serving_default takes country, item, nums, tags" in proc.stderr
    names, diff = run_python(
        COMPARE, str(exported / "600"), str(ckpt / "ckpt-600"), str(REPO / JOB), timeout=120
    ).split()[-2:]
    assert names == "country,item,nums,tags"
    assert float(diff) < 1e-5


RENAMED = """
from tests.jobs.named import *  # noqa: F403
from tests.jobs import named


def dataset_fn(ctx):
    rename = lambda x, y: ({("countri" if k == "country" else k): v for k, v in x.items()}, y)
    return named.dataset_fn(ctx).map(rename)
"""


def test_a_renamed_dataset_key_is_one_line_and_exit_78(run_cli, workdir: Path, tmp_path: Path):
    job = tmp_path / "renamed_job.py"
    job.write_text(RENAMED)
    proc = run_cli(
        local_argv(workdir, "--job", str(job), "--ps", "2", "--max-shards", "2", "--steps", "50"),
        timeout=200,
    )
    assert proc.returncode == 78, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("psctl: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "'countri', which the model has no input for" in errors[0]
    assert "lack 'country' (string of shape (None, 1))" in errors[0]
    assert "Traceback" not in proc.stderr
    assert not list((workdir / "checkpoints").glob("ckpt-*.index"))  # before any step
    # Found by the first training process as it builds the model: never restarted.
    assert "restart" not in proc.stderr.lower(), proc.stderr[-3000:]
