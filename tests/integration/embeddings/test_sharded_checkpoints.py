"""Checkpoints saved and restored by shard on real clusters
(training/saving/sharded_save.py): a fixed and a dynamic table with Adam saved from 2 ps and
restored into 3 and then 1, value for value; a checkpoint written while a worker is frozen;
the coordinator's memory the same with a small and a large table."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from psctl.coordinator.launch.local import LocalCluster
from tests.conftest import REPO, child_env, local_argv, psctl_argv, read_json, run_python

pytestmark = pytest.mark.integration

JOB = str(REPO / "tests/jobs/both_tables.py")

# Builds the training state of tests/jobs/both_tables.py on a cluster, then either fills its
# tables with known values and saves, or restores and checks every value.
SCRIPT = """
import sys
import numpy as np, tensorflow as tf
from psctl.cluster.spec import load_cluster_file
from psctl.coordinator.embeddings.dynamic import shard_of
from psctl.coordinator.job import load_job
from psctl.coordinator.data.context import DataContext
from psctl.coordinator.settings import TrainSettings
from psctl.coordinator.training.saving.checkpoints import sharded_checkpoint
from psctl.coordinator.training.job_model.model import TrainState
from psctl.coordinator.training.strategy import connect

mode, cluster_file, prefix, job_file = sys.argv[1:5]
cluster = load_cluster_file(cluster_file)
settings = TrainSettings.of(job=job_file, max_shards=4, min_shard_bytes=1024)
strategy, coordinator = connect(cluster, settings)
job = load_job(job_file)
ctx = DataContext.from_settings(settings, worker_index=0, num_workers=1, batch_size=8)
x_spec, y_spec = job.dataset_fn(ctx).element_spec[:2]
with strategy.scope():
    state = TrainState(job, x_spec, y_spec, settings=settings, strategy=strategy,
                       num_ps=cluster.num_ps)
step = tf.Variable(0, dtype=tf.int64)
checkpoint = sharded_checkpoint(state, job, settings, x_spec, y_spec, step)
(table,) = state.tables
(layer,) = state.dynamic_layers
rows = table.rows
fixed = {"": np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)}
for n, kind in enumerate(sorted(table.slots)):
    fixed[kind] = fixed[""] * (n + 2) + 0.5
keys = np.arange(1, 3001, dtype=np.int64) * 2_305_843_009_213 + 7
vectors = (keys % 1000)[:, None].astype(np.float32) + np.arange(4, dtype=np.float32)
slots = np.concatenate([vectors * 3, vectors * 5], axis=1)

def shards_of(kind):
    return table.slots[kind] if kind else table.shards

devices = sorted({str(s.device) for kind in fixed for s in shards_of(kind)})
print("fixed table shards on", len(devices), "ps")
if mode == "save":
    for kind, value in fixed.items():
        start = 0
        for shard in shards_of(kind):
            shard.assign(value[start:start + shard.shape[0]])
            start += shard.shape[0]
    part = shard_of(tf.constant(keys), len(layer.packed)).numpy()
    for i, shard in enumerate(layer.packed):
        mine = part == i
        shard.write(tf.constant(keys[mine]), tf.constant(vectors[mine]),
                    tf.constant(slots[mine]), tf.constant(keys[mine] % 97),
                    tf.constant(keys[mine] % 89))
    step.assign(123)
    checkpoint._write(prefix)
    print("saved")
