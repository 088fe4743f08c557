"""Run settings for a training job: defaults < TOML job file < environment < flags."""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from psctl.cluster.errors import ConfigError, echo

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
    # The control API's credentials (flags of psctl local / train and the client commands).
    "PSCTL_CONTROL_TOKEN_FILE": "--control-token-file (coordinator/operations/security.py)",
    "PSCTL_CONTROL_READ_TOKEN_FILE": (
        "--control-read-token-file (coordinator/operations/security.py)"
    ),
    "PSCTL_CONTROL_TLS_CERT": "--control-tls-cert (coordinator/operations/security.py)",
    "PSCTL_CONTROL_TLS_KEY": "--control-tls-key (coordinator/operations/security.py)",
    "PSCTL_CONTROL_TLS_CA": "--control-tls-ca (coordinator/operations/security.py)",
    "PSCTL_INSECURE_CONTROL": "--insecure-control (coordinator/operations/security.py)",
    "PSCTL_OPEN_TF_PORTS": "psctl local --open-tf-ports (cluster/netns.py)",
    "PSCTL_JOB_NETNS": "set by psctl local: the job's network namespace (cluster/netns.py)",
    "PSCTL_TUNNEL_ADDRESS": "psctl.env: this host's end of the tunnel (deploy/tunnel.py)",
    "PSCTL_METRICS_TLS_CERT": "/metrics over HTTPS: its certificate (cluster/metrics.py)",
    "PSCTL_METRICS_TLS_KEY": "/metrics over HTTPS: the certificate's key (cluster/metrics.py)",
    "PSCTL_HEALTH_TLS_CERT": "a server's health over TLS: its certificate (cluster/health.py)",
    "PSCTL_HEALTH_TLS_KEY": "a server's health over TLS: the key (cluster/health.py)",
    "PSCTL_HEALTH_TLS_CA": "health clients: the CA of the servers' health certificates",
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
BAD_RECORDS = ("fail", "skip")  # --bad-records (coordinator/data/bad_records.py)
AUTO = "auto"  # --steps-per-execution auto, stored as 0
IN_FLIGHT_PER_WORKER = 4  # --max-in-flight 0: this many scheduled calls per worker
# The coordinator's own ports (`psctl train`, and the units `psctl deploy` writes).
DEFAULT_CONTROL_ADDRESS = "127.0.0.1:7070"
DEFAULT_CONFIG_DIR = "/etc/psctl"  # `psctl deploy`: env files and cluster.json on hosts
# The coordinator unit's state directory (StateDirectory=psctl; also its HOME, where its
# job tokens land): docs/deploy.md.
SERVICE_STATE_DIR = "/var/lib/psctl"
DEFAULT_METRICS_PORT = 9940

