"""The systemd units and env files `psctl deploy render` writes, filled from templates/.

A template's ``@key@`` placeholders (never systemd's own ``${VAR}`` or ``%i``) are filled
in one pass; a placeholder alone on its line stands for a block of lines (the hardening,
`psctl train`'s command line).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from importlib import resources

from psctl.coordinator.deploy.plan import (
    CONTROL_ADDRESS,
    CONTROL_TOKEN_FILE,
    COORDINATOR_METRICS_PORT,
    COORDINATOR_UNIT,
    PROXY_SERVICE,
    PROXY_SOCKET,
    REFERENCE_BIN_DIR,
    SERVER_ROLES,
    STATE_DIR,
    SYNC_UNIT,
    TARGET,
    TUNNEL_UNIT,
    ServerTask,
    unit_name,
)
from psctl.coordinator.deploy.tunnel import CONFIG_FILE as TUNNEL_CONF
from psctl.coordinator.deploy.tunnel import netns_name
from psctl.coordinator.failures import EXIT_USAGE, FINAL_EXIT_STATUSES
from psctl.coordinator.settings import DEFAULT_CONFIG_DIR, DEFAULTS

PLACEHOLDER = re.compile(r"@([a-z][a-z0-9_]*)@")
# The names every template may use.
_NAMES = {
    "target": TARGET,
    "coordinator_unit": COORDINATOR_UNIT,
    "state_dir": STATE_DIR,
    "control_token_file": CONTROL_TOKEN_FILE,
    "exit_usage": EXIT_USAGE,
    "tunnel_unit": TUNNEL_UNIT,
    "tunnel_conf": TUNNEL_CONF,
    # systemd restarts `psctl train` unless it ended with a final status.
    "final_statuses": " ".join(str(s) for s in FINAL_EXIT_STATUSES),
}
_PRIVATE_DEVICES = "PrivateDevices=yes"
# A ps writes its own shards of every checkpoint
# (coordinator/training/saving/sharded_save.py).
_PS_STATE = (
    "# Every ps saves its own shards of each checkpoint into the job's checkpoint directory\n"
    "# (@state_dir@/checkpoints by default: on several hosts, a file system they share).\n"
    "StateDirectory=psctl"
).replace("@state_dir@", STATE_DIR)
_WORKER_STATE = "# A worker writes no checkpoint: no StateDirectory=."
_WORKER_DEVICES = "# No PrivateDevices=: a worker may use GPUs (/dev/nvidia*), which it would hide."
EXAMPLE_HOST = "10.0.0.2"  # the address deploy/systemd/ is rendered for
PROXYD = "/usr/lib/systemd/systemd-socket-proxyd"  # Debian's systemd package
_OPEN_UNIT = (
    "# Rendered with --open-tf-ports: TensorFlow's ports listen on every interface of this\n"
    "# host, with no authentication (docs/security.md)."
)
_OPEN_SERVICE = "# No NetworkNamespacePath=: rendered with --open-tf-ports."


@functools.cache
def template(name: str) -> str:
    """templates/NAME as shipped in the package."""
    path = resources.files("psctl.coordinator.deploy") / "templates" / name
    return path.read_text(encoding="utf-8")


def fill(name: str, **values: object) -> str:
    """templates/NAME with every ``@key@`` replaced by ``values[key]``, in one pass (a value
    is never searched for placeholders); ValueError when one has no value."""
    text = template(name)
    missing = sorted({key for key in PLACEHOLDER.findall(text) if key not in values})
    if missing:
        raise ValueError(f"templates/{name}: no value for @{'@, @'.join(missing)}@")
    return PLACEHOLDER.sub(lambda m: str(values[m[1]]), text)


def fill_block(name: str, **values: object) -> str:
    """fill() without the last newline: the lines that stand for one ``@key@`` line."""
    return fill(name, **values).removesuffix("\n")


def _hardening(devices: str) -> str:
    return fill_block("hardening.in", devices=devices)


def _tunnel_blocks(netns: str | None) -> dict[str, str]:
    """The lines that put a unit in the job's namespace ``netns``, or say that it has none."""
    if netns is None:
        return {"in_tunnel": _OPEN_UNIT, "netns_path": _OPEN_SERVICE}
    return {
        "in_tunnel": fill_block("tunnel-unit.in", **_NAMES),
        "netns_path": fill_block("tunnel-service.in", netns=netns),
    }


def _server_unit(role: str, *, bin_dir: str, config_dir: str, netns: str | None) -> str:
    return fill(
        "server.service.in",
        **_NAMES,
        **_tunnel_blocks(netns),
        role=role,
        first_instance=unit_name(role).replace("@", "@0"),
        bin_dir=bin_dir,
        config_dir=config_dir,
        hardening=_hardening(_WORKER_DEVICES if role == "worker" else _PRIVATE_DEVICES),
        state=_WORKER_STATE if role == "worker" else _PS_STATE,
    )


# The units that run `psctl train`: their template, env file, the flags between
# `psctl train` and its ports, and the hardening's device line.
_TRAIN_UNITS = {
    COORDINATOR_UNIT: (
        "coordinator.service.in",
        "coordinator.env",
        "--cluster ${PSCTL_CLUSTER}",
        _PRIVATE_DEVICES,
    ),
    SYNC_UNIT: (
        "sync.service.in",
        "sync.env",
        "--strategy sync --cluster ${PSCTL_CLUSTER} --task-index %i",
        _WORKER_DEVICES,
    ),
}