else:
    checkpoint.load(prefix)
    assert int(step.numpy()) == 123
    for kind, value in fixed.items():
        got = np.concatenate([s.numpy() for s in shards_of(kind)])
        np.testing.assert_array_equal(got, value)
    found = {"embeddings": [], "meta": [], "slots": []}
    held = []
    for i, shard in enumerate(layer.packed):
        k, v = shard.table.export()
        assert np.all(shard_of(k, len(layer.packed)).numpy() == i)
        held.append(k.numpy())
        for what, value in zip(found, shard.unpack(v), strict=True):
            found[what].append(value.numpy())
    want = np.argsort(keys)
    meta = np.stack([keys % 97, keys % 89, np.ones_like(keys)], axis=1)
    k = np.concatenate(held)
    order = np.argsort(k)
    np.testing.assert_array_equal(k[order], keys[want])
    for what, expected in (("embeddings", vectors), ("meta", meta), ("slots", slots)):
        v = np.concatenate(found[what])
        np.testing.assert_array_equal(v[order], expected[want])
    print("restored", len(layer.packed), "shards, every value")
"""


def on_cluster(workdir: Path, num_ps: int, *args: str) -> str:
    cluster = LocalCluster(num_ps=num_ps, num_workers=1, workdir=workdir)
    try:
        cluster.start()
        cluster.wait_serving(timeout=120)
        return run_python(SCRIPT, args[0], str(cluster.cluster_file), *args[1:], timeout=180)
    finally:
        cluster.stop()


@pytest.mark.timeout(600)
def test_fixed_and_dynamic_tables_saved_on_2_ps_restore_into_3_then_1_value_for_value(
    workdir: Path,
):
    first = str(workdir / "ckpt" / "ckpt-123")
    out = on_cluster(workdir / "two", 2, "save", first, JOB)
    assert "fixed table shards on 2 ps" in out and "saved" in out, out
    data = list((workdir / "ckpt").glob("ckpt-123.data-*"))
    assert len(data) >= 3, data  # one bundle (at least) from each ps and the coordinator
    out = on_cluster(workdir / "three", 3, "load", first, JOB)
    assert "fixed table shards on 3 ps" in out and "restored 3 shards" in out, out
    out = on_cluster(workdir / "one", 1, "load", first, JOB)
    assert "fixed table shards on 1 ps" in out and "restored 1 shards" in out, out


@pytest.mark.timeout(300)
def test_a_checkpoint_is_written_while_a_worker_is_frozen(workdir: Path, run_cli):
    from tests.integration.operations.test_control import (
        load_step,
        start_local_job,
        status_or_none,
        wait_until,
    )

    job, address, summary = start_local_job(
        workdir,
        "--job",
        JOB,
        "--max-shards",
        "2",
        "--min-shard-bytes",
        "1024",
        "--ps",
        "2",
        "--checkpoint-every",
        "200",
        "--keep-checkpoints",
        "100",
    )  # fmt: skip  (kept: the one checked is read seconds later, while training goes on)
    frozen = None
    try:
        # Past the first checkpoints: a worker frozen while TensorFlow still registers its
        # first functions holds up every eager op of the coordinator (TensorFlow's, seen
        # with the old mirror too), until psctl local's watchdog restarts the worker.
        wait_until(
            lambda: int((status_or_none(address) or {"global_step": 0})["global_step"]) > 600,
            150,
            "600 steps",
        )
        (frozen,) = pids_of(workdir, b"worker_server", b"--index\x001")
        os.kill(frozen, signal.SIGSTOP)
        time.sleep(2)
        started = time.monotonic()
        proc = run_cli(psctl_argv("checkpoint", "--address", address), timeout=90)
        took = time.monotonic() - started
        assert proc.returncode == 0, proc.stderr[-2000:]
        words = proc.stdout.split()
        assert re.search(r"ckpt-\d+$", words[1]), proc.stdout
        assert load_step(words[1]) == int(words[-1])
        if took >= 20:
            # Seen in about one fresh-clone run in three, never in ten runs of the same
            # scenario alone: the coordinator stops getting calls back until psctl local's
            # watchdog restarts the frozen worker (30 s). A gdb backtrace of one such stall:
            # a ClusterCoordinator worker thread waits in TensorFlow's Executor.__del__
            # (executor_scope's exit) on an eager node of the frozen worker (docs/operations.md).
            log = (workdir.parent / "job.log").read_text()
            assert "has not answered a health check" in log, log[-3000:]
            pytest.xfail(f"TensorFlow held the coordinator until the watchdog ({took:.0f} s)")
        # Well before the watchdog (30 s) could restart the frozen worker.
        assert pids_of(workdir, b"worker_server", b"--index\x001") == [frozen]
    finally:
        if frozen is not None:
            with contextlib.suppress(ProcessLookupError):  # the watchdog may have ended it
                os.kill(frozen, signal.SIGCONT)
        job.send_signal(signal.SIGTERM)
        try:
            job.wait(timeout=90)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()
    assert read_json(summary)["stopped_early"] is True


def pids_of(workdir: Path, *parts: bytes) -> list[int]:
    """The processes whose command line names ``workdir`` and holds every one of ``parts``
    (arguments joined by NUL, as /proc shows them)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(workdir).encode() in cmd and all(part in cmd for part in parts):
            found.append(int(pid))
    return found