# Bounds. The Control API reports steps as protobuf int64 and steps per execution as int32
# (protos/psctl/control/v1/control.proto); Prometheus gauges and JSON readers hold numbers as
# float64, exact up to 2**53. A step count above that is years of training at any rate.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_STEP = 2**53
MAX_SECONDS = 7 * 24 * 3600.0  # a week: timers far beyond it overflow (threading.TIMEOUT_MAX)
# Whole-number settings: name -> (lowest, highest). Any other (the seed) takes the int64
# range, as protobuf and TensorFlow's seeds do.
_INT_RANGES: dict[str, tuple[int, int]] = {
    "steps": (1, MAX_STEP),
    "checkpoint_every": (1, MAX_STEP),
    "eval_every": (0, MAX_STEP),  # 0: no inline evaluation
    "epochs": (0, INT32_MAX),  # 0: train to --steps
    "batch_size": (1, INT32_MAX),
    "eval_batch_size": (1, INT32_MAX),
    "steps_per_execution": (0, INT32_MAX),  # 0: auto
    "local_steps": (1, INT32_MAX),
    "keep_checkpoints": (1, INT32_MAX),
    "max_shards": (1, INT32_MAX),
    "min_shard_bytes": (1, INT64_MAX),
    "max_in_flight": (0, INT32_MAX),  # 0: IN_FLIGHT_PER_WORKER per worker
    "max_restarts": (0, INT32_MAX),
    "full_check_mb": (0, INT32_MAX),
    "export_keep": (1, INT32_MAX),
}
# Finite float settings: name -> (above this, at most this).
_FLOAT_RANGES: dict[str, tuple[float, float]] = {
    "local_scale": (0.0, 1e6),
    "log_every": (0.0, MAX_SECONDS),
    "stall_timeout": (0.0, MAX_SECONDS),
    "connect_timeout": (0.0, MAX_SECONDS),
    "recovery_timeout": (0.0, MAX_SECONDS),
    "drop_after": (0.0, MAX_SECONDS),
    "settle_seconds": (0.0, MAX_SECONDS),
    "idle_timeout": (0.0, MAX_SECONDS),
    "export_every": (0.0, MAX_SECONDS),
}
# Float settings where 0 means off (not "above 0"), and durations: seconds, or a number
# with s, m or h ("30s", "5m") as a flag, PSCTL_* value or TOML string.
_ZERO_OFF = {"idle_timeout": "never", "export_every": "off"}
DURATIONS = ("settle_seconds", "idle_timeout", "export_every")
_DURATION_TEXT = re.compile(r"([0-9]+\.?[0-9]*|\.[0-9]+)\s*(s|m|h)")
_UNIT_SECONDS = {"s": 1.0, "m": 60.0, "h": 3600.0}
DEFAULT_FOLLOW_MARKER = "_SUCCESS"
# An integer or a decimal number as a flag or PSCTL_* value: ASCII only (int() and float()
# would also take other scripts' digits, "1_000", "inf" and surrounding Unicode spaces).
_INT_TEXT = re.compile(r"[+-]?[0-9]+")
_FLOAT_TEXT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_METRIC_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,79}")  # a Keras metric's name
_KEY = re.compile(r"[A-Za-z0-9_-]{1,80}")  # a TOML key shown as is in an error line
_BOOL_TEXT = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
# What 0 means where a whole-number setting may be 0.
_ZERO_MEANS = {
    "eval_every": "off",
    "epochs": "off, train to --steps",
    "steps_per_execution": "auto; or give auto",
    "max_in_flight": f"{IN_FLIGHT_PER_WORKER} per worker",
    "full_check_mb": "check only the first lines",
}


def flag_for(name: str) -> str:
    """The command-line flag of a setting: ``batch_size`` -> ``--batch-size``."""
    return f"--{name.replace('_', '-')}"


def setting_name(flag: str) -> str:
    """The setting of a command-line flag: ``--batch-size`` -> ``batch_size``."""
    return flag.removeprefix("--").replace("-", "_")


def flag_values(args: argparse.Namespace, flags: Iterable[str]) -> dict[str, Any]:
    """What ``flags`` hold in ``args``, by setting name (None where not given)."""
    return {setting_name(flag): getattr(args, setting_name(flag)) for flag in flags}


def settings_argv(values: Mapping[str, Any]) -> list[str]:
    """Settings as the flags that give them (``{"batch_size": 8}`` -> ``--batch-size 8``),
    the None ones left out: the one way psctl writes settings on a command line it starts."""
    argv: list[str] = []
    for name, value in values.items():
        if value is not None:
            argv += [flag_for(name), str(value).lower() if isinstance(value, bool) else str(value)]
    return argv


def parse_steps_per_execution(value: Any) -> int:
    """``auto`` (any case) is 0; anything else a whole number (checked by TrainSettings)."""
    if isinstance(value, str):
        text = value.strip(" \t")
        if text.lower() == AUTO:
            return 0
        if not _INT_TEXT.fullmatch(text):
            raise ValueError(value)
        return int(text)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(value)
    return value


def show_steps_per_execution(value: int) -> str:
    """How --steps-per-execution reads: ``auto`` for 0."""
    return str(value) if value else AUTO


@dataclass(frozen=True)
class LoopSettings:
    """How the training loop runs its steps (coordinator/training/loop.py)."""

    steps: int = 1500
    batch_size: int = 64  # per worker
    # steps per scheduled call; 0 = "auto" (coordinator/training/steps/packing.py)
    steps_per_execution: int = 0
    update_mode: str = "default"  # "default": the ps optimizer every step; "local": local steps
    local_steps: int = 50  # --update-mode local: steps per call between variable round trips
    local_scale: float = 1.0  # --update-mode local: factor on each call's pushed change
    max_in_flight: int = 0  # scheduled calls not yet finished; 0 = IN_FLIGHT_PER_WORKER
    stall_timeout: float = 60.0  # seconds without a finished step before the watchdog acts
    seed: int = 42


