"""Follow mode on a real local cluster (the ctr job, Criteo-format partitions): files that
land while it trains are trained each once, in path order; a partition without its
_SUCCESS marker is not read until the marker comes; a SIGKILL of the training process in
the middle changes nothing of that; serving versions appear in --export-dir, whole, and
load in a fresh process; status and /metrics show the freshness; --idle-timeout ends the
job with its summary. And its settings refused in one line, exit 78."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from psctl.cluster.ports import free_ports
from psctl.control.v1 import control_pb2
from psctl.coordinator.operations.client import ControlError, call, status_dict
from tests.conftest import (
    REPO,
    child_env,
    control_cli,
    kill_if_running,
    processes_mentioning,
    psctl_argv,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

WRITE = """
import sys
from psctl.jobs import ctr
cfg = ctr.CtrConfig(rows=10_000)
for i, path in enumerate(sys.argv[1:]):
    ctr.write_tsv(path, cfg, first_block=2 * i, blocks=2)
"""
LOAD = """
import sys, tensorflow as tf
serve = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
request = {}
for name, spec in serve.structured_input_signature[1].items():  # two raw examples
    shape = [2 if d is None else d for d in spec.shape]
    request[name] = tf.fill(shape, "1" if spec.dtype == tf.string else tf.constant(1, spec.dtype))
outputs = serve(**request)["outputs"].numpy()
print("answered", outputs.shape)
"""


def write_partitions(*paths: Path) -> None:
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-c", WRITE, *map(str, paths)],
        check=True, env=child_env(), cwd=REPO, timeout=120, capture_output=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """What write_partitions writes to its first, second and third path (the same rows on
    every call), made once for the module: each test copies them into its partitions
    (``place``) instead of importing TensorFlow in a fresh process each time."""
    made = tmp_path_factory.mktemp("rows")
    paths = [made / f"rows-{i}" for i in range(3)]
    write_partitions(*paths)
    return paths


def place(rows: Path, path: Path) -> None:
    """A partition's file: ``rows`` (one of the fixture's) copied to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(rows, path)


def freshness(address: str) -> dict | None:
    try:
        status = status_dict(call(address, "GetStatus", control_pb2.GetStatusRequest(), timeout=2))
    except ControlError:
        return None
    return status.get("freshness")


def wait_until(address: str, proc: subprocess.Popen, test, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "psctl local ended early"
        fresh = freshness(address)
        if fresh and test(fresh):
            return fresh
        time.sleep(0.5)
    raise AssertionError(f"not reached in {timeout}s; last freshness {freshness(address)}")


def training_pid(workdir: Path) -> int:
    for pid in processes_mentioning(str(workdir)):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "-m psctl train" in cmdline and "--once" in cmdline:
            return pid
    raise AssertionError("no training process")


def test_follow_trains_each_partition_once_through_a_kill_and_publishes(
    workdir: Path, tmp_path: Path, rows: list[Path]
):
    data, exported = tmp_path / "data", tmp_path / "serving"
    out, log = tmp_path / "summary.json", tmp_path / "stderr.log"
    place(rows[0], data / "hour=00" / "part-0")
    place(rows[1], data / "hour=01" / "part-0")
    (data / "hour=00" / "_SUCCESS").touch()
    # hour=01 is written but has no marker: the pipeline is still at it.
    (port,) = free_ports(1)
    address = f"127.0.0.1:{port}"
    argv = psctl_argv(
        "local", "--workdir", str(workdir), "--control-address", address, "--job", "ctr",
        "--train-data", str(data / "*" / "part-*"), "--follow", "--idle-timeout", "20s",
        "--export-every", "3s", "--export-dir", str(exported), "--export-keep", "2",
        "--summary-json", str(out),
    )  # fmt: skip
    with log.open("w") as stderr:
        job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True,
                               env=child_env(CTR_EVAL_EXAMPLES="2000"), cwd=REPO)  # fmt: skip
        try:
            first = wait_until(address, job, lambda f: f.get("files_trained") == 1)
            assert first["following"] is True
            assert first["newest_file"] == str(data / "hour=00" / "part-0")
            assert first["files_waiting"] == 1  # hour=01, no marker
            url = re.search(r"metrics on (http://\S+/metrics)", log.read_text()).group(1)
            scraped = urllib.request.urlopen(url, timeout=10).read().decode()
            assert "psctl_follow_files_trained_total 1.0" in scraped
            assert "psctl_follow_files_waiting 1.0" in scraped
            lag = re.search(r"^psctl_input_lag_seconds (\S+)$", scraped, re.M)
            assert lag is not None and float(lag.group(1)) > 0, scraped[-2000:]
            wait_until(address, job, lambda f: f.get("published_version", 0) > 0)
            time.sleep(2)  # well past the settle time's check: hour=01 still waits
            assert freshness(address)["files_trained"] == 1
            # The marker lands: hour=01 trains. Then the training process is killed; the
            # supervisor starts a new one, which goes on after hour=01, not again from it.
            (data / "hour=01" / "_SUCCESS").touch()
            wait_until(address, job, lambda f: f.get("files_trained") == 2)
            os.kill(training_pid(workdir), signal.SIGKILL)
            place(rows[0], data / "hour=02" / "part-0")
            (data / "hour=02" / "_SUCCESS").touch()
            wait_until(address, job, lambda f: f.get("files_trained") == 3, timeout=240)
            code = job.wait(timeout=180)  # --idle-timeout ends it
        finally:
            kill_if_running(job)
    text = log.read_text(errors="replace")
    assert code == 0, text[-3000:]
    summary = json.loads(out.read_text())
    files = [str(data / f"hour=0{h}" / "part-0") for h in range(3)]
    assert summary["freshness"]["files"] == files  # each once, in path order
    assert summary["freshness"]["files_trained"] == 3
    versions = sorted(int(v) for v in os.listdir(exported) if v.isdigit())
    assert 1 <= len(versions) <= 2  # --export-keep 2
    assert versions[-1] == summary["freshness"]["published_version"] == summary["global_step"]
    assert not [n for n in os.listdir(exported) if not n.isdigit()]  # nothing half-written
    loaded = subprocess.run(
        [sys.executable, "-c", LOAD, str(exported / str(versions[-1]))],
        capture_output=True, text=True, env=child_env(), timeout=120,
    )  # fmt: skip
    assert "answered (2, 1)" in loaded.stdout, loaded.stderr[-2000:]
    assert "Traceback" not in text