def peak_rss_of_training(workdir: Path, rows: str) -> int:
    """psctl local with the ctr job at ``rows``: the training process's peak RSS (VmHWM),
    read from /proc just before it ends."""
    env = {**child_env(), "CTR_ROWS": rows}
    ckpt = workdir / f"ckpt-{rows}"
    argv = local_argv(
        workdir / rows, "--job", "ctr", "--ps", "2", "--max-shards", "2", "--steps", "60",
        "--checkpoint-dir", str(ckpt), "--checkpoint-every", "20", "--log-every", "1",
    )  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    peak = 0
    deadline = time.monotonic() + 240
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            for pid in pids_of(workdir / rows, b"psctl\x00train\x00"):
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                match = re.search(r"VmHWM:\s+(\d+) kB", status)
                if match:
                    peak = max(peak, int(match.group(1)) * 1024)
            time.sleep(0.2)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    assert "checkpoint" in out and peak > 0, out[-3000:]
    return peak


@pytest.mark.timeout(600)
def test_the_coordinators_memory_does_not_grow_with_the_table(workdir: Path):
    small = peak_rss_of_training(workdir, "10k")
    # 3M x 16 float32 with Adam's two slots: 576 MB on the ps, which a coordinator that
    # held the model would hold once more (and more while writing it).
    large = peak_rss_of_training(workdir, "3M")
    assert large / small < 1.15, (small, large)


@pytest.mark.timeout(300)
def test_a_checkpoint_dir_the_ps_cannot_see_is_one_line_and_exit_78(workdir: Path, run_cli):
    """ram:// is a file system of each process's own: what a directory that is not shared
    between the hosts looks like to psctl."""
    fix = "give a directory every ps host and the coordinator share at the same path"
    proc = run_cli(
        local_argv(workdir / "run", "--steps", "50", "--checkpoint-dir", "ram://ckpt"),
        timeout=240,
    )
    assert proc.returncode == 78, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("psctl: error:")]
    assert line.startswith("psctl: error: --checkpoint-dir: ps:0 does not see ram://ckpt"), line
    assert fix in line and "Traceback" not in proc.stderr

    cluster = LocalCluster(num_ps=2, num_workers=1, workdir=workdir / "cluster")
    try:
        cluster.start()
        cluster.wait_serving(timeout=120)
        shared = str(workdir / "shared")
        outs = {}
        for directory, status in ((shared, 0), ("ram://not-shared", 78)):
            argv = psctl_argv("deploy", "check", "--cluster", str(cluster.cluster_file),
                              "--checkpoint-dir", directory)  # fmt: skip
            proc = run_cli(argv, timeout=120)
            assert proc.returncode == status, proc.stdout + proc.stderr[-2000:]
            outs[directory] = proc
        assert f"checkpoint dir: every ps reads {shared}" in outs[shared].stdout
        line = outs["ram://not-shared"].stderr
        assert fix in line and "ps:0 does not see ram://not-shared" in line, line
    finally:
        cluster.stop()
