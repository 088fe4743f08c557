"""`psctl local` end to end: real ps/worker server processes and a real coordinator."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import (
    child_env,
    describe_process,
    kill_if_running,
    processes_mentioning,
    psctl_argv,
    read_json,
    run_python,
)

pytestmark = pytest.mark.integration


def local_argv(workdir: Path, *args: str) -> list[str]:
    return psctl_argv("local", "--workdir", str(workdir), "--log-every", "2", *args)


@pytest.mark.timeout(240)
def test_local_trains_mlp_to_accuracy_and_leaves_nothing(workdir, run_cli, tmp_path):
    out = workdir / "out.json"
    scratch = tmp_path / "tmp"  # TMPDIR: autograph's files of the training process went here
    scratch.mkdir()
    argv = local_argv(workdir, "--steps", "1500", "--summary-json", str(out))
    proc = run_cli(argv, timeout=220, env=child_env(TMPDIR=str(scratch)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_json(out)
    assert summary["global_step"] == 1500
    assert summary["eval_accuracy"] >= 0.90, summary
    for key in ("loss", "accuracy", "examples_per_sec", "wall_seconds", "startup_seconds"):
        assert summary[key] is not None and summary[key] > 0, key
    # Start-up: servers, imports and the job's check, before the first loop (not in wall).
    assert 1.0 < summary["startup_seconds"] < 220, summary
    assert f"start-up {summary['startup_seconds']:.1f}s" in proc.stdout
    assert "train | step:" in proc.stderr
    assert (workdir / "checkpoints" / "checkpoint").is_file()
    assert processes_mentioning(str(workdir)) == []
    assert list(scratch.iterdir()) == []
    tags = tensorboard_tags(workdir / "tensorboard")
    assert {"train/loss", "train/accuracy", "train/steps_per_sec", "eval/accuracy"} <= tags


def tensorboard_tags(logdir: Path) -> set[str]:
    """Scalar tags in the event files, read by TensorFlow in a separate process."""
    code = (
        "import sys, glob, tensorflow as tf\n"
        "for f in glob.glob(sys.argv[1] + '/events.out.tfevents.*'):\n"
        "    for e in tf.compat.v1.train.summary_iterator(f):\n"
        "        for v in e.summary.value: print(v.tag)\n"
    )
    stdout = run_python(code, str(logdir))
    return set(stdout.split())


@pytest.mark.timeout(300)
def test_second_run_continues_from_checkpoint(workdir, run_cli):
    ckpt = workdir / "ckpt"

    def run(name: str, steps: int) -> subprocess.CompletedProcess[str]:
        """A run in its own work dir that trains to ``steps`` with checkpoints in ``ckpt``."""
        proc = run_cli(
            local_argv(
                workdir / name,
                "--steps", str(steps),
                "--checkpoint-dir", str(ckpt),
                "--summary-json", str(workdir / f"{name}.json"),
            ),
            timeout=140,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    run("a", 200)
    assert read_json(workdir / "a.json")["global_step"] == 200
    second = run("b", 400)
    summary = read_json(workdir / "b.json")
    assert summary["start_step"] == 200
    assert summary["global_step"] == 400
    assert "restored" in second.stderr


@pytest.mark.timeout(180)
def test_failed_coordinator_still_stops_every_server(workdir, run_cli):
    # The job is missing: the coordinator fails with a configuration error after the
    # servers are up, and the launcher must stop them all.
    proc = run_cli(local_argv(workdir, "--job", "no_such_job_xyz", "--steps", "10"), timeout=150)
    assert proc.returncode == 78, proc.stderr[-3000:]
    assert "--job: no job named 'no_such_job_xyz'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert processes_mentioning(str(workdir)) == []


def _wait_for_line(proc: subprocess.Popen[str], needle: str, timeout: float) -> list[str]:
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return seen
    raise AssertionError(f"{needle!r} not seen in {timeout}s; got:\n{''.join(seen[-30:])}")


def start_long_run(workdir: Path, *args: str) -> subprocess.Popen[str]:
    """`psctl local` for far more steps than a test waits, its stderr piped; returned once it
    reports its first step (killed if it does not)."""
    proc = subprocess.Popen(
        local_argv(workdir, "--steps", "100000", "--log-every", "1", *args),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=child_env(),
    )
    try:
        _wait_for_line(proc, "train | step:", timeout=150)
    except BaseException:
        kill_if_running(proc)
        raise
    return proc


@pytest.mark.timeout(200)
def test_sigint_checkpoints_and_stops_every_server(workdir):
    out = workdir / "out.json"
    proc = start_long_run(workdir, "--summary-json", str(out))
    try:
        assert processes_mentioning(str(workdir))  # the servers are running now
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=60)
    finally:
        kill_if_running(proc)
    assert proc.returncode == 0, rest[-3000:]
    summary = read_json(out)
    assert summary["stopped_early"] is True
    assert 0 < summary["global_step"] < 100000
    assert Path(summary["checkpoint"] + ".index").is_file()
    assert processes_mentioning(str(workdir)) == []


@pytest.mark.timeout(200)
def test_sigkill_of_launcher_leaves_no_server(workdir):
    proc = start_long_run(workdir)
    try:
        assert len(processes_mentioning(str(workdir))) == 5  # launcher, coordinator, 3 servers
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 20
    while processes_mentioning(str(workdir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = processes_mentioning(str(workdir))
    assert left == [], "\n".join(describe_process(pid) for pid in left)


USER_JOB = '''
"""A job as a new user writes it: binary classification of points inside a circle."""
import keras
import tensorflow as tf

metrics = ["accuracy"]


def create_model():
    return keras.Sequential([keras.Input((2,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(1)])


def create_optimizer():
    return keras.optimizers.Adam(0.01)


def loss_fn(labels, predictions):
    return keras.losses.binary_crossentropy(labels, predictions, from_logits=True)


def _points(seed, n):
    x = tf.random.stateless_uniform([n, 2], seed=[seed, 7], minval=-1.0, maxval=1.0)
    y = tf.cast(tf.reduce_sum(x * x, axis=1, keepdims=True) < 0.5, tf.float32)
    return tf.data.Dataset.from_tensor_slices((x, y))


def dataset_fn(ctx):
    ds = _points(1, 8192).shard(ctx.num_workers, ctx.worker_index)
    return ds.shuffle(1024, seed=ctx.seed).repeat().batch(ctx.batch_size)


def eval_dataset_fn(ctx):
    return _points(2, 2048).batch(ctx.batch_size)
'''


@pytest.mark.timeout(200)
def test_user_job_file_trains(workdir, run_cli, tmp_path):
    job = tmp_path / "circle_job.py"
    job.write_text(USER_JOB)
    out = workdir / "out.json"
    proc = run_cli(
        local_argv(workdir, "--job", str(job), "--steps", "600", "--summary-json", str(out)),
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_json(out)
    assert summary["global_step"] == 600
    assert summary["eval_accuracy"] >= 0.85, summary
    assert "read the same first batch" not in proc.stderr  # it shards by worker


@pytest.mark.timeout(200)
def test_a_job_whose_workers_read_the_same_data_is_warned_once(workdir, run_cli, tmp_path):
    job = tmp_path / "unsharded_job.py"
    job.write_text(USER_JOB.replace(".shard(ctx.num_workers, ctx.worker_index)", ""))
    proc = run_cli(local_argv(workdir, "--job", str(job), "--steps", "50"), timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "read the same first batch" in line]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert "WARNING psctl.train: --job " in warnings[0] and "dataset.shard(" in warnings[0]


@pytest.mark.timeout(240)
def test_a_dataset_that_runs_out_keeps_the_steps_and_says_how_to_fix_it(workdir, run_cli, tmp_path):
    """dataset_fn without repeat(): one line, exit 78, and the steps trained in a checkpoint
    that a corrected job goes on from (was: exit 1, ~90 lines of TensorFlow, steps lost)."""
    job = tmp_path / "finite_job.py"
    job.write_text(USER_JOB.replace(".repeat()", ".take(1024)"))
    checkpoints = workdir / "ckpt"
    argv = ["--job", str(job), "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "100000"]
    proc = run_cli(local_argv(workdir, *argv, "--steps", "5000"), timeout=200)
    assert proc.returncode == 78, proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("psctl: error:")]
    match = re.fullmatch(
        rf"psctl: error: --job {re.escape(str(job))}: dataset_fn's dataset ran out at global "
        rf"step (\d+) of 5000 \(the \1 steps trained are in .*ckpt-\1\); repeat\(\) the "
        r"training data in dataset_fn .*",
        line,
    )
    assert match, line
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) < 40, proc.stderr
    assert (checkpoints / f"ckpt-{match[1]}.index").exists()
