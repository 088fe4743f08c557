"""Run settings for a training job: defaults < TOML job file < environment < flags."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from psctl.cluster.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ENV_PREFIX = "PSCTL_"
# The PSCTL_* variables that are not run settings, and who reads them. Every other PSCTL_*
# name must be PSCTL_<SETTING>: an unknown one (a typo) is a configuration error, as an
# unknown key in the TOML file is, not silently ignored (check_environ).
OTHER_ENV = {
    "PSCTL_CLUSTER": "the cluster file; the systemd units pass it as --cluster (psctl.env)",
    "PSCTL_BIND_HOST": "where the side ports of servers and the coordinator listen",
    "PSCTL_HEALTH_PORT": "a server's grpc.health.v1 port (cluster/server.py)",
    "PSCTL_METRICS_PORT": "a server's /metrics port (cluster/server.py)",
    "PSCTL_DATA_DISPATCHER": "the tf.data service dispatcher (cluster/dataservice.py)",
    "PSCTL_DATA_PORT": "a worker's tf.data service worker port (cluster/server.py)",
    "PSCTL_CONTROL_ADDRESS": "the coordinator unit's --control-address (coordinator.env)",
    "PSCTL_COORDINATOR_METRICS_PORT": "the coordinator unit's --metrics-port (coordinator.env)",
    # Set by the test suite, inherited by the psctl processes the tests start.
    "PSCTL_CHAOS_RESULTS": "tests/chaos: a file the measured table is appended to",
    "PSCTL_TEST_POISON_MARKER": "tests/jobs/poisoned.py: its marker file",
}
# Names people reach for that are not read, and what to do instead.
_ENV_HINTS = {
    "PSCTL_CONFIG": "give the job file as --config, or its [train] values as PSCTL_<NAME>",
}
UPDATE_MODES = ("default", "local")
# "async": ParameterServerStrategy driven by a coordinator (the default); "sync":
# MultiWorkerMirroredStrategy, every worker runs the loop and all-reduces gradients.
STRATEGIES = ("async", "sync")
AUTO = "auto"  # --steps-per-execution auto, stored as 0
IN_FLIGHT_PER_WORKER = 4  # --max-in-flight 0: this many scheduled calls per worker
# The coordinator's own ports (`psctl train`, and the units `psctl deploy` writes).
DEFAULT_CONTROL_ADDRESS = "127.0.0.1:7070"
DEFAULT_METRICS_PORT = 9940


def flag_for(name: str) -> str:
    """The command-line flag of a setting: ``batch_size`` -> ``--batch-size``."""
    return f"--{name.replace('_', '-')}"


def setting_name(flag: str) -> str:
    """The setting of a command-line flag: ``--batch-size`` -> ``batch_size``."""
    return flag.removeprefix("--").replace("-", "_")


def flag_values(args: argparse.Namespace, flags: Iterable[str]) -> dict[str, Any]:
    """What ``flags`` hold in ``args``, by setting name (None where not given)."""
    return {setting_name(flag): getattr(args, setting_name(flag)) for flag in flags}


def parse_steps_per_execution(value: Any) -> int:
    """``auto`` (any case) is 0; anything else a whole number (checked by TrainSettings)."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return 0
    if isinstance(value, bool):
        raise ValueError(value)
    return int(value)


def show_steps_per_execution(value: int) -> str:
    """How --steps-per-execution reads: ``auto`` for 0."""
    return str(value) if value else AUTO


