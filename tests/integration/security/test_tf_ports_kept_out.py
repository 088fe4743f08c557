"""TensorFlow's ports of a running `psctl local` job, attacked as another local user would:
TensorFlow's own client (the issue's snippet: connect to the task, write a file and read
/proc/self/status there) against every address of the job's cluster.json, a bare TCP
connect, and joining a task's network namespace. Both strategies, the job run by root
and by an ordinary user; with --open-tf-ports the same attack works (so that this test
can fail)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from psctl.cluster.ports import free_ports
from psctl.control.v1 import control_pb2
from psctl.coordinator.operations.client import Target, call
from psctl.coordinator.operations.security import ControlSecurity
from tests.conftest import (
    REPO,
    child_env,
    kill_if_running,
    processes_mentioning,
    psctl_argv,
    require_tool,
)

pytestmark = pytest.mark.integration

JOB_USER = 65534  # the ordinary user that runs the job in the unprivileged case
ATTACKER = 65533  # another user of the host

# Run as root, then as ATTACKER (TensorFlow imported first: the interpreter may live where
# ATTACKER cannot read). One JSON line per address of the cluster file, then one for the
# namespaces of the job's processes.
ATTACK = """
import json, os, socket, sys
import tensorflow as tf
uid, marker, cluster_file, pids = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
cluster = json.load(open(cluster_file))["cluster"]
os.setgroups([]); os.setgid(uid); os.setuid(uid)
for job, addresses in cluster.items():
    for address in addresses:
        host, port = address.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            tcp = "connected"
        except OSError as err:
            tcp = type(err).__name__
        try:
            tf.config.experimental_connect_to_host(address, job_name="target")
            with tf.device("/job:target/replica:0/task:0/device:CPU:0"):
                tf.io.write_file(marker, address)
                ran = tf.io.read_file("/proc/self/status").numpy().decode().split("Uid:")[1]
                ran = "ran as uid " + ran.split()[0]
        except Exception as err:
            ran = type(err).__name__
        print(json.dumps({"address": f"{job} {address}", "tcp": tcp, "op": ran}), flush=True)
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
joined = []
for pid in pids:
    try:
        fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    except OSError:
        continue
    if libc.setns(fd, 0x40000000) == 0:  # CLONE_NEWNET
        joined.append(pid)
