"""Where the tf.data service dispatcher is configured (--epochs), and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from psctl.cluster.dataservice import ENV_DISPATCHER, dispatcher_address, require_dispatcher
from psctl.cluster.errors import ConfigError
from psctl.coordinator.settings import resolve_settings
from tests.conftest import child_env
from tests.unit.test_cli import CLUSTER, run


def cluster_file(tmp_path: Path, **extra: object) -> str:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({**CLUSTER, **extra}))
    return str(path)


def test_flag_then_environment_then_cluster_file(tmp_path: Path):
    path = cluster_file(tmp_path, data_service={"dispatcher": "10.0.0.1:5050"})
    assert dispatcher_address(flag=None, cluster_file=path, environ={}) == "10.0.0.1:5050"
    env = {ENV_DISPATCHER: "10.0.0.9:6060"}
    assert dispatcher_address(flag=None, cluster_file=path, environ=env) == "10.0.0.9:6060"
    assert dispatcher_address(flag="h:1", cluster_file=path, environ=env) == "h:1"
    assert dispatcher_address(flag=None, cluster_file=cluster_file(tmp_path), environ={}) is None


@pytest.mark.parametrize(
    ("section", "field"),
    [({"dispatcher": "nohost"}, "data_service.dispatcher"), ({"x": 1}, "data_service")],
)
def test_bad_dispatcher_in_cluster_file(tmp_path: Path, section: object, field: str):
    path = cluster_file(tmp_path, data_service=section)
    with pytest.raises(ConfigError) as err:
        dispatcher_address(flag=None, cluster_file=path, environ={})
    assert field in str(err.value)


def test_epochs_need_a_dispatcher():
    with pytest.raises(ConfigError) as err:
        require_dispatcher(None)
    assert "--epochs" in str(err.value) and "data_service" in str(err.value)


def test_negative_epochs_is_a_config_error():
    with pytest.raises(ConfigError, match="--epochs"):
        resolve_settings(flags={"epochs": -1}, config_file=None, environ={})


def test_steps_with_epochs_is_refused_where_it_was_given(tmp_path: Path):
    """--epochs trains passes instead of steps: a --steps beside it was once dropped in
    silence (the run trained its passes, whatever --steps said)."""
    with pytest.raises(ConfigError) as err:
        resolve_settings(flags={"epochs": 1, "steps": 100}, config_file=None, environ={})
    assert str(err.value).startswith("--steps: with --epochs"), str(err.value)
    with pytest.raises(ConfigError) as err:
        resolve_settings(flags={"epochs": 1}, config_file=None, environ={"PSCTL_STEPS": "100"})
    assert str(err.value).startswith("PSCTL_STEPS: with --epochs"), str(err.value)
    settings = resolve_settings(flags={"epochs": 2}, config_file=None, environ={})
    assert settings.data.epochs == 2


@pytest.mark.timeout(60)
def test_train_epochs_without_dispatcher_is_one_line_78(tmp_path: Path):
    proc = run("train", "--cluster", cluster_file(tmp_path), "--epochs", "2", env=child_env())
    assert proc.returncode == 78, proc.stderr
    assert "--epochs" in proc.stderr and proc.stderr.count("\n") == 1