@dataclass(frozen=True)
class PlacementSettings:
    """How the model's variables are spread over the ps tasks."""

    max_shards: int = 1  # >1 partitions large variables over the ps tasks
    min_shard_bytes: int = 256 << 10


@dataclass(frozen=True)
class DataSettings:
    """What the job trains and evaluates on, and how it is read (coordinator/data/)."""

    train_data: str = ""  # file glob handed to the job's dataset_fn (DataContext.train_data)
    eval_data: str = ""
    label_column: str = "label"
    # Inputs (Criteo TSV) up to this many MB are checked in full before training; larger
    # ones in their first lines, the workers checking the rest as they read it (a full
    # check costs about 30 MB/s per core: 5 GB would wait minutes for the first step).
    full_check_mb: int = 256
    bad_records: str = "fail"  # a bad record the workers find: "fail" (exit 78) or "skip"
    epochs: int = 0  # >0: train this many passes over the data through the tf.data service
    # Follow mode (coordinator/data/follow.py): train each new complete file of
    # --train-data once, as it lands.
    follow: bool = False
    follow_marker: str = DEFAULT_FOLLOW_MARKER  # a partition is complete when this is in it
    settle_seconds: float = 60.0  # else: when its files have not changed for this long
    idle_timeout: float = 0.0  # end after this long with no new file; 0 = never


@dataclass(frozen=True)
class CheckpointSettings:
    """Where and how often the model is saved (coordinator/training/saving/)."""

    checkpoint_dir: str = ""  # "" = no checkpoints
    checkpoint_every: int = 500  # steps
    keep_checkpoints: int = 3


@dataclass(frozen=True)
class EvalSettings:
    """Evaluation: inline on the workers, and the final one (coordinator/training/evaluation/)."""

    eval_every: int = 0  # >0: distributed evaluation on the workers every N steps
    eval_batch_size: int = 1024


@dataclass(frozen=True)
class ReportSettings:
    """What the run tells while and after it trains (coordinator/training/reporting/)."""

    log_every: float = 5.0  # seconds between progress lines
    summary_json: str = ""
    logdir: str = ""  # TensorBoard scalar summaries; "" = none


@dataclass(frozen=True)
class SupervisionSettings:
    """The training process's supervision by its launcher (psctl train, psctl local)."""

    connect_timeout: float = 120.0  # seconds to wait for every server, then exit 69
    max_restarts: int = 10  # restarts of the training process within 10 minutes
    recovery_timeout: float = 300.0  # seconds to wait for failed ps tasks before a restart


@dataclass(frozen=True)
class ElasticSettings:
    """The cluster changing under the job (the parameter-server mode)."""

    # Seconds a worker may stay unreachable before the job resizes without it: longer than
    # a host's reboot or a unit's restarts, so that a worker that comes back keeps its
    # slot; short enough that a lost host does not.
    drop_after: float = 900.0


@dataclass(frozen=True)
class PublishSettings:
    """Serving versions written on a cadence while training (coordinator/training/saving/)."""

    export_every: float = 0.0  # seconds between serving versions; 0 = none
    export_dir: str = ""  # where they go: EXPORT_DIR/<global step>/
    export_keep: int = 5  # serving versions kept
    # A metric of the job's evaluation (loss, auc...): publish a version only when it is not
    # worse on the newest held-out files than the version in serving's ("" = always).
    export_if_better: str = ""


# TrainSettings' groups: its field name -> the settings it holds. Every setting is a field
# of one group, named as its flag, environment variable and TOML key are (flag_for,
# env_name): the names users write are flat, the code reads them by concern.
_GROUPS: dict[str, type] = {
    "loop": LoopSettings,
    "placement": PlacementSettings,
    "data": DataSettings,
    "checkpoints": CheckpointSettings,
    "evaluation": EvalSettings,
    "reporting": ReportSettings,
    "supervision": SupervisionSettings,
    "elastic": ElasticSettings,
    "publishing": PublishSettings,
}
_TOP = ("job", "strategy")  # the settings that belong to no group: the run as a whole
GROUP_OF = {f.name: group for group, kind in _GROUPS.items() for f in fields(kind)}


