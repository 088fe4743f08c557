"""Shared fixtures: run psctl commands as real processes, and find what they leave behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from bench.harness.netns_hosts import NetnsLab, remove_stale_labs
from psctl.cluster.processes.procs import command_lines
from psctl.coordinator import argv as launch_argv

REPO = Path(__file__).resolve().parent.parent


def child_env(**extra: str) -> dict[str, str]:
    # Not under this process's systemd unit, if any: no notify socket, no watchdog.
    unit = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG" and k not in unit}
    env.update({"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"})
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def psctl_argv(*args: str) -> list[str]:
    return launch_argv.psctl_argv(*args)


def local_argv(workdir: Path, *args: str) -> list[str]:
    """``psctl local`` in ``workdir``, its control service on a free port, then ``args``."""
    return psctl_argv("local", "--workdir", str(workdir), "--control-address", "127.0.0.1:0", *args)


def require_tool(name: str, install: str) -> str:
    """The path of ``name`` on PATH; fails the test (never skips) saying how to install it."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not on PATH: run {install}", pytrace=False)
    return path


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (e.g. a test's work dir)."""
    return list(command_lines(text))


def describe_process(pid: int) -> str:
    """A process as a failing test reports it: command line, state and signal masks."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return f"{pid}: gone"
    wanted = ("State", "PPid", "Threads", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
    fields = [line for line in status if line.split(":")[0] in wanted]
    try:  # where its main thread waits
        wchan = Path(f"/proc/{pid}/wchan").read_text() or "-"
        syscall = Path(f"/proc/{pid}/syscall").read_text().split()[0]
    except OSError:
        wchan = syscall = "?"
    fields.append(f"main thread: wchan {wchan}, syscall {syscall}")
    return f"{pid}: {cmdline.strip()} | " + ", ".join(" ".join(f.split()) for f in fields)


def run_python(code: str, *args: str, timeout: float = 60) -> str:
    """Run ``code`` in a fresh interpreter (e.g. to read TensorFlow files while keeping this
    process free of TensorFlow); its stdout, or the test fails with its stderr."""
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def kill_if_running(proc: subprocess.Popen[Any] | None, timeout: float | None = None) -> None:
    """A test's clean-up: SIGKILL ``proc`` if it is still running, and reap it."""
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(timeout)


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """A run directory; every process that mentions it is killed at teardown."""
    path = tmp_path / "run"
    yield path
    kill_all(processes_mentioning(str(path)))


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def control_cli(address: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """``psctl ARGS --address ADDRESS``: an operator's command to a job's control service."""
    return subprocess.run(
        psctl_argv(*args, "--address", address),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
    )


def status_or_none(address: str) -> dict | None:
    """``psctl status --json`` of the job at ``address``, or None while it does not answer."""
    proc = control_cli(address, "status", "--json")
    return json.loads(proc.stdout) if proc.returncode == 0 else None


@pytest.fixture
def run_cli():
    """Run a CLI as a subprocess with a hard timeout; returns CompletedProcess."""

    def run(
        argv: list[str],
        *,
        timeout: float,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env or child_env(),
            cwd=cwd or REPO,
            stdin=subprocess.DEVNULL,
        )

    return run


@contextlib.contextmanager
def open_lab(hosts: Mapping[str, str], *, scripts: Sequence[str] = ()) -> Iterator[NetnsLab]:
    """A fresh lab of network-namespace hosts for a test (bench/harness/netns_hosts.py; skipped
    without root); stale labs of killed runs go first.

    The /etc/psctl directory is created empty when missing: `ip netns exec` bind-mounts each
    host's /etc/netns/NS/psctl over it."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    require_tool("ip", "tools/ensure-systemd-tools.sh (iproute2)")
    bin_dir = Path(sys.executable).parent
    for script in scripts:
        if not (bin_dir / script).exists():
            pytest.fail(f"{bin_dir / script} is missing: run make install", pytrace=False)
    remove_stale_labs()
    Path("/etc/psctl").mkdir(mode=0o755, exist_ok=True)
    lab = NetnsLab(hosts)
    try:
        lab.create()
        yield lab
    finally:
        lab.destroy()
