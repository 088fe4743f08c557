"""The psctl CLI as a process: check-config, help, and configuration errors (no TF needed)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import child_env, psctl_argv

CLUSTER = {
    "cluster": {
        "chief": ["10.0.0.1:2222"],
        "ps": ["10.0.0.2:2222"],
        "worker": ["10.0.0.3:2222", "10.0.0.4:2222"],
    }
}


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        psctl_argv(*args), capture_output=True, text=True, timeout=30, env=env or child_env()
    )


@pytest.mark.timeout(60)
def test_check_config_file_prints_table(tmp_path: Path):
    path = tmp_path / "cluster.json"
    # Keys of TensorFlow's and of a platform's own are no misspelling of psctl's.
    path.write_text(json.dumps({**CLUSTER, "environment": "cloud", "job": {"name": "x"}}))
    proc = run("check-config", str(path))
    assert proc.returncode == 0, proc.stderr
    for address in ("10.0.0.1:2222", "10.0.0.2:2222", "10.0.0.3:2222", "10.0.0.4:2222"):
        assert address in proc.stdout
    assert "2 workers" in proc.stdout
    path.write_text(json.dumps({**CLUSTER, "data_service": {"dispatcher": "10.0.0.1:5050"}}))
    proc = run("check-config", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "tf.data service dispatcher: 10.0.0.1:5050" in proc.stdout


@pytest.mark.timeout(60)
def test_check_config_from_tf_config():
    env = child_env(TF_CONFIG=json.dumps({**CLUSTER, "task": {"type": "chief", "index": 0}}))
    proc = run("check-config", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "10.0.0.4:2222" in proc.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("body", "field"),
    [
        ("{nope", "cluster.json"),
        (json.dumps({"cluster": {"worker": ["h:1"]}}), "ps"),
        (json.dumps({"cluster": {"ps": ["h:1"]}}), "worker"),
        (json.dumps({"cluster": {"ps": ["h:1"], "worker": ["h:99999"]}}), "worker[0]"),
        (json.dumps({**CLUSTER, "health": 5}), "health: is not an object"),
        (json.dumps({**CLUSTER, "health": {"ps": "h:1"}}), "health.ps: is not a list"),
        (json.dumps({**CLUSTER, "health": {"ps": ["h:x"]}}), "health.ps[0]"),
        # A misspelt type was dropped, and its servers' health ports taken as TF + 1000.
        (json.dumps({**CLUSTER, "health": {"wrker": ["h:9"]}}), "health.wrker: is not a task"),
        (json.dumps({**CLUSTER, "health": {"ps": ["h:8", "h:9"]}}), "health.ps[1]: names a task"),
        # Misspelt keys were ignored in silence; a platform's own keys still are.
        (json.dumps({**CLUSTER, "helth": {}}), "helth: is not a key psctl reads (did you mean"),
        (
            json.dumps({**CLUSTER, "task": {"type": "ps", "index": 0, "indx": 5}}),
            "task.indx: is not a key psctl reads (did you mean 'index'?)",
        ),
        (json.dumps({**CLUSTER, "data_service": 5}), "data_service: has no dispatcher"),
        (json.dumps({**CLUSTER, "data_service": {"dispatcher": "h"}}), "data_service.dispatcher"),
    ],
)
def test_check_config_errors_are_one_line_78(tmp_path: Path, body: str, field: str):
    path = tmp_path / "cluster.json"
    path.write_text(body)
    proc = run("check-config", str(path))
    assert proc.returncode == 78
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert field in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.timeout(60)
def test_train_without_chief_is_a_config_error(tmp_path: Path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"cluster": {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}}))
    proc = run("train", "--cluster", str(path))
    assert proc.returncode == 78, proc.stderr
    assert "chief" in proc.stderr and proc.stderr.count("\n") == 1


@pytest.mark.timeout(60)
def test_train_with_worker_tf_config_is_a_config_error():
    env = child_env(TF_CONFIG=json.dumps({**CLUSTER, "task": {"type": "worker", "index": 0}}))
    proc = run("train", env=env)
    assert proc.returncode == 78
    assert "TF_CONFIG.task.type" in proc.stderr


@pytest.mark.timeout(60)
def test_train_takes_its_connect_timeout_from_the_environment_and_warns_without_checkpoints(
    tmp_path: Path,
):
    """Under systemd every run setting is PSCTL_*: a 1 s --connect-timeout from the env file
    ends a job whose servers never listen with exit 69 at once; and a job with no
    --checkpoint-dir says, once, what that costs."""
    from psctl.cluster.ports import free_ports

    chief, ps, worker = free_ports(3)
    path = tmp_path / "cluster.json"
    cluster = {"chief": [f"127.0.0.1:{chief}"], "ps": [f"127.0.0.1:{ps}"]}
    path.write_text(json.dumps({"cluster": {**cluster, "worker": [f"127.0.0.1:{worker}"]}}))
    started = time.monotonic()
    proc = run(
        "train", "--cluster", str(path), "--control-address", "127.0.0.1:0",
        "--metrics-port", "0", env=child_env(PSCTL_CONNECT_TIMEOUT="1"),
    )  # fmt: skip
    assert proc.returncode == 69, proc.stderr
    assert time.monotonic() - started < 20
    assert "servers not reachable after 1s (--connect-timeout)" in proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "no --checkpoint-dir" in line]
    assert len(warnings) == 1 and "starts the job again from step 0" in warnings[0]


@pytest.mark.timeout(60)
def test_help_is_fast_and_does_not_import_tensorflow():
    started = time.monotonic()
    proc = subprocess.run(
        psctl_argv("--help"), capture_output=True, text=True, timeout=30, env=child_env()
    )
    assert proc.returncode == 0
    assert "local" in proc.stdout and "train" in proc.stdout
    assert time.monotonic() - started < 5
    code = "import psctl.coordinator.cli.main, sys; print('tensorflow' in sys.modules)"
    probe = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=child_env()
    )
    assert probe.stdout.strip() == "False"


def _subparsers(parser: Any, prefix: str = "psctl") -> list[tuple[str, Any]]:
    found = []
    for action in parser._actions:  # argparse keeps its subparsers only there
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += [(f"{prefix} {name}", sub), *_subparsers(sub, f"{prefix} {name}")]
    return found


def test_every_command_says_what_it_does_and_every_default_reads_sensibly():
    from psctl.coordinator.cli.main import build_parser

    commands = _subparsers(build_parser())
    assert len(commands) >= 15
    for name, parser in commands:
        assert parser.description, f"{name} --help has no description"
        text = parser.format_help()
        for odd in ("(default None)", "(default default)", "(default )", "default: None"):
            assert odd not in text, f"{name} --help: {odd}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("job", ["no_such_job.py", "no_such_job"])
def test_a_job_that_is_not_there_is_refused_before_waiting_for_servers(tmp_path: Path, job: str):
    """It waited --connect-timeout for the servers, then ended with exit 69 ("servers not
    reachable"), which systemd and Kubernetes take as final, instead of naming --job."""
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"cluster": {**CLUSTER["cluster"], "chief": ["127.0.0.1:1"]}}))
    started = time.monotonic()
    proc = run("train", "--cluster", str(path), "--job", job, "--connect-timeout", "50")
    assert proc.returncode == 78, proc.stderr
    assert proc.stderr.startswith("psctl: error: --job: no job ") and proc.stderr.count("\n") == 1
    assert time.monotonic() - started < 30
    proc = run("local", "--job", job, "--steps", "10", "--workdir", str(tmp_path / "w"))
    assert proc.returncode == 78 and "--job: no job " in proc.stderr, proc.stderr


