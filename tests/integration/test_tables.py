"""Embedding tables sharded over the ps tasks: a plain Keras job (tests/jobs/embedding.py)
trained with --max-shards on real local clusters, its checkpoint restored into another
number of ps tasks, and read by the sidecar evaluator as a plain model's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import local_argv, psctl_argv, read_json

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

JOB = "tests/jobs/embedding.py"


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


def test_local_step_mode_refuses_sharded_tables_in_one_line(run_cli, workdir: Path):
    proc = run_cli(
        local_argv(
            workdir,
            "--job",
            JOB,
            "--ps",
            "2",
            "--max-shards",
            "2",
            "--update-mode",
            "local",
            "--steps",
            "100",
        ),
        timeout=200,
    )
    assert proc.returncode == 78, proc.stderr[-3000:]
    assert "--update-mode local: does not update sharded embedding tables" in proc.stderr
    assert "Traceback" not in proc.stderr