def _train_unit(unit: str, *, bin_dir: str, config_dir: str, netns: str | None) -> str:
    """The coordinator's unit or a sync worker's: its template around the environment files
    and command line every `psctl train` unit shares (templates/train-exec.in)."""
    name, env_file, args, devices = _TRAIN_UNITS[unit]
    train = fill_block(
        "train-exec.in", bin_dir=bin_dir, config_dir=config_dir, env_file=env_file, args=args
    )
    return fill(
        name,
        **_NAMES,
        **_tunnel_blocks(netns),
        first_instance=unit.replace("@", "@0"),
        train_exec=train,
        hardening=_hardening(devices),
    )


def sync_unit(*, bin_dir: str, config_dir: str, netns: str | None) -> str:
    """``--strategy sync``: the training unit of one worker, its instance the index."""
    return _train_unit(SYNC_UNIT, bin_dir=bin_dir, config_dir=config_dir, netns=netns)


def target_unit() -> str:
    """psctl.target: what every psctl unit of a host is WantedBy= and PartOf=."""
    return fill("target.in", **_NAMES)


def tunnel_units(*, bin_dir: str, config_dir: str, netns: str) -> dict[str, str]:
    """The tunnel's unit and the side ports' proxy socket and service, by name."""
    return {
        TUNNEL_UNIT: fill(
            "tunnel.service.in", **_NAMES, netns=netns, bin_dir=bin_dir, config_dir=config_dir
        ),
        PROXY_SOCKET: fill("proxy.socket.in", **_NAMES),
        PROXY_SERVICE: fill(
            "proxy.service.in",
            **_NAMES,
            netns=netns,
            proxyd=PROXYD,
            hardening=_hardening(_PRIVATE_DEVICES),
        ),
    }


def unit_files(
    *, bin_dir: str, config_dir: str, netns: str | None, roles: Sequence[str] = SERVER_ROLES
) -> dict[str, str]:
    """The server templates for ``roles``, the coordinator unit and the target, by name;
    in the job's namespace ``netns`` (None: --open-tf-ports)."""
    files = {
        unit_name(r): _server_unit(r, bin_dir=bin_dir, config_dir=config_dir, netns=netns)
        for r in roles
    }
    files[COORDINATOR_UNIT] = _train_unit(
        COORDINATOR_UNIT, bin_dir=bin_dir, config_dir=config_dir, netns=netns
    )
    files[TARGET] = target_unit()
    return files


# ---------------------------------------------------------------- env files


def host_env(*, config_dir: str, tunnel: bool, host: str | None = None) -> str:
    """psctl.env: the cluster file and settings of every psctl unit on ``host`` (an example
    address in the reference rendering)."""
    host = host if host is not None else EXAMPLE_HOST
    tunnel_env = (
        f"# This host's address in the cluster file: its end of the tunnel.\n"
        f"PSCTL_TUNNEL_ADDRESS={host}"
        if tunnel
        else "# Rendered with --open-tf-ports: no tunnel."
    )
    return fill("host.env.in", config_dir=config_dir, bind=host, tunnel_env=tunnel_env)


def task_env(task: ServerTask) -> str:
    """<type>-<index>.env: one server's health and metrics ports."""
    return fill(
        "task.env.in",
        task=task.name,
        address=task.address,
        unit=task.unit,
        health_port=task.health_port,
        metrics_port=task.metrics_port,
    )


def _train_env(unit: str) -> str:
    return fill(
        "train.env.in",
        **_NAMES,
        unit=unit,
        job=DEFAULTS.job,
        steps=DEFAULTS.loop.steps,
        control_address=CONTROL_ADDRESS,
        default_config_dir=DEFAULT_CONFIG_DIR,
        coordinator_metrics_port=COORDINATOR_METRICS_PORT,
    )


def coordinator_env() -> str:
    """coordinator.env: the training settings of the coordinator unit."""
    return _train_env(COORDINATOR_UNIT)


def sync_env() -> str:
    """The training settings of a sync worker: the coordinator's, read by every worker
    (only worker 0 serves the control API and metrics and writes checkpoints)."""
    return _train_env(SYNC_UNIT)


def reference_files() -> dict[str, str]:
    """deploy/systemd/: the units and env files as rendered for /opt/psctl/venv."""
    netns = netns_name(EXAMPLE_HOST)
    files = unit_files(bin_dir=REFERENCE_BIN_DIR, config_dir=DEFAULT_CONFIG_DIR, netns=netns)
    files.update(
        tunnel_units(bin_dir=REFERENCE_BIN_DIR, config_dir=DEFAULT_CONFIG_DIR, netns=netns)
    )
    files["psctl.env"] = host_env(config_dir=DEFAULT_CONFIG_DIR, tunnel=True)
    files["coordinator.env"] = coordinator_env()
    files[SYNC_UNIT] = sync_unit(
        bin_dir=REFERENCE_BIN_DIR, config_dir=DEFAULT_CONFIG_DIR, netns=netns
    )
    files["sync.env"] = sync_env()
    return files
