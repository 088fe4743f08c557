"""Embedding tables sharded over the ps tasks: a plain Keras job (tests/jobs/embedding.py)
trained with --max-shards on real local clusters, its checkpoint restored into another
number of ps tasks, and read by the sidecar evaluator as a plain model's; a job with
psctl's FeatureEmbedding (tests/jobs/features.py) sharded, trained and exported."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, local_argv, psctl_argv, read_json, run_python

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

JOB = "tests/jobs/embedding.py"
COMPARE = """
import sys
import numpy as np
import tensorflow as tf
from psctl.coordinator.job import load_job
from psctl.coordinator.training.job_model.model import JobModel

serve = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
width, high = int(sys.argv[4]), int(sys.argv[5])
ids = np.random.default_rng(0).integers(0, high, size=(64, width))
got = serve(features=tf.constant(ids, tf.int64))["outputs"].numpy()
job = load_job(sys.argv[3])
spec = tf.TensorSpec([None, width], tf.int64)
built = JobModel(job, spec, tf.TensorSpec([None, 1], tf.float32))
built.checkpoint(tf.Variable(0, dtype=tf.int64)).restore(sys.argv[2]).expect_partial()
print(float(np.abs(got - built.model(ids, training=False).numpy()).max()))
"""


def test_sharded_table_trains_checkpoints_and_restores_into_more_ps(run_cli, workdir: Path):
    ckpt = workdir / "checkpoints"
    first = workdir / "first.json"
    common = ["--job", JOB, "--checkpoint-dir", str(ckpt), "--steps-per-execution", "20"]
    proc = run_cli(
        local_argv(
            workdir / "a",
            "--ps",
            "2",
            "--max-shards",
            "2",
            "--steps",
            "300",
            "--summary-json",
            str(first),
            *common,
        ),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "table embedding: 200000 x 8 in 2 shard(s)" in proc.stderr
    summary = read_json(first)
    assert summary["global_step"] == 300 and summary["eval_accuracy"] is not None
    # The checkpoint holds the table whole (and Adam's two slots): 200k x 8 float32, x3.
    data = sum(p.stat().st_size for p in ckpt.glob("ckpt-300.data-*"))
    assert data >= 3 * 200_000 * 8 * 4

    second = workdir / "second.json"
    proc = run_cli(
        local_argv(
            workdir / "b",
            "--ps",
            "3",
            "--max-shards",
            "3",
            "--steps",
            "600",
            "--summary-json",
            str(second),
            *common,
        ),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "in 3 shard(s)" in proc.stderr
    summary = read_json(second)
    assert summary["start_step"] == 300 and summary["global_step"] == 600
    assert summary["loss"] < 0.69  # it goes on learning from the restored table

    out = workdir / "eval.json"
    proc = run_cli(
        psctl_argv(
            "evaluate",
            "--job",
            JOB,
            "--checkpoint-dir",
            str(ckpt),
            "--max-evaluations",
            "1",
            "--summary-json",
            str(out),
        ),
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_json(out)["global_step"] == 600

    # The SavedModel for serving: OUT/<step>/, tables merged; a fresh process loads it and
    # predicts what the checkpoint's model predicts.
    exported = workdir / "export"
    proc = run_cli(
        psctl_argv("export", "--job", JOB, "--checkpoint-dir", str(ckpt), "--out", str(exported)),
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (exported / "600" / "saved_model.pb").is_file()
    diff = run_python(
        COMPARE,
        *(str(exported / "600"), str(ckpt / "ckpt-600"), str(REPO / JOB), "4", "200000"),
        timeout=120,
    )
    assert float(diff.strip().splitlines()[-1]) < 1e-5


def test_feature_embedding_tables_shard_train_and_export(run_cli, workdir: Path):
    """psctl.job.FeatureEmbedding: hashed raw ids, a "mean" combiner over padded
    multi-valued features, one table shared by two features; both tables sharded."""
    job = "tests/jobs/features.py"
    ckpt, out = workdir / "checkpoints", workdir / "summary.json"
    proc = run_cli(
        local_argv(
            workdir / "a",
            *("--job", job, "--ps", "2", "--max-shards", "2", "--steps", "500"),
            *("--checkpoint-dir", str(ckpt), "--summary-json", str(out)),
        ),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "table users_table: 50000 x 8 in 2 shard(s)" in proc.stderr
    assert "table items_table: 50000 x 8 in 2 shard(s)" in proc.stderr  # one, shared
    assert read_json(out)["eval_accuracy"] > 0.7  # measured 0.84-0.86 (3 runs)
    exported = workdir / "export"
    proc = run_cli(
        psctl_argv("export", "--job", job, "--checkpoint-dir", str(ckpt), "--out", str(exported)),
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Hashing and pooling are in the SavedModel: raw ids in, the checkpoint's predictions out.
    diff = run_python(
        COMPARE,
        *(str(exported / "500"), str(ckpt / "ckpt-500"), str(REPO / job), "7", str(10**12)),
        timeout=120,
    )
    assert float(diff.strip().splitlines()[-1]) < 1e-5