@dataclass(frozen=True)
class TrainSettings:
    """What a training run needs besides the cluster and the job code, grouped by concern.

    Built from flat setting names (``TrainSettings.of(steps=100, checkpoint_dir="c")``,
    or ``resolve_settings`` from flags, environment and TOML); read by concern
    (``settings.loop.steps``, ``settings.checkpoints.checkpoint_dir``).
    """

    job: str = "mlp"
    strategy: str = "async"  # "async": parameter servers; "sync": all-reduce over the workers
    loop: LoopSettings = field(default_factory=LoopSettings)
    placement: PlacementSettings = field(default_factory=PlacementSettings)
    data: DataSettings = field(default_factory=DataSettings)
    checkpoints: CheckpointSettings = field(default_factory=CheckpointSettings)
    evaluation: EvalSettings = field(default_factory=EvalSettings)
    reporting: ReportSettings = field(default_factory=ReportSettings)
    supervision: SupervisionSettings = field(default_factory=SupervisionSettings)
    elastic: ElasticSettings = field(default_factory=ElasticSettings)
    publishing: PublishSettings = field(default_factory=PublishSettings)

    def __post_init__(self) -> None:
        check_values(self.values(), flag_for)

    @classmethod
    def of(cls, **values: Any) -> TrainSettings:
        """Settings from flat setting names (``steps``, ``checkpoint_dir``...); the rest
        take their defaults. An unknown name is a TypeError, as a dataclass's would be."""
        unknown = sorted(set(values) - set(_TOP) - set(GROUP_OF))
        if unknown:
            raise TypeError(f"TrainSettings has no setting {', '.join(unknown)}")
        groups = {
            group: kind(**{f.name: values[f.name] for f in fields(kind) if f.name in values})
            for group, kind in _GROUPS.items()
        }
        return cls(**{name: values[name] for name in _TOP if name in values}, **groups)

    def values(self) -> dict[str, Any]:
        """Every setting by its flat name: what ``of`` takes back."""
        out = {name: getattr(self, name) for name in _TOP}
        for group in _GROUPS:
            out.update(asdict(getattr(self, group)))
        return out

    def argv(self, *names: str) -> list[str]:
        """These settings as flags for a psctl process this one starts (``--job ctr
        --seed 42``); a string setting left empty (unset) is left out."""
        values = self.values()
        return settings_argv({name: values[name] for name in names if values[name] != ""})

    def replace(self, **values: Any) -> TrainSettings:
        """These settings with ``values`` (flat names) changed."""
        return TrainSettings.of(**{**self.values(), **values})

    @property
    def length(self) -> str:
        """How long the run trains, in words: ``1500 steps``, ``2 epoch(s)``, ``following
        GLOB``."""
        if self.data.follow:
            return f"following {self.data.train_data}"
        return f"{self.data.epochs} epoch(s)" if self.data.epochs else f"{self.loop.steps} steps"

    @property
    def exactly_once_flag(self) -> str:
        """The flag that trains the input exactly once (--follow, --epochs), or ""."""
        return "--follow" if self.data.follow else "--epochs" if self.data.epochs else ""

    @property
    def data_service(self) -> bool:
        """Whether the tf.data service hands out the input (--epochs, --follow): the data,
        not --steps, decides when training ends."""
        return self.data.epochs > 0 or self.data.follow


def _range_fix(name: str, low: int, high: int) -> str:
    zero = f" (0: {_ZERO_MEANS[name]})" if low == 0 and name in _ZERO_MEANS else ""
    return f"give a whole number from {low:,} to {high:,}{zero}"


def _int_range(name: str) -> tuple[int, int]:
    return _INT_RANGES.get(name, (-INT64_MAX - 1, INT64_MAX))


