"""`psctl evaluate`: the sidecar evaluator follows a real training run's checkpoints."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import child_env, kill_if_running, local_argv, psctl_argv, read_json
from tests.integration.training.test_local import tensorboard_tags

pytestmark = pytest.mark.integration


@pytest.mark.timeout(360)
def test_sidecar_evaluates_checkpoints_as_they_appear(workdir, run_cli, tmp_path):
    ckpt = workdir / "ckpt"
    summary_path = tmp_path / "evaluate.json"
    logdir = tmp_path / "tb"
    # Started first: it waits for the checkpoint directory to appear.
    sidecar = subprocess.Popen(
        psctl_argv(
            "evaluate",
            "--checkpoint-dir", str(ckpt),
            "--steps", "1500",
            "--poll-interval", "0.25",
            "--timeout", "240",
            "--summary-json", str(summary_path),
            "--logdir", str(logdir),
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )  # fmt: skip
    try:
        train = run_cli(
            local_argv(
                workdir / "run",
                "--steps", "1500",
                "--checkpoint-every", "300",
                "--checkpoint-dir", str(ckpt),
            ),
            timeout=280,
        )  # fmt: skip
        assert train.returncode == 0, train.stderr[-3000:]
        out, err = sidecar.communicate(timeout=60)
    finally:
        kill_if_running(sidecar)
    assert sidecar.returncode == 0, err[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("eval | step:")]
    steps = [int(line.split("|")[1].split(":")[1]) for line in lines]
    # Each checkpoint once, in order, and the final one last; it exited on its own.
    assert steps == sorted(set(steps)), out
    assert len(steps) >= 3 and steps[-1] == 1500, out
    assert all("accuracy:" in line and "10000 examples" in line for line in lines)
    summary = read_json(summary_path)
    assert summary["done"] and summary["reason"] == "final-step"
    assert [e["step"] for e in summary["evaluations"]] == steps
    assert summary["global_step"] == 1500 and summary["eval_accuracy"] >= 0.90
    assert {"eval/loss", "eval/accuracy"} <= tensorboard_tags(logdir)

    # Later: the newest checkpoint once (--max-evaluations), then exit.
    again = run_cli(
        psctl_argv("evaluate", "--checkpoint-dir", str(ckpt), "--max-evaluations", "1"),
        timeout=120,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("eval | step:   1500 |") == 1, again.stdout

    # One chosen checkpoint (not the newest), then every one of the directory, each once.
    kept = sorted(int(p.name[5:-6]) for p in ckpt.glob("ckpt-*.index"))
    chosen = run_cli(
        psctl_argv("evaluate", "--checkpoint", str(ckpt / f"ckpt-{kept[0]}"),
                   "--summary-json", str(tmp_path / "one.json")),
        timeout=120,
    )  # fmt: skip
    assert chosen.returncode == 0, chosen.stderr[-3000:]
    (one,) = [ln for ln in chosen.stdout.splitlines() if ln.startswith("eval |")]
    assert one.startswith(f"eval | step: {kept[0]:6d} |"), chosen.stdout
    assert read_json(tmp_path / "one.json")["evaluations"][0]["step"] == kept[0]
    every = run_cli(psctl_argv("evaluate", "--checkpoint-dir", str(ckpt), "--all"), timeout=180)
    assert every.returncode == 0, every.stderr[-3000:]
    evaluated = [ln for ln in every.stdout.splitlines() if ln.startswith("eval |")]
    assert [int(ln.split("|")[1].split(":")[1]) for ln in evaluated] == kept, every.stdout
    missing = run_cli(psctl_argv("evaluate", "--checkpoint", str(ckpt / "ckpt-7")), timeout=120)
    assert missing.returncode == 78, missing.stderr[-3000:]
    # The one line alone: TensorFlow's start-up notices (oneDNN, absl) came before it.
    (line,) = missing.stderr.splitlines()
    assert line.startswith(f"psctl: error: --checkpoint: {ckpt / 'ckpt-7'} is not a checkpoint")

    # A job whose model does not match the checkpoints: one line, exit 78.
    job = tmp_path / "other_job.py"
    job.write_text(OTHER_JOB)
    wrong = run_cli(
        psctl_argv("evaluate", "--checkpoint-dir", str(ckpt), "--job", str(job), "--timeout", "5"),
        timeout=120,
    )
    assert wrong.returncode == 78, wrong.stderr[-3000:]
    assert "does not match checkpoint" in wrong.stderr and "Traceback" not in wrong.stderr
    # Exporting it: the error line is the last (TensorFlow's ~40 warnings about the failed
    # restore's values came after it, at exit).
    export = run_cli(
        psctl_argv(
            "export", "--checkpoint-dir", str(ckpt), "--job", str(job), "--out",
            str(tmp_path / "export"),
        ),
        timeout=120,
    )  # fmt: skip
    assert export.returncode == 78, export.stderr[-3000:]
    last = export.stderr.strip().splitlines()[-1]
    assert last.startswith("psctl: error: --job: the job's model does not match"), last


OTHER_JOB = """
import keras
import tensorflow as tf


def create_model():
    return keras.Sequential([keras.Input((32,)), keras.layers.Dense(3)])


def create_optimizer():
    return keras.optimizers.SGD(0.1)


def loss_fn(labels, predictions):
    return keras.losses.sparse_categorical_crossentropy(labels, predictions, from_logits=True)


def dataset_fn(ctx):
    return eval_dataset_fn(ctx).repeat()


def eval_dataset_fn(ctx):
    x = tf.zeros([8, 32])
    return tf.data.Dataset.from_tensor_slices((x, tf.zeros([8], tf.int64))).batch(4)
"""


@pytest.mark.timeout(120)
def test_no_checkpoint_within_timeout_is_unavailable(run_cli, tmp_path: Path):
    proc = run_cli(
        psctl_argv(
            "evaluate", "--checkpoint-dir", str(tmp_path / "none"), "--timeout", "1",
            "--poll-interval", "0.2",
        ),
        timeout=100,
    )  # fmt: skip
    assert proc.returncode == 69, proc.stderr[-3000:]
    assert "psctl: error: no checkpoint appeared in" in proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ([], "--checkpoint-dir: is required"),
        (["--checkpoint-dir", "d", "--max-evaluations", "0"], "--max-evaluations: got 0"),
        (["--checkpoint-dir", "d", "--poll-interval", "0"], "--poll-interval: got 0"),
        (["--checkpoint-dir", "d", "--steps", "0"], "--steps: got 0"),
    ],
)
def test_evaluate_config_errors(run_cli, args: list[str], expected: str):
    proc = run_cli(psctl_argv("evaluate", *args), timeout=50)
    assert proc.returncode == 78, proc.stderr
    assert proc.stderr.startswith(f"psctl: error: {expected}"), proc.stderr
    assert proc.stderr.count("\n") == 1