@dataclass(frozen=True)
class TrainSettings:
    """What a training run needs besides the cluster and the job code."""

    job: str = "mlp"
    strategy: str = "async"  # "async": parameter servers; "sync": all-reduce over the workers
    steps: int = 1500
    batch_size: int = 64  # per worker
    steps_per_execution: int = 0  # steps per scheduled call; 0 = "auto" (coordinator/packing.py)
    update_mode: str = "default"  # "default": the ps optimizer every step; "local": local steps
    local_steps: int = 50  # --update-mode local: steps per call between variable round trips
    local_scale: float = 1.0  # --update-mode local: factor on each call's pushed change
    checkpoint_dir: str = ""  # "" = no checkpoints
    checkpoint_every: int = 500  # steps
    keep_checkpoints: int = 3
    eval_batch_size: int = 1024
    seed: int = 42
    log_every: float = 5.0  # seconds between progress lines
    max_shards: int = 1  # >1 partitions large variables over the ps tasks
    min_shard_bytes: int = 256 << 10
    max_in_flight: int = 0  # scheduled calls not yet finished; 0 = IN_FLIGHT_PER_WORKER
    summary_json: str = ""
    stall_timeout: float = 60.0  # seconds without a finished step before the watchdog acts
    logdir: str = ""  # TensorBoard scalar summaries; "" = none
    train_data: str = ""  # file glob handed to the job's dataset_fn (DataContext.train_data)
    eval_data: str = ""
    label_column: str = "label"
    eval_every: int = 0  # >0: distributed evaluation on the workers every N steps
    epochs: int = 0  # >0: train this many passes over the data through the tf.data service

    def __post_init__(self) -> None:
        positive = (
            "steps",
            "batch_size",
            "checkpoint_every",
            "local_steps",
            "keep_checkpoints",
            "eval_batch_size",
            "max_shards",
            "min_shard_bytes",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(flag_for(name), f"got {value!r}", "give a whole number >= 1")
        if not self.stall_timeout > 0:
            raise ConfigError("--stall-timeout", f"got {self.stall_timeout!r}", "give seconds > 0")
        if not self.log_every > 0:
            raise ConfigError("--log-every", f"got {self.log_every!r}", "give seconds > 0")
        if self.eval_every < 0:
            raise ConfigError("--eval-every", f"got {self.eval_every}", "give a whole number >= 1")
        if self.epochs < 0:
            raise ConfigError("--epochs", f"got {self.epochs}", "give a whole number >= 1")
        if isinstance(self.steps_per_execution, bool) or self.steps_per_execution < 0:
            raise ConfigError(
                "--steps-per-execution",
                f"got {self.steps_per_execution!r}",
                "give a whole number >= 1, or auto",
            )
        if self.strategy not in STRATEGIES:
            raise ConfigError(
                "--strategy", f"got {self.strategy!r}", f"use one of {', '.join(STRATEGIES)}"
            )
        if self.update_mode not in UPDATE_MODES:
            raise ConfigError(
                "--update-mode",
                f"got {self.update_mode!r}",
                f"use one of {', '.join(UPDATE_MODES)}",
            )
        if self.update_mode == "local" and self.epochs:
            raise ConfigError(
                "--update-mode", "local with --epochs", "use --update-mode default with --epochs"
            )
        if not self.local_scale > 0:
            raise ConfigError("--local-scale", f"got {self.local_scale!r}", "give a factor > 0")
        if self.max_in_flight < 0:
            raise ConfigError("--max-in-flight", f"got {self.max_in_flight}", "give >= 0")


_TYPES = {f.name: f.type for f in fields(TrainSettings)}
DEFAULTS = TrainSettings()


def default_help(name: str, show: Callable[[Any], str] = str) -> str:
    """``(default 1500)``: a setting's default as help text shows it, from TrainSettings."""
    return f"(default {show(getattr(DEFAULTS, name))})"


def _coerce(name: str, value: Any, where: str) -> Any:
    kind = _TYPES[name]
    try:
        if name == "steps_per_execution":
            return parse_steps_per_execution(value)
        if kind in ("int", int):
            if isinstance(value, bool):
                raise ValueError
            return int(value)
        if kind in ("float", float):
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(where, f"{value!r} is not a valid {kind}", f"give a {kind}") from None


def load_toml(path: str) -> dict[str, Any]:
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(
            "--config", f"no file at {path}", "give an existing TOML job file"
        ) from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"--config {path}", f"invalid TOML: {err}", "fix the syntax") from None
    table = data.get("train", data)
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: train", "is not a table", "write [train] with key = value")
    out = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in _TYPES:
            raise ConfigError(
                f"{path}: {key}", "is not a setting", f"use one of {', '.join(sorted(_TYPES))}"
            )
        out[name] = _coerce(name, value, f"{path}: {key}")
    return out


def env_name(name: str) -> str:
    """The environment variable of a setting: ``batch_size`` -> ``PSCTL_BATCH_SIZE``."""
    return ENV_PREFIX + name.upper()


def check_environ(environ: Mapping[str, str]) -> None:
    """Raise ConfigError for the first PSCTL_* variable psctl does not read.

    The one-line error names the closest valid variable: a misspelt setting would otherwise
    be ignored, and the run would quietly use its default.
    """
    known = {env_name(name) for name in _TYPES} | set(OTHER_ENV)
    # Compared without the prefix: every name shares it, which makes any two look alike.
    suffixes = {name.removeprefix(ENV_PREFIX): name for name in known}
    for key in sorted(environ):
        if not key.startswith(ENV_PREFIX) or key in known:
            continue
        if key in _ENV_HINTS:
            raise ConfigError(key, "is not read by psctl", _ENV_HINTS[key])
        close = difflib.get_close_matches(key.removeprefix(ENV_PREFIX), suffixes, n=1)
        fix = (
            f"did you mean {suffixes[close[0]]}?"
            if close
            else f"unset it, or set a training flag as {ENV_PREFIX}<FLAG> "
            f"(--batch-size: {env_name('batch_size')})"
        )
        raise ConfigError(key, "is not a psctl setting or variable", fix)


def resolve_settings(
    *, flags: Mapping[str, Any], config_file: str | None, environ: Mapping[str, str] | None = None
) -> TrainSettings:
    """Merge the layers; ``flags`` holds only what was given on the command line.

    An unknown ``PSCTL_*`` variable in ``environ`` is an error (check_environ).
    """
    env = os.environ if environ is None else environ
    check_environ(env)
    merged: dict[str, Any] = {}
    if config_file:
        merged.update(load_toml(config_file))
    for name in _TYPES:
        key = env_name(name)
        if env.get(key):
            merged[name] = _coerce(name, env[key], key)
    for name, value in flags.items():
        if value is not None and name in _TYPES:
            merged[name] = _coerce(name, value, flag_for(name))
    return TrainSettings(**merged)