def check_values(values: Mapping[str, Any], where: Callable[[str], str]) -> None:
    """Raise ConfigError for the first bad setting in ``values`` (every field, by name);
    ``where(name)`` names where it came from: ``--steps``, ``PSCTL_STEPS``, ``job.toml:
    train.steps``."""
    for name, value in values.items():
        kind = SETTING_TYPES.get(name)
        if kind == "int":
            low, high = _int_range(name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(
                    where(name), f"{echo(value)} is not a whole number", _range_fix(name, low, high)
                )
            if not low <= value <= high:
                raise ConfigError(where(name), f"got {echo(value)}", _range_fix(name, low, high))
        elif kind == "float":
            above, most = _FLOAT_RANGES.get(name, (-math.inf, math.inf))
            fix = f"give a number above {above:g} and at most {most:g}"
            if name in _ZERO_OFF:
                fix = f"give 0 ({_ZERO_OFF[name]}) or a number of seconds up to {most:g}"
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(where(name), f"{echo(value)} is not a number", fix)
            if name in _ZERO_OFF and value == 0:
                continue
            if not math.isfinite(value) or not above < value <= most:
                raise ConfigError(where(name), f"got {echo(value)}", fix)
        elif kind == "str":
            if not isinstance(value, str):
                raise ConfigError(where(name), f"{echo(value)} is not a string", "give a string")
            if "\0" in value:
                raise ConfigError(where(name), f"{echo(value)} holds a NUL character", "remove it")
        elif kind == "bool" and not isinstance(value, bool):
            raise ConfigError(where(name), f"{echo(value)} is not true or false", "give true/false")
    for name, choices in (
        ("strategy", STRATEGIES),
        ("update_mode", UPDATE_MODES),
        ("bad_records", BAD_RECORDS),
    ):
        if name in values and values[name] not in choices:
            raise ConfigError(
                where(name), f"got {echo(values[name])}", f"use one of {', '.join(choices)}"
            )
    if values.get("update_mode") == "local" and values.get("epochs"):
        raise ConfigError(
            where("update_mode"),
            f"local with {where('epochs')}",
            "use update mode default with epochs",
        )
    check_follow(values, where)
    if values.get("strategy") == "sync":
        # Sync mode all-reduces over the workers: nothing lives on ps tasks, and every
        # worker must run the same steps (docs/sync.md).
        for name, off, fix in (
            ("update_mode", "default", "use update mode default with strategy sync"),
            ("max_shards", 1, "drop it: sync mode keeps a whole copy of the model per worker"),
        ):
            if values.get(name, off) != off:
                raise ConfigError(where(name), f"{echo(values[name])} with strategy sync", fix)


def check_follow(values: Mapping[str, Any], where: Callable[[str], str]) -> None:
    """Follow mode's and publishing's settings, each refused in one line."""
    marker = values.get("follow_marker", DEFAULT_FOLLOW_MARKER)
    if isinstance(marker, str) and ("/" in marker or "\\" in marker or marker in ("", ".", "..")):
        raise ConfigError(
            where("follow_marker"),
            f"{echo(marker)} is not a file name",
            f"give the marker's name alone, e.g. {DEFAULT_FOLLOW_MARKER}",
        )
    if values.get("export_every") and not values.get("export_dir"):
        raise ConfigError(
            where("export_every"), "has no --export-dir", "give --export-dir BASE as well"
        )
    if values.get("export_dir") and not values.get("export_every"):
        raise ConfigError(
            where("export_dir"),
            "has no --export-every",
            "give --export-every DURATION (e.g. 10m), or psctl export for one version",
        )
    gate = values.get("export_if_better")
    if gate and not values.get("export_every"):
        raise ConfigError(
            where("export_if_better"),
            "has no --export-every",
            "give --export-every DURATION and --export-dir BASE as well",
        )
    if gate and not values.get("eval_data"):
        raise ConfigError(
            where("export_if_better"),
            "has no --eval-data: the held-out files both versions are scored on",
            "give --eval-data GLOB (its newest partition is the one scored)",
        )
    if isinstance(gate, str) and gate and not _METRIC_NAME.fullmatch(gate):
        raise ConfigError(
            where("export_if_better"),
            f"{echo(gate)} is not a metric name",
            "give the name of one of the job's evaluation metrics, e.g. loss or auc",
        )
    if values.get("export_every") and values.get("strategy") == "sync":
        raise ConfigError(
            where("export_every"),
            "with strategy sync",
            "use strategy async, or psctl export on the sync job's checkpoints",
        )
    if not values.get("follow"):
        return
    for name, fix in (
        ("epochs", "drop it: follow mode trains each new file once, as it lands"),
        ("strategy", "use strategy async (the parameter-server mode) with --follow"),
    ):
        if values.get(name) not in (0, "async", None):
            raise ConfigError(where(name), f"{echo(values[name])} with --follow", fix)
    if not values.get("train_data"):
        raise ConfigError(
            where("follow"), "has no --train-data", "give the files to follow, e.g. 'DIR/*/part-*'"
        )
    if not values.get("checkpoint_dir"):
        raise ConfigError(
            where("follow"),
            "has no --checkpoint-dir: which files were trained is kept in the checkpoints",
            "give --checkpoint-dir DIR",
        )


def parse_duration(text: str, where: str) -> float:
    """Seconds from ``90``, ``2.5``, ``30s``, ``5m`` or ``1h``."""
    number = text.strip(" \t")
    if _FLOAT_TEXT.fullmatch(number):
        return float(number)
    match = _DURATION_TEXT.fullmatch(number)
    if match is None:
        raise ConfigError(
            where, f"{echo(text)} is not a duration", "give seconds, or e.g. 30s, 10m, 1h"
        )
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


# Every setting's type, by name: ``{"steps": "int", ...}``.
SETTING_TYPES: dict[str, str] = {
    **{f.name: str(f.type) for f in fields(TrainSettings) if f.name in _TOP},
    **{f.name: str(f.type) for kind in _GROUPS.values() for f in fields(kind)},
}
DEFAULTS = TrainSettings()
_DEFAULT_VALUES = DEFAULTS.values()


def default_help(name: str, show: Callable[[Any], str] = str) -> str:
    """``(default 1500)``: a setting's default as help text shows it, from TrainSettings."""
    return f"(default {show(_DEFAULT_VALUES[name])})"


def _toml(value: Any) -> str:
    """A value as TOML writes it, for error lines (``false``, not ``False``)."""
    return str(value).lower() if isinstance(value, bool) else echo(value)


def _kind_of(value: Any) -> str:
    """A TOML value's kind, with its article."""
    kinds = {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}
    kinds.update({list: "an array", dict: "a table"})
    return kinds.get(type(value), f"a {type(value).__name__}")


def _int_text(name: str, text: str, where: str) -> int:
    low, high = _int_range(name)
    digits = text.strip(" \t")
    if not _INT_TEXT.fullmatch(digits):
        raise ConfigError(where, f"{echo(text)} is not a whole number", _range_fix(name, low, high))
    if len(digits.lstrip("+-0")) > 30:  # int() refuses thousands of digits; this is enough
        raise ConfigError(where, f"{echo(text)} is out of range", _range_fix(name, low, high))
    return int(digits)


def _float_text(text: str, where: str) -> float:
    number = text.strip(" \t")
    if not _FLOAT_TEXT.fullmatch(number):
        raise ConfigError(where, f"{echo(text)} is not a number", "give a decimal number, e.g. 2.5")
    return float(number)


def _coerce(name: str, value: Any, where: str, *, text: bool) -> Any:
    """``value`` as setting ``name`` holds it. ``text``: a string may spell a number or a
    boolean (flags, PSCTL_*); otherwise (TOML) the value must have the setting's own type:
    a TOML float for a whole number, or a boolean for a path, is an error, not converted."""
    kind = SETTING_TYPES[name]
    is_text = isinstance(value, str)
    if name == "steps_per_execution" and is_text and value.strip(" \t").lower() == AUTO:
        return 0
    if kind == "int":
        if is_text and text:
            return _int_text(name, value, where)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(
                where,
                f"{_toml(value)} is {_kind_of(value)}, not a whole number",
                _range_fix(name, *_int_range(name)),
            )
        return value
    if kind == "float":
        if is_text and name in DURATIONS:  # also a TOML string: export_every = "10m"
            return parse_duration(value, where)
        if is_text and text:
            return _float_text(value, where)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(
                where, f"{_toml(value)} is {_kind_of(value)}, not a number", "give a number"
            )
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(where, f"{echo(value)} is out of range", "give a number") from None
    if kind == "bool":
        if is_text and text and value.strip().lower() in _BOOL_TEXT:
            return _BOOL_TEXT[value.strip().lower()]
        if not isinstance(value, bool):
            raise ConfigError(
                where, f"{_toml(value)} is {_kind_of(value)}, not a boolean", "give true or false"
            )
        return value
    if kind == "str" and not is_text:
        raise ConfigError(
            where,
            f"{_toml(value)} is {_kind_of(value)}, not a string",
            'give a string (in TOML, in quotes: key = "value")',
        )
    return value


def _read_toml(path: str) -> dict[str, Any]:
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            "--config", f"no file at {path}", "give an existing TOML job file"
        ) from None
    except IsADirectoryError:
        raise ConfigError(
            "--config", f"{path} is a directory", "give the TOML job file's path"
        ) from None
    except OSError as err:
        raise ConfigError(
            "--config", f"cannot read {path}: {err.strerror or err}", "check the path"
        ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            "--config",
            f"{path} is not UTF-8 text ({err.reason} at byte {err.start})",
            "save the job file as UTF-8 TOML",
        ) from None
    if text.startswith("\ufeff"):
        raise ConfigError(
            "--config",
            f"{path} starts with a byte order mark (BOM), which TOML does not allow",
            "save it as UTF-8 without BOM",
        )
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"--config {path}", f"invalid TOML: {err}", "fix the syntax") from None
    except (ValueError, RecursionError):  # an integer of thousands of digits; deep nesting
        raise ConfigError(
            f"--config {path}",
            "a number is too long or a value nested too deeply",
            "write plain settings: key = value",
        ) from None


