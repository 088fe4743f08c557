"""Run settings: defaults < TOML file < PSCTL_* environment < flags, with clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from psctl.cluster.errors import ConfigError
from psctl.coordinator.settings import TrainSettings, resolve_settings


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