print(json.dumps({"joined": joined}), flush=True)
"""


TOKEN = "kept-out-test-token-0123456789"


def wait_training(address: str, after: int, timeout: float = 90) -> int:
    """The job's step once it is RUNNING past ``after``, asked with the job's token."""
    target = Target(address, ControlSecurity.from_args(None), TOKEN)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status = call(target, "GetStatus", control_pb2.GetStatusRequest())
            running = control_pb2.JobState.Name(status.state) == "JOB_STATE_RUNNING"
            if running and status.global_step > after:
                return int(status.global_step)
        except Exception:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the job did not train past step {after} in {timeout}s")


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory under /tmp that JOB_USER owns (pytest's tmp_path is root's alone); every
    process that mentions it is killed at teardown."""
    path = Path(tempfile.mkdtemp(prefix="psctl-kept-out-"))
    os.chmod(path, 0o755)
    os.chown(path, JOB_USER, JOB_USER)
    yield path
    for pid in processes_mentioning(str(path)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    shutil.rmtree(path, ignore_errors=True)


def as_user(uid: int) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


def unprivileged_python() -> list[str]:
    """An interpreter JOB_USER can run inside a user namespace, with this checkout and
    its packages: this one, or the distribution's of the same version when this one lives
    where JOB_USER cannot read (pyenv under /root)."""
    here = Path(os.path.realpath(sys.executable))
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (here, Path("/usr/bin") / version):
        probe = subprocess.run(
            [*as_user(JOB_USER), "unshare", "--user", "--map-root-user", str(candidate), "-c", ""],
            capture_output=True,
            timeout=30,
        )
        if probe.returncode == 0:
            return [str(candidate)]
    pytest.skip(f"no {version} that uid {JOB_USER} can run in a user namespace")


def attack(cluster_file: Path, marker: Path, pids: list[int]) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-c", ATTACK, str(ATTACKER), str(marker), str(cluster_file)]
        + [str(p) for p in pids],
        capture_output=True,
        text=True,
        timeout=240,
        env=child_env(GRPC_FAIL_FAST="true"),  # a refused connection fails at once
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def start_job(workdir: Path, strategy: str, *extra: str, user: int = 0) -> tuple[Any, str]:
    (port,) = free_ports(1)
    address = f"127.0.0.1:{port}"
    token = workdir / "control.token"
    token.write_text(TOKEN + "\n")
    os.chmod(token, 0o600)
    os.chown(token, user, user)
    argv = psctl_argv(
        "local",
        "--workdir",
        str(workdir / "job"),
        "--strategy",
        strategy,
        "--steps",
        "10000000",
        "--checkpoint-every",
        "1000000",
        "--control-address",
        address,
        "--control-token-file",
        str(token),
        *extra,
    )
    env = child_env(HOME=str(workdir))
    env.pop("XDG_RUNTIME_DIR", None)
    if user:
        site = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
        env["PYTHONPATH"] = f"{REPO}{os.pathsep}{site}"
        argv = [*unprivileged_python(), *argv[1:]]
        argv = [*as_user(user), *argv]
    job = subprocess.Popen(
        argv,
        stdout=open(workdir / "job.log", "wb"),  # noqa: SIM115  (closed with the process)
        stderr=subprocess.STDOUT,
        env=env,
        cwd=workdir,
    )
    return job, address


@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    "strategy,user,opened",
    [("async", 0, False), ("sync", 0, False), ("async", JOB_USER, False), ("async", 0, True)],
    ids=["async-root", "sync-root", "async-ordinary-user", "async-open"],
)
def test_another_user_runs_no_op_on_any_task(
    open_dir: Path, strategy: str, user: int, opened: bool
):
    extra = ("--open-tf-ports",) if opened else ()
    job, address = start_job(open_dir, strategy, *extra, user=user)
    token = ("--control-token-file", str(open_dir / "control.token"))
    marker = open_dir / "written-by-another-user"
    try:
        last = wait_training(address, 0, timeout=180)
        cluster_file = open_dir / "job" / "cluster.json"
        results = attack(cluster_file, marker, processes_mentioning(str(open_dir / "job")))
        tasks = [r for r in results if "address" in r]
        expected = json.loads(cluster_file.read_text())["cluster"]
        assert len(tasks) == sum(len(a) for a in expected.values()), results
        if opened:  # the attack works on an open job: the test can see one
            assert all(r["op"].startswith("ran as uid") for r in tasks), results
            assert marker.exists()
        else:
            for result in tasks:
                assert result["tcp"] == "ConnectionRefusedError", result
                assert not result["op"].startswith("ran"), result
            assert not marker.exists(), f"written on a task: {marker.read_text()}"
            assert results[-1] == {"joined": []}, results[-1]
        wait_training(address, last)  # it trains on
        stop = subprocess.run(
            psctl_argv("stop", "--address", address, *token, "--timeout", "150"),
            capture_output=True,
            text=True,
            timeout=180,
            env=child_env(),
        )
        assert stop.returncode == 0, stop.stderr
        assert job.wait(timeout=60) == 0, (open_dir / "job.log").read_text()[-3000:]
    finally:
        kill_if_running(job)
    log = (open_dir / "job.log").read_text()
    if opened:
        assert log.count("TensorFlow's ports are open") == 1, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