def _load_toml(path: str) -> dict[str, tuple[Any, str]]:
    """The [train] table (or the whole file): setting name -> (value, where it is written)."""
    data = _read_toml(path)
    table = data.get("train", data)
    prefix = "train." if "train" in data else ""
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: train", "is not a table", "write [train] with key = value")
    outside = [key for key in data if key != "train"] if prefix else []
    if outside:  # read by nothing: a setting written above [train] was silently dropped
        key = outside[0]
        raise ConfigError(
            f"{path}: {key if _KEY.fullmatch(key) else echo(key)}",
            "is outside the [train] table, and only [train] is read",
            "move it under [train], or drop the [train] line (a file with no table is read whole)",
        )
    out = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in SETTING_TYPES:
            close = difflib.get_close_matches(name, SETTING_TYPES, n=1)
            raise ConfigError(
                f"{path}: {prefix}{key if _KEY.fullmatch(key) else echo(key)}",
                "is not a setting",
                f"did you mean {close[0]}?"
                if close
                else f"use one of {', '.join(sorted(SETTING_TYPES))}",
            )
        where = f"{path}: {prefix}{key}"
        out[name] = (_coerce(name, value, where, text=False), where)
    return out


def load_toml(path: str) -> dict[str, Any]:
    """The settings a TOML job file holds, each of its setting's type (ConfigError if not)."""
    return {name: value for name, (value, _) in _load_toml(path).items()}


