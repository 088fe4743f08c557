"""`--train-data` / `--eval-data` on a real local cluster: the mlp job trains on files, and a
bad file stops the run before training with one line naming the file and the line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from psctl.coordinator.data import readers as data
from psctl.jobs import mlp
from tests import conftest
from tests.conftest import processes_mentioning, read_json

pytestmark = pytest.mark.integration


def local_argv(workdir: Path, *args: str) -> list[str]:
    return conftest.local_argv(workdir, "--log-every", "2", *args)


@pytest.mark.timeout(300)
def test_mlp_trains_on_csv_files(workdir, run_cli, tmp_path):
    # What a user does: one CSV of 32 float columns plus `label` to train, one to evaluate.
    x, y, ex, ey = mlp.make_data()
    train, evaluation = tmp_path / "train.csv", tmp_path / "eval.csv"
    data.write_csv(train, x, y)
    data.write_csv(evaluation, ex, ey)
    out = workdir / "out.json"
    proc = run_cli(
        local_argv(
            workdir,
            "--job", "mlp",
            "--train-data", str(train),
            "--eval-data", str(evaluation),
            "--steps", "1500",
            "--summary-json", str(out),
        ),
        timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_json(out)
    assert summary["global_step"] == 1500
    assert summary["eval_accuracy"] >= 0.90, summary
    # The whole eval file, once.
    assert f"{len(ey)} examples in" in proc.stderr
    assert processes_mentioning(str(workdir)) == []


@pytest.mark.timeout(300)
def test_tfrecord_shards_across_workers(workdir, run_cli, tmp_path):
    # More files than workers: each worker reads its own files.
    x, y, ex, ey = mlp.make_data()
    for i, part in enumerate(np.array_split(np.arange(len(y)), 3)):
        data.write_tfrecord(tmp_path / f"train-{i}.tfrecord", x[part], y[part])
    data.write_tfrecord(tmp_path / "eval.tfrecord", ex[:3000], ey[:3000])
    out = workdir / "out.json"
    proc = run_cli(
        local_argv(
            workdir,
            "--train-data", str(tmp_path / "train-*.tfrecord"),
            "--eval-data", str(tmp_path / "eval.tfrecord"),
            "--steps", "800",
            "--summary-json", str(out),
        ),
        timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_json(out)
    assert summary["global_step"] == 800
    assert summary["eval_accuracy"] >= 0.90, summary
    assert "3000 examples in" in proc.stderr


@pytest.mark.timeout(200)
def test_bad_eval_file_fails_before_training(workdir, run_cli, tmp_path):
    x, y, ex, ey = mlp.make_data()
    train, evaluation = tmp_path / "train.csv", tmp_path / "eval.csv"
    data.write_csv(train, x[:2000], y[:2000])
    data.write_csv(evaluation, ex[:50], ey[:50])
    lines = evaluation.read_text().splitlines()
    cells = lines[7].split(",")
    cells[3] = "n/a"
    lines[7] = ",".join(cells)
    evaluation.write_text("\n".join(lines) + "\n")
    proc = run_cli(
        local_argv(
            workdir, "--train-data", str(train), "--eval-data", str(evaluation), "--steps", "300"
        ),
        timeout=180,
    )
    assert proc.returncode == 78, proc.stderr[-3000:]
    expected = (
        f"psctl: error: --eval-data: {evaluation} line 8, column 'f03': 'n/a' is not a number"
    )
    assert expected in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("psctl: error")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "train | step:" not in proc.stderr
    assert processes_mentioning(str(workdir)) == []


@pytest.mark.timeout(200)
def test_an_eval_file_too_small_for_eval_every_keeps_the_steps_trained(workdir, run_cli, tmp_path):
    """One eval example for 2 workers, found when ``--eval-every``'s evaluation is first
    traced: one line and exit 78, with the steps trained in a checkpoint. It was exit 1, a
    TensorFlow StagingError with its frames, and every step since the last checkpoint lost."""
    x, y, ex, ey = mlp.make_data()
    train, evaluation = tmp_path / "train.csv", tmp_path / "eval.csv"
    data.write_csv(train, x[:2000], y[:2000])
    data.write_csv(evaluation, ex[:1], ey[:1])
    checkpoints = workdir / "ckpt"
    proc = run_cli(
        local_argv(
            workdir, "--train-data", str(train), "--eval-data", str(evaluation),
            "--steps", "5000", "--eval-every", "200", "--checkpoint-dir", str(checkpoints),
            "--checkpoint-every", "100000",
        ),
        timeout=180,
    )  # fmt: skip
    assert proc.returncode == 78, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("psctl: error")]
    assert errors == [
        f"psctl: error: --eval-data: 1 examples in {evaluation} for 2 workers; give at least "
        "one example per worker"
    ], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "StagingError" not in proc.stderr
    steps = [int(p.name[len("ckpt-") : -len(".index")]) for p in checkpoints.glob("ckpt-*.index")]
    assert steps and max(steps) >= 200, (steps, proc.stderr[-2000:])