@pytest.mark.timeout(120)
def test_no_namespace_to_be_had_is_one_line_and_exit_78(tmp_path: Path):
    """A kernel that refuses user namespaces, as util-linux's unshare reports it: the job
    does not start open; one line names the ways out."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "unshare"
    fake.write_text(
        "#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    env = child_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(
        psctl_argv("local", "--workdir", str(tmp_path / "job"), "--control-address", "127.0.0.1:0"),
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
    )
    assert proc.returncode == 78, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "Operation not permitted" in errors[0] and "--open-tf-ports" in errors[0]
    assert not (tmp_path / "job" / "cluster.json").exists()  # no server started


@pytest.mark.timeout(300)
def test_bench_compares_open_and_namespaced_ports(run_cli, tmp_path: Path):
    """bench/throughput.py --tf-ports-overhead at a small size: both clusters train, and
    the last line is the cost."""
    argv = [sys.executable, str(REPO / "bench" / "throughput.py"), "--tf-ports-overhead",
            "--repeats", "1", "--steps", "100", "--workdir", str(tmp_path)]  # fmt: skip
    proc = run_cli(argv, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert re.fullmatch(r"namespace cost = -?\d+\.\d%", lines[-1]), lines[-1]
    rates = {m: float(v) for m, v in re.findall(r"^\[1/1\] (psctl\S*)@\d+ +([\d.]+) steps/s",
                                                   proc.stdout, re.M)}  # fmt: skip
    assert sorted(rates) == ["psctl", "psctl-netns"] and all(r > 0 for r in rates.values())


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[str, str]]:
    """Two network namespaces joined by a veth pair: the job's host (10.77.0.1) and another
    host on its network (10.77.0.2). The root namespace's network is never touched."""
    require_tool("ip", "apt-get install iproute2 (make systemd-tools)")
    job, other = f"pskept{os.getpid()}-job", f"pskept{os.getpid()}-out"
    commands = [
        ["netns", "add", job],
        ["netns", "add", other],
        ["link", "add", "kept0", "netns", job, "type", "veth", "peer", "kept1", "netns", other],
        ["-n", job, "addr", "add", "10.77.0.1/24", "dev", "kept0"],
        ["-n", other, "addr", "add", "10.77.0.2/24", "dev", "kept1"],
        ["-n", job, "link", "set", "kept0", "up"],
        ["-n", other, "link", "set", "kept1", "up"],
        ["-n", job, "link", "set", "lo", "up"],
        ["-n", other, "link", "set", "lo", "up"],
    ]
    try:
        for command in commands:
            subprocess.run(["ip", *command], check=True, capture_output=True, timeout=30)
        yield job, other
    finally:
        for name in (job, other):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


PROBE = """
import json, socket, sys
result = {}
for address in sys.argv[1:]:
    try:
        socket.create_connection(("10.77.0.1", int(address.rsplit(":", 1)[1])), timeout=3).close()
        result[address] = "connected"
    except OSError as err:
        result[address] = type(err).__name__
print(json.dumps(result))
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("opened", [False, True], ids=["kept-out", "open"])
def test_another_host_reaches_no_tf_port(workdir: Path, opened: bool):
    """psctl local on a host with a network interface; another host on that network
    connects to every TF port of the job at the host's address: refused (with
    --open-tf-ports: it connects, so this test can fail)."""
    with two_hosts() as (job_host, other_host):
        argv = [*psctl_argv("local", "--workdir", str(workdir), "--steps", "10000000",
                            "--checkpoint-every", "1000000", "--control-address", "127.0.0.1:0",
                            "--log-every", "1"),
                *(["--open-tf-ports"] if opened else [])]  # fmt: skip
        log = workdir.parent / "job.log"
        with log.open("wb") as out:
            job = subprocess.Popen(
                ["ip", "netns", "exec", job_host, *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env(),
            )
        try:
            deadline = time.monotonic() + 180
            while "train | step:" not in log.read_text(errors="replace"):
                assert job.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.5)
            cluster = json.loads((workdir / "cluster.json").read_text())["cluster"]
            addresses = [a for addrs in cluster.values() for a in addrs]
            probe = subprocess.run(
                ["ip", "netns", "exec", other_host, sys.executable, "-c", PROBE, *addresses],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert probe.returncode == 0, probe.stderr
            reached = json.loads(probe.stdout)
            assert sorted(reached) == sorted(addresses)
            if opened:
                assert set(reached.values()) == {"connected"}, reached
            else:
                assert set(reached.values()) == {"ConnectionRefusedError"}, reached
            steps = log.read_text().count("train | step:")
            time.sleep(3)  # a progress line a second: it trains on
            assert log.read_text().count("train | step:") > steps
            job.send_signal(signal.SIGINT)
            assert job.wait(timeout=120) == 0, log.read_text()[-3000:]
        finally:
            kill_if_running(job)


@pytest.mark.timeout(120)
def test_a_misspelt_open_switch_is_one_line_not_an_open_job(tmp_path: Path):
    """PSCTL_OPEN_TF_PORTS takes what PSCTL_INSECURE_CONTROL takes; anything else (here
    "on") is one line, exit 78, before any server starts."""
    proc = subprocess.run(
        psctl_argv("local", "--workdir", str(tmp_path / "job"), "--control-address", "127.0.0.1:0"),
        capture_output=True,
        text=True,
        timeout=100,
        env=child_env(PSCTL_OPEN_TF_PORTS="on"),
    )
    assert proc.returncode == 78, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "PSCTL_OPEN_TF_PORTS: got 'on'" in errors[0], errors[0]
    assert not (tmp_path / "job" / "cluster.json").exists()