def env_name(name: str) -> str:
    """The environment variable of a setting: ``batch_size`` -> ``PSCTL_BATCH_SIZE``."""
    return ENV_PREFIX + name.upper()


def env_switch(environ: Mapping[str, str], name: str) -> bool:
    """A PSCTL_* on/off variable (``PSCTL_INSECURE_CONTROL``, ``PSCTL_OPEN_TF_PORTS``): on
    for 1, true or yes, off for 0, false, no or unset (any case); anything else is one
    line, exit 78, rather than read as off."""
    value = environ.get(name, "").strip().lower()
    if value not in ("", "0", "1", "true", "false", "yes", "no"):
        raise ConfigError(
            name,
            f"got {value[:40]!r}",
            "set it to 1 (or true, yes) to allow, or 0 (false, no), or unset it",
        )
    return value in ("1", "true", "yes")


def check_environ(environ: Mapping[str, str]) -> None:
    """Raise ConfigError for the first PSCTL_* variable psctl does not read.

    The one-line error names the closest valid variable: a misspelt setting would otherwise
    be ignored, and the run would quietly use its default.
    """
    known = {env_name(name) for name in SETTING_TYPES} | set(OTHER_ENV)
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
    source: dict[str, str] = {}
    if config_file:
        for name, (value, where) in _load_toml(config_file).items():
            merged[name], source[name] = value, where
    for name in SETTING_TYPES:
        key = env_name(name)
        if env.get(key):
            merged[name], source[name] = _coerce(name, env[key], key, text=True), key
    for name, value in flags.items():
        if value is not None and name in SETTING_TYPES:
            where = flag_for(name)
            merged[name], source[name] = _coerce(name, value, where, text=True), where
    if merged.get("follow") and "steps" in merged:
        raise ConfigError(
            source["steps"],
            "with --follow",
            "drop it: follow mode trains each new file once until --idle-timeout or a stop",
        )
    if merged.get("epochs") and "steps" in merged:
        raise ConfigError(
            source["steps"],
            f"with {source['epochs']}",
            "drop one: --epochs N trains N passes over the data instead of a number of steps",
        )
    # Checked here, to name where each value came from; TrainSettings checks them again.
    check_values({**_DEFAULT_VALUES, **merged}, lambda name: source.get(name, flag_for(name)))
    return TrainSettings.of(**merged)
