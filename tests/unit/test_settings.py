"""Run settings: defaults < TOML file < PSCTL_* environment < flags, with clear errors."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
from dataclasses import fields
from pathlib import Path

import pytest

from psctl.cluster.errors import ConfigError
from psctl.coordinator.cli.main import TRAIN_FLAGS, build_parser
from psctl.coordinator.job import DataContext
from psctl.coordinator.settings import (
    DEFAULTS,
    OTHER_ENV,
    TrainSettings,
    check_environ,
    default_help,
    env_name,
    flag_for,
    flag_values,
    resolve_settings,
    setting_name,
)
from tests.conftest import REPO, child_env, local_argv


def test_defaults():
    s = resolve_settings(flags={}, config_file=None, environ={})
    assert s == TrainSettings()


def test_layers_in_order(tmp_path: Path):
    cfg = tmp_path / "job.toml"
    cfg.write_text('[train]\nsteps = 10\nbatch-size = 8\nseed = 3\njob = "mlp"\n')
    s = resolve_settings(
        flags={"seed": 5}, config_file=str(cfg), environ={"PSCTL_BATCH_SIZE": "16"}
    )
    assert (s.steps, s.batch_size, s.seed) == (10, 16, 5)


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        ({"steps": 0}, "--steps"),
        ({"batch_size": -1}, "--batch-size"),
        ({"steps_per_execution": -1}, "--steps-per-execution"),  # 0 = auto
        ({"log_every": 0.0}, "--log-every"),
    ],
)
def test_bad_values_name_the_flag(flags, field):
    with pytest.raises(ConfigError) as err:
        resolve_settings(flags=flags, config_file=None, environ={})
    assert str(err.value).startswith(field)
    assert err.value.exit_status == 78


def test_bad_env_value():
    with pytest.raises(ConfigError, match="PSCTL_STEPS"):
        resolve_settings(flags={}, config_file=None, environ={"PSCTL_STEPS": "many"})


@pytest.mark.parametrize(
    ("name", "closest"),
    [
        ("PSCTL_STPES", "PSCTL_STEPS"),
        ("PSCTL_BATCHSIZE", "PSCTL_BATCH_SIZE"),
        ("PSCTL_CHECKPOINT_DIRECTORY", "PSCTL_CHECKPOINT_DIR"),
        ("PSCTL_HEALTHPORT", "PSCTL_HEALTH_PORT"),  # not a setting, but a name psctl reads
    ],
)
def test_unknown_env_names_the_closest(name, closest):
    with pytest.raises(ConfigError) as err:
        resolve_settings(flags={}, config_file=None, environ={name: "8"})
    assert str(err.value) == f"{name}: is not a psctl setting or variable; did you mean {closest}?"
    assert err.value.exit_status == 78


def test_unknown_env_without_a_close_name():
    # Every name starts PSCTL_: the match ignores the prefix, so FOO is like nothing.
    with pytest.raises(ConfigError) as err:
        check_environ({"PSCTL_FOO": "1"})
    assert "did you mean" not in str(err.value)
    assert "PSCTL_<FLAG>" in str(err.value)
    with pytest.raises(ConfigError, match="PSCTL_CONFIG: is not read by psctl; give the job"):
        check_environ({"PSCTL_CONFIG": "job.toml"})


def test_known_env_is_accepted():
    environ = {env_name(f.name): "" for f in fields(TrainSettings)}
    environ.update(dict.fromkeys(OTHER_ENV, "x"))
    environ.update({"PATH": "/bin", "psctl_lower": "not ours", "TF_CONFIG": "{}"})
    check_environ(environ)
    assert resolve_settings(flags={}, config_file=None, environ=environ) == TrainSettings()


_TEXT = {".py", ".md", ".env", ".service", ".target", ".yaml", ".yml", ".toml", ".sh", ".json"}
_SKIP = {"__pycache__", "build", "dist", "psctl-work", "runs"}  # and hidden folders but .ci
_SERVICE_LINK = re.compile(r"_SERVICE_(HOST|PORT)\w*$|_PORT_\d+_(TCP|UDP|SCTP)\w*$")


def test_every_psctl_variable_in_the_repository_is_known():
    """A PSCTL_* name that units, manifests, docs, launchers or tests set must be one psctl
    accepts. Unit tests are left out: they name variables to check them, some wrong on
    purpose."""
    unit_tests = Path(__file__).resolve().parent
    found: dict[str, str] = {}
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in _SKIP and (d == ".ci" or not d.startswith("."))]
        if Path(root) == unit_tests:
            continue
        for name in files:
            path = Path(root) / name
            if path.suffix not in _TEXT and name != "Dockerfile":
                continue
            for var in re.findall(r"\bPSCTL_[A-Z][A-Z0-9_]*\b", path.read_text(errors="replace")):
                found.setdefault(var, str(path.relative_to(REPO)))
    assert "PSCTL_CLUSTER" in found  # the scan sees the units and launchers
    for var, where in sorted(found.items()):
        try:
            check_environ({var: "x"})
        except ConfigError as err:
            # Named in the docs as refused: PSCTL_CONFIG (with a hint), and the variables
            # Kubernetes' Service links would make of a Service called psctl-...
            if var != "PSCTL_CONFIG" and not _SERVICE_LINK.search(var):
                pytest.fail(f"{where}: {err} (add it to settings.OTHER_ENV if psctl reads it)")


@pytest.mark.timeout(60)
def test_unknown_env_fails_psctl_local_in_one_line(tmp_path: Path):
    proc = subprocess.run(
        local_argv(tmp_path / "work", "--steps", "5"),
        capture_output=True,
        text=True,
        timeout=50,
        env=child_env(PSCTL_STPES="5"),
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 78, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "psctl: error: PSCTL_STPES: is not a psctl setting or variable; did you mean PSCTL_STEPS?"
    ]


def test_unknown_toml_key(tmp_path: Path):
    cfg = tmp_path / "job.toml"
    cfg.write_text("[train]\nstepz = 10\n")
    with pytest.raises(ConfigError, match="stepz: is not a setting"):
        resolve_settings(flags={}, config_file=str(cfg), environ={})


def test_invalid_toml(tmp_path: Path):
    cfg = tmp_path / "job.toml"
    cfg.write_text("[train\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        resolve_settings(flags={}, config_file=str(cfg), environ={})


def test_missing_toml():
    with pytest.raises(ConfigError, match="no file at"):
        resolve_settings(flags={}, config_file="/nonexistent/job.toml", environ={})


def test_flag_names_round_trip():
    for f in fields(TrainSettings):
        assert setting_name(flag_for(f.name)) == f.name
    assert flag_for("batch_size") == "--batch-size"
    args = argparse.Namespace(batch_size=8, seed=None)
    assert flag_values(args, ["--batch-size", "--seed"]) == {"batch_size": 8, "seed": None}


def test_train_flags_are_settings():
    names = {f.name for f in fields(TrainSettings)}
    assert {setting_name(flag) for flag, _, _ in TRAIN_FLAGS} <= names


def test_help_shows_the_defaults_train_settings_hold():
    assert default_help("steps") == f"(default {TrainSettings().steps})"
    assert default_help("log_every", "{:g}".format) == "(default 5)"
    helps = {flag: text for flag, _, text in TRAIN_FLAGS}
    assert helps["--steps"].endswith(f"(default {DEFAULTS.steps})")
    assert helps["--min-shard-bytes"].endswith("(default 256 KiB)")
    assert helps["--max-in-flight"].endswith("(default 4 per worker)")
    commands = next(a for a in build_parser()._actions if a.choices)
    train_help = " ".join(commands.choices["train"].format_help().split())
    assert "stays under 10% (default auto)" in train_help
    assert "(default 1500)" in train_help
    assert "FAILS (default 10)" in train_help
    assert "(default 127.0.0.1:7070; port 0 picks a free one)" in train_help


def test_data_context_from_settings():
    settings = TrainSettings(seed=7, train_data="t*", eval_data="e*", label_column="y")
    ctx = DataContext.from_settings(settings, worker_index=1, num_workers=3, batch_size=16)
    assert ctx == DataContext(
        worker_index=1,
        num_workers=3,
        batch_size=16,
        seed=7,
        train_data="t*",
        eval_data="e*",
        label_column="y",
    )
