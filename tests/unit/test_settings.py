"""Run settings: defaults < TOML file < PSCTL_* environment < flags, with clear errors."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

import pytest

from psctl.cluster.errors import ConfigError
from psctl.coordinator.cli.main import TRAIN_FLAGS, build_parser
from psctl.coordinator.job import DataContext
from psctl.coordinator.settings import (
    DEFAULTS,
    TrainSettings,
    default_help,
    flag_for,
    flag_values,
    resolve_settings,
    setting_name,
)


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