def test_export_if_better_scores_each_version_against_the_one_in_serving(
    workdir: Path, tmp_path: Path, rows: list[Path]
):
    """--export-if-better auc: each candidate and the version in serving are scored on the
    newest complete held-out partition, in the export process; the decision is logged and
    in status, and the serving version's checkpoint is kept beside the checkpoints."""
    data, held_out, exported = tmp_path / "data", tmp_path / "eval", tmp_path / "serving"
    ckpt, log = tmp_path / "ckpt", tmp_path / "stderr.log"
    place(rows[0], data / "hour=00" / "part-0")
    place(rows[1], held_out / "hour=00" / "part-0")
    for marked in (data / "hour=00", held_out / "hour=00"):
        (marked / "_SUCCESS").touch()
    (port,) = free_ports(1)
    address = f"127.0.0.1:{port}"
    argv = psctl_argv(
        "local", "--workdir", str(workdir), "--control-address", address, "--job", "ctr",
        "--train-data", str(data / "*" / "part-*"), "--follow", "--idle-timeout", "20s",
        "--checkpoint-dir", str(ckpt), "--eval-data", str(held_out / "*" / "part-*"),
        "--export-every", "1s", "--export-dir", str(exported), "--export-if-better", "auc",
    )  # fmt: skip
    with log.open("w") as stderr:
        job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True,
                               env=child_env(), cwd=REPO)  # fmt: skip
        try:
            first = wait_until(address, job, lambda f: f.get("published_version", 0) > 0)
            assert first["publish_decision"].startswith(
                f"version {first['published_version']} published: auc "
            ), first
            assert "no version in serving to compare with" in first["publish_decision"]
            place(rows[0], data / "hour=01" / "part-0")
            (data / "hour=01" / "_SUCCESS").touch()
            second = wait_until(
                address, job, lambda f: f.get("files_trained") == 2 and "against serving"
                in f.get("publish_decision", "")
            )  # fmt: skip
            # The operator's stop ends it now, as --idle-timeout would 20 s later (the same
            # end: final checkpoint, evaluation, summary, exit 0; the first test's).
            proc = control_cli(address, "stop", timeout=150)
            assert proc.returncode == 0, proc.stderr
            code = job.wait(timeout=180)
        finally:
            kill_if_running(job)
    text = log.read_text(errors="replace")
    assert code == 0, text[-3000:]
    decisions = re.findall(r"--export-if-better: (version \d+ (?:published|held back): .*)", text)
    assert len(decisions) >= 2 and second["publish_decision"] in decisions, text[-3000:]
    judged = re.search(r"auc (\S+) against serving version (\d+)'s (\S+), on 1 held-out", text)
    assert judged, decisions
    published = sorted(int(v) for v in os.listdir(exported) if v.isdigit())
    # The version in serving's checkpoint is kept (hard links), and nothing else.
    kept = sorted(n for n in os.listdir(ckpt / "publishing") if n.endswith(".index"))
    assert kept == [f"ckpt-{published[-1]}.index"], (kept, published)
    assert "Traceback" not in text


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        (
            ("--export-every", "1m", "--export-dir", "x", "--export-if-better", "auc"),
            "--export-if-better: has no --eval-data",
        ),
        (("--follow", "--epochs", "2"), "--epochs: 2 with --follow"),
        (("--follow", "--steps", "10"), "--steps: with --follow"),
        (("--follow", "--follow-marker", "a/b"), "--follow-marker: 'a/b' is not a file name"),
        (
            ("--export-every", "1m", "--export-dir", "/proc/version/x"),
            "--export-dir: cannot write to /proc/version/x",
        ),
    ],
)
def test_follow_settings_are_refused_in_one_line(
    run_cli, workdir: Path, tmp_path: Path, extra: tuple[str, ...], line: str
):
    proc = run_cli(
        psctl_argv("local", "--workdir", str(workdir), "--job", "ctr", "--train-data",
                   str(tmp_path / "*" / "part-*"), *extra),
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 78, proc.stderr[-2000:]
    assert line in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_following_job_grows_with_each_file_trained_once(
    workdir: Path, tmp_path: Path, rows: list[Path]
):
    """psctl scale of a --follow job: 2 -> 3 workers, then 1 -> 2 ps, a partition landing
    after each resize: the fresh training process goes on from the last recorded round, the
    new worker's data worker joins the tf.data service. Taking a worker out is refused in
    one line (its data worker would hold up every later round)."""
    data, out, log = tmp_path / "data", tmp_path / "summary.json", tmp_path / "stderr.log"
    for h in range(3):
        place(rows[h], data / f"hour=0{h}" / "part-0")
    (data / "hour=00" / "_SUCCESS").touch()
    (port,) = free_ports(1)
    address = f"127.0.0.1:{port}"
    argv = psctl_argv(
        "local", "--workdir", str(workdir), "--control-address", address, "--job", "ctr",
        "--workers", "2", "--train-data", str(data / "*" / "part-*"), "--follow",
        "--idle-timeout", "60s", "--summary-json", str(out),
    )  # fmt: skip
    with log.open("w") as stderr:
        job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True,
                               env=child_env(CTR_EVAL_EXAMPLES="2000"), cwd=REPO)  # fmt: skip
        try:
            wait_until(address, job, lambda f: f.get("files_trained") == 1)
            for hour, flag, count in ((1, "--workers", "3"), (2, "--ps", "2")):
                proc = control_cli(address, "scale", flag, count, timeout=240)
                assert proc.returncode == 0, proc.stderr
                (data / f"hour=0{hour}" / "_SUCCESS").touch()
                wait_until(address, job, lambda f, n=hour + 1: f.get("files_trained") == n)
            proc = control_cli(address, "scale", "--workers", "1", timeout=60)
            assert proc.returncode == 78, proc.stderr
            assert "--follow: a resize cannot take out workers" in proc.stderr
            assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
            # The operator's stop ends it now, as any run ends (final checkpoint, evaluation,
            # summary, exit 0), rather than 60 s of waiting for --idle-timeout: ending by
            # --idle-timeout is the first test's. The 60 s stays, as the job's safety net: a
            # resize takes longer than 15 s on a busy machine, and 15 s ended the job in one.
            proc = control_cli(address, "stop", timeout=150)
            assert proc.returncode == 0, proc.stderr
            code = job.wait(timeout=180)
        finally:
            kill_if_running(job)
    text = log.read_text(errors="replace")
    assert code == 0, text[-3000:]
    summary = json.loads(out.read_text())
    assert summary["freshness"]["files"] == [str(data / f"hour=0{h}" / "part-0") for h in range(3)]
    assert (summary["num_ps"], summary["num_workers"]) == (2, 3)
    assert [r["to"] for r in summary["resizes"]] == ["1 ps + 3 workers", "2 ps + 3 workers"]
    assert "Traceback" not in text