@pytest.mark.timeout(60)
def test_a_job_that_does_not_load_ends_the_wait_for_servers_at_once(tmp_path: Path):
    """The job loads on a thread beside the wait for the servers: its SyntaxError is the
    one line and exit 78 within seconds, not after --connect-timeout's 50 s and exit 69."""
    job = tmp_path / "bad_job.py"
    job.write_text("def create_model(:\n    pass\n")
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"cluster": {**CLUSTER["cluster"], "chief": ["127.0.0.1:1"]}}))
    started = time.monotonic()
    proc = run(
        "train", "--cluster", str(path), "--job", str(job), "--connect-timeout", "50",
        "--control-address", "127.0.0.1:0", "--metrics-port", "0",
    )  # fmt: skip
    assert proc.returncode == 78, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("psctl: error:")]
    assert len(errors) == 1 and "SyntaxError in bad_job.py, line 1" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - started < 30


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "named"),
    [
        # A prefix of one flag was read as that flag: the evaluation watched a checkpoint
        # path as a directory, for --timeout (3600 s).
        (("evaluate", "--checkpoint-d", "ckpt"), "--checkpoint-d (did you mean --checkpoint-dir?)"),
        (
            ("local", "--checkpoint-evry", "10"),
            "--checkpoint-evry (did you mean --checkpoint-every?)",
        ),
        (("local", "--step=10"), "--step (did you mean --steps?)"),
        (("deploy", "check", "--cluser", "c.json"), "--cluser (did you mean --cluster?)"),
    ],
)
def test_flags_are_exact_and_a_wrong_one_names_the_closest_and_the_subcommands_help(args, named):
    proc = run(*args)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    command = (
        " ".join(a for a in args[:2] if not a.startswith("-")) if args[0] == "deploy" else args[0]
    )
    assert line.startswith(f"psctl: error: unrecognized arguments: {named}"), line
    assert line.endswith(f"; see 'psctl {command} --help'"), line
