"""`psctl deploy`: systemd units and per-host files from one cluster file, and a check that
every host answers. No TensorFlow here.

`render` writes one directory per host (env files, units, a README with the commands to run
and the ports to open); `check` tries every server's TF port and health service from here
(their flags: coordinator/cli/deploy.py).
The unit templates live here, once; deploy/systemd/ holds them rendered for /opt/psctl/venv
(`python -m psctl.coordinator.launch.deploy` rewrites it, and a test fails when it is stale).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from psctl.cluster.errors import EXIT_UNAVAILABLE, ConfigError, echo
from psctl.cluster.ports import HEALTH_PORT_OFFSET, METRICS_PORT_OFFSET, side_port
from psctl.cluster.spec import (
    SYNC_REQUIRED,
    Address,
    ClusterConfig,
    canonical_host,
    load_cluster_file,
    require_chief,
)
from psctl.coordinator.failures import EXIT_USAGE, FINAL_EXIT_STATUSES
from psctl.coordinator.settings import (
    DEFAULT_CONFIG_DIR,
    DEFAULT_CONTROL_ADDRESS,
    DEFAULT_METRICS_PORT,
    DEFAULTS,
)

REFERENCE_BIN_DIR = "/opt/psctl/venv/bin"
UNIT_DIR = "/etc/systemd/system"
STATE_DIR = "/var/lib/psctl"  # StateDirectory=psctl
SERVER_ROLES = ("ps", "worker")
# The coordinator's own ports: `psctl train`'s defaults.
COORDINATOR_METRICS_PORT = DEFAULT_METRICS_PORT
CONTROL_ADDRESS = DEFAULT_CONTROL_ADDRESS
_CONTROL_PORT = Address.parse(CONTROL_ADDRESS, field="control address").port
TARGET = "psctl.target"
COORDINATOR_UNIT = "psctl-coordinator.service"
# Where a unit's paths may not reach under DynamicUser= and ProtectHome=.
_HIDDEN_PREFIXES = ("/home/", "/root/", "/run/user/")


def unit_name(role: str) -> str:
    """The template unit of a server role: ``psctl-ps@.service``."""
    return f"psctl-{role}@.service"


@dataclass(frozen=True)
class ServerTask:
    """One ps or worker task and the ports its server listens on."""

    task_type: str
    index: int
    address: Address
    health_port: int
    metrics_port: int

    @property
    def host(self) -> str:
        return self.address.host

    @property
    def tf_port(self) -> int:
        return self.address.port

    @property
    def name(self) -> str:
        return f"{self.task_type}:{self.index}"

    @property
    def unit(self) -> str:
        return f"psctl-{self.task_type}@{self.index}.service"

    @property
    def env_file(self) -> str:
        return f"{self.task_type}-{self.index}.env"


@dataclass(frozen=True)
class HostPlan:
    """What runs on one host: its servers, and the coordinator if the chief lives here."""

    host: str
    servers: tuple[ServerTask, ...]
    chief_port: int | None = None

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(r for r in SERVER_ROLES if any(s.task_type == r for s in self.servers))

    @property
    def task_names(self) -> str:
        names = [s.name for s in self.servers]
        if self.chief_port is not None:
            names.insert(0, "chief (coordinator)")
        return ", ".join(names)


def plan_hosts(
    cluster: ClusterConfig, health_addresses: Mapping[tuple[str, int], Address] | None = None
) -> list[HostPlan]:
    """Group the cluster's tasks by host, with every port each server will use.

    Health ports are TF port + 1000 unless ``health_addresses`` (the cluster file's optional
    "health" section) names one; metrics ports are TF port + 2000. Two tasks on one host
    that would share a port are a ConfigError.
    """
    explicit = health_addresses or {}
    # By host as spelt first; two spellings of one host (Host1 and host1, ::1 and ::0001)
    # are one host, and one directory.
    hosts: dict[str, list[ServerTask]] = {}
    names: dict[str, str] = {}
    chief = cluster.task_address("chief", 0) if cluster.chief is not None else None
    if chief is not None:
        names[canonical_host(chief.host)] = chief.host
        hosts[canonical_host(chief.host)] = []
    for task_type, index, address in cluster.task_addresses():
        if task_type not in SERVER_ROLES:
            continue
        field = f"cluster.{task_type}[{index}]"
        if (task_type, index) in explicit:
            health_port = explicit[(task_type, index)].port
        else:
            health_port = side_port(address.port, HEALTH_PORT_OFFSET, field=f"{field} health port")
        metrics_port = side_port(address.port, METRICS_PORT_OFFSET, field=f"{field} metrics port")
        task = ServerTask(task_type, index, address, health_port, metrics_port)
        names.setdefault(canonical_host(address.host), address.host)
        hosts.setdefault(canonical_host(address.host), []).append(task)
    chief_key = canonical_host(chief.host) if chief is not None else None
    plans = [
        HostPlan(names[key], tuple(tasks), chief.port if chief and key == chief_key else None)
        for key, tasks in hosts.items()
    ]
    for plan in plans:
        _check_host_ports(plan)
    return plans


def _check_host_ports(plan: HostPlan) -> None:
    used: dict[int, str] = {}
    claims: list[tuple[int, str]] = []
    if plan.chief_port is not None:
        claims += [
            (plan.chief_port, "chief TF port"),
            (COORDINATOR_METRICS_PORT, "coordinator metrics port"),
            (_CONTROL_PORT, "coordinator control port"),
        ]
    for s in plan.servers:
        claims += [
            (s.tf_port, f"{s.name} TF port"),
            (s.health_port, f"{s.name} health port"),
            (s.metrics_port, f"{s.name} metrics port"),
        ]
    for port, what in claims:
        if port in used:
            raise ConfigError(
                f"cluster: host {plan.host}",
                f"{what} {port} is also the {used[port]}",
                f"space TF ports on one host apart from the side ports (TF port + "
                f"{HEALTH_PORT_OFFSET} and + {METRICS_PORT_OFFSET}) and from "
                f"{COORDINATOR_METRICS_PORT} and {_CONTROL_PORT}",
            )
        used[port] = what


# ---------------------------------------------------------------- unit files

_HARDENING = """\
# Hardening TensorFlow tolerates. A transient user per service: install psctl where any
# user can read it (e.g. python3 -m venv /opt/psctl/venv), not under /home or /root.
DynamicUser=yes
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
{private_devices}ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
# gRPC lists the host's interfaces over netlink.
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
CapabilityBoundingSet=
SystemCallArchitectures=native
# The system calls of an ordinary service, less the privileged and resource-control ones
# (tried with TensorFlow serving and training: docs/deploy.md); any other fails with EPERM.
SystemCallFilter=@system-service
SystemCallFilter=~@privileged @resources
SystemCallErrorNumber=EPERM
ProtectProc=invisible
PrivateMounts=yes
UMask=0077
# Not MemoryDenyWriteExecute=yes: TensorFlow's XLA CPU backend (jit_compile, and TF's own
# XLA paths) writes the machine code LLVM generates into memory it then makes executable.
# Under that ban TensorFlow 2.21 logs "LLVM compilation error: Permission denied" and dies
# with SIGSEGV (measured with the kernel's equivalent, prctl(PR_SET_MDWE)).
MemoryDenyWriteExecute=false
"""

_PRIVATE_DEVICES = "PrivateDevices=yes\n"
_WORKER_DEVICES = (
    "# No PrivateDevices=: a worker may use GPUs (/dev/nvidia*), which it would hide.\n"
)


def _unit(
    *, head: str, description: str, order: str, start_limit: str, service: str, devices: str
) -> str:
    """A psctl unit: its ``head`` comment, then what every psctl unit has around its own
    ordering, start limit and [Service] lines (``devices``: the hardening's device line)."""
    return f"""\
{head}[Unit]
Description={description}
After=network-online.target
Wants=network-online.target
{order}PartOf={TARGET}
{start_limit}StartLimitBurst=10

[Service]
{service}LimitNOFILE=65536

{_HARDENING.format(private_devices=devices)}
[Install]
WantedBy={TARGET}
"""


def _server_unit(role: str, *, bin_dir: str, config_dir: str) -> str:
    script = f"{role}-server"
    head = f"""\
# psctl {role} server: one TensorFlow {role} task. The instance (%i) is the task's index in
# the cluster file: `systemctl enable --now {unit_name(role).replace("@", "@0")}` runs
# cluster.{role}[0]. Written by `psctl deploy render`; see docs/deploy.md.
"""
    start_limit = """\
# At most 10 starts in 5 minutes; then `systemctl reset-failed` before trying again.
StartLimitIntervalSec=300
"""
    service = f"""\
# READY=1 comes once the TF server, the health service and /metrics all listen.
Type=notify
NotifyAccess=main
# The cluster file (PSCTL_CLUSTER) and host settings, then this task's ports.
EnvironmentFile={config_dir}/psctl.env
EnvironmentFile=-{config_dir}/{role}-%i.env
ExecStart={bin_dir}/{script} --cluster ${{PSCTL_CLUSTER}} --index %i
Restart=on-failure
RestartSec=2
# 78: a configuration error (cluster file, index, ports), 2: a bad command line (an
# instance that is not a number); restarting cannot fix either.
RestartPreventExitStatus={EXIT_USAGE} 78
# Importing TensorFlow takes seconds, more on a busy host.
TimeoutStartSec=180
# On SIGTERM health turns NOT_SERVING and the server exits 0 after --shutdown-grace (1 s).
TimeoutStopSec=20
# The server pings systemd every 15 s once READY: a frozen one (SIGSTOP, a stalled host)
# is killed and restarted, so that its peers' calls fail over instead of waiting on it.
WatchdogSec=30
SyslogIdentifier=psctl-{role}-%i
# A dynamic user has no home: Keras and matplotlib, imported with TensorFlow, keep their
# caches in the service's private /tmp.
Environment=HOME=/tmp
"""
    order = f"""\
# Started before and stopped after the coordinator on this host, so that `systemctl stop
# {TARGET}` lets it write its final checkpoint while every local server still serves.
Before={COORDINATOR_UNIT}
"""
    return _unit(
        head=head,
        description=f"psctl {role} server (task %i)",
        order=order,
        start_limit=start_limit,
        service=service,
        devices=_WORKER_DEVICES if role == "worker" else _PRIVATE_DEVICES,
    )


def _train_exec(*, bin_dir: str, config_dir: str, env_file: str, args: str) -> str:
    """The environment files and command line of a unit that runs `psctl train` (the
    coordinator's, a sync worker's): ``args`` go between ``psctl train`` and its ports."""
    return f"""\
Type=exec
EnvironmentFile={config_dir}/psctl.env
# Training settings (PSCTL_JOB, PSCTL_STEPS, PSCTL_CHECKPOINT_DIR, ...) and ports.
EnvironmentFile={config_dir}/{env_file}
ExecStart={bin_dir}/psctl train {args} \\
    --control-address ${{PSCTL_CONTROL_ADDRESS}} \\
    --metrics-port ${{PSCTL_COORDINATOR_METRICS_PORT}}"""


# systemd restarts `psctl train` unless it ended with a final status.
_TRAIN_RESTART = f"""\
Restart=on-failure
RestartSec=5
RestartPreventExitStatus={" ".join(str(s) for s in FINAL_EXIT_STATUSES)}"""


def _coordinator_unit(*, bin_dir: str, config_dir: str) -> str:
    head = f"""\
# psctl coordinator: `psctl train`, the TensorFlow chief task that drives the job.
# Started by hand once the servers are up (`systemctl start {COORDINATOR_UNIT}`);
# enable it only to start training at boot. Written by `psctl deploy render`.
"""
    train = _train_exec(
        bin_dir=bin_dir,
        config_dir=config_dir,
        env_file="coordinator.env",
        args="--cluster ${PSCTL_CLUSTER}",
    )
    service = f"""\
# psctl train waits for every server's TF port itself (exit 69 after --connect-timeout).
{train}
# psctl train restarts its own training process (a lost ps, a crash) within its budget,
# so every status it ends with is final: 0 done or stopped, 1 the job's code failed, 2 a bad
# command line, 69 servers unreachable for --connect-timeout, 70 its restart budget used
# up, 78 a configuration error, 130 aborted. systemd restarts it only when psctl train
# itself is killed (SIGKILL, a crash); the new one restores the latest checkpoint.
{_TRAIN_RESTART}
# SIGTERM is a graceful stop: in-flight steps finish, then a checkpoint and the evaluation.
# psctl train supervises a training process and forwards the signal to it: SIGTERM only
# the main process, as a second SIGTERM would abort the training process unsaved.
KillMode=mixed
TimeoutStopSec=300
# Checkpoints and the summary: {STATE_DIR}, writable under ProtectSystem=strict. A
# checkpoint directory elsewhere needs ReadWritePaths= (and the dynamic user's access).
StateDirectory=psctl
SyslogIdentifier=psctl-coordinator
# A dynamic user has no home: Keras and matplotlib keep their caches in the state directory.
Environment=HOME={STATE_DIR}
# The job's control tokens (0600) land in $HOME: {CONTROL_TOKEN_FILE} and .read.token
# beside it; on this host: sudo psctl status --control-token-file {CONTROL_TOKEN_FILE}
"""
    order = f"""\
# Starting it starts this host's servers too (their units order them Before= this one).
Wants={TARGET}
"""
    return _unit(
        head=head,
        description="psctl coordinator (psctl train, task chief)",
        order=order,
        start_limit="StartLimitIntervalSec=600\n",
        service=service,
        devices=_PRIVATE_DEVICES,
    )


_TARGET_UNIT = f"""\
# psctl on this host: every enabled psctl-ps@N / psctl-worker@N (and the coordinator, if
# enabled) is WantedBy= this target and PartOf= it, so `systemctl stop {TARGET}` and
# `systemctl restart {TARGET}` reach them all. Written by `psctl deploy render`.
[Unit]
Description=psctl servers on this host
After=network-online.target
Wants=network-online.target

[Install]
WantedBy=multi-user.target
"""


def unit_files(
    *, bin_dir: str, config_dir: str, roles: Sequence[str] = SERVER_ROLES
) -> dict[str, str]:
    """The server templates for ``roles``, the coordinator unit and the target, by name."""
    files = {unit_name(r): _server_unit(r, bin_dir=bin_dir, config_dir=config_dir) for r in roles}
    files[COORDINATOR_UNIT] = _coordinator_unit(bin_dir=bin_dir, config_dir=config_dir)
    files[TARGET] = _TARGET_UNIT
    return files


# ---------------------------------------------------------------- env files


def host_env(*, config_dir: str, host: str | None = None) -> str:
    bind = host if host is not None else "10.0.0.2"
    return f"""\
# psctl settings for every psctl unit on this host (EnvironmentFile={config_dir}/psctl.env).
# systemd syntax: KEY=VALUE, no shell expansion. Written by `psctl deploy render`.

# The cluster file (TF_CONFIG's JSON), the same on every host.
PSCTL_CLUSTER={config_dir}/cluster.json
# Every task of a parameter-server cluster must report errors to its caller, not retry.
GRPC_FAIL_FAST=use_caller
# TensorFlow's C++ INFO and WARNING lines stay out of the journal (0 shows them).
TF_CPP_MIN_LOG_LEVEL=2
PYTHONUNBUFFERED=1
# Where the health and metrics ports listen (default: this host's address in the cluster
# file; 0.0.0.0 for every interface). TensorFlow's own port always listens on every
# interface: keep the cluster on a private network (docs/security.md).
#PSCTL_BIND_HOST={bind}
"""


def task_env(task: ServerTask) -> str:
    return f"""\
# {task.name} ({task.address}): its side ports. Read by {task.unit}
# after psctl.env. `psctl health` and `psctl deploy check` look for the health port
# here: to move it, change the cluster file's "health" section and render again.
PSCTL_HEALTH_PORT={task.health_port}
PSCTL_METRICS_PORT={task.metrics_port}
"""


# Where the coordinator unit's job token lands: its HOME is the state directory.
CONTROL_TOKEN_FILE = f"{STATE_DIR}/.local/state/psctl/127.0.0.1_{_CONTROL_PORT}.token"


def coordinator_env() -> str:
    return f"""\
# psctl train settings (EnvironmentFile of {COORDINATOR_UNIT}). Any training flag works as
# PSCTL_<FLAG> (e.g. PSCTL_BATCH_SIZE=128); a job file via PSCTL_CONFIG is not read: put
# its [train] values here instead. Written by `psctl deploy render`.
PSCTL_JOB={DEFAULTS.job}
PSCTL_STEPS={DEFAULTS.steps}
PSCTL_CHECKPOINT_DIR={STATE_DIR}/checkpoints
PSCTL_SUMMARY_JSON={STATE_DIR}/summary.json
# psctl's control API (psctl status/stop/...). Every call needs the job's token: on
# loopback psctl train writes a new one per job, for root to read, to
# {CONTROL_TOKEN_FILE}
# Another address needs TLS and a token file of yours (docs/security.md):
PSCTL_CONTROL_ADDRESS={CONTROL_ADDRESS}
#PSCTL_CONTROL_TOKEN_FILE={DEFAULT_CONFIG_DIR}/control.token
#PSCTL_CONTROL_TLS_CERT={DEFAULT_CONFIG_DIR}/control.pem
#PSCTL_CONTROL_TLS_KEY={DEFAULT_CONFIG_DIR}/control.key
#PSCTL_CONTROL_TLS_CA={DEFAULT_CONFIG_DIR}/control-clients-ca.pem
# The coordinator's Prometheus /metrics (0 turns it off).
PSCTL_COORDINATOR_METRICS_PORT={COORDINATOR_METRICS_PORT}
"""


def reference_files() -> dict[str, str]:
    """deploy/systemd/: the units and env files as rendered for /opt/psctl/venv."""
    files = unit_files(bin_dir=REFERENCE_BIN_DIR, config_dir=DEFAULT_CONFIG_DIR)
    files["psctl.env"] = host_env(config_dir=DEFAULT_CONFIG_DIR)
    files["coordinator.env"] = coordinator_env()
    files[SYNC_UNIT] = _sync_unit(bin_dir=REFERENCE_BIN_DIR, config_dir=DEFAULT_CONFIG_DIR)
    files["sync.env"] = sync_env()
    return files


# ---------------------------------------------------------------- READMEs


def _port_rows(plan: HostPlan) -> list[tuple[str, str, str, str]]:
    rows = []
    if plan.chief_port is not None:
        rows += [
            ("chief", str(plan.chief_port), "TensorFlow gRPC (coordinator)", "the servers"),
            ("chief", str(COORDINATOR_METRICS_PORT), "Prometheus /metrics", "Prometheus"),
            ("chief", str(_CONTROL_PORT), "psctl control API (loopback)", "nobody: do not open"),
        ]
    for s in plan.servers:
        rows += [
            (s.name, str(s.tf_port), "TensorFlow gRPC", "the coordinator, the other servers"),
            (s.name, str(s.health_port), "grpc.health.v1", "the coordinator host, probes"),
            (s.name, str(s.metrics_port), "Prometheus /metrics", "Prometheus"),
        ]
    return rows


def host_readme(plan: HostPlan, *, bin_dir: str, config_dir: str, coordinator_host: str) -> str:
    configs = ["cluster.json", "psctl.env"] + [s.env_file for s in plan.servers]
    units = [unit_name(r) for r in plan.roles]
    if plan.chief_port is not None:
        configs.append("coordinator.env")
        units.append(COORDINATOR_UNIT)
    units.append(TARGET)
    lines = [
        f"# psctl on {plan.host}",
        "",
        f"Runs: {plan.task_names}. Rendered by `psctl deploy render` for psctl installed in",
        f"`{bin_dir}` (the same path on every host). Run these as root in this directory.",
        "",
        "## Install and start",
        "",
        "```sh",
        f"install -d -m 0755 {config_dir}",
        f"install -m 0644 {' '.join(configs)} {config_dir}/",
        f"install -m 0644 {' '.join(units)} {UNIT_DIR}/",
        "systemctl daemon-reload",
    ]
    if plan.servers:
        enable = " ".join(s.unit for s in plan.servers)
        lines += [
            f"systemctl enable --now {TARGET} {enable}",
            "```",
            "",
            "Each server sends READY=1 once its TF, health and metrics ports listen, so",
            "`systemctl start` returns when it serves. Logs and state:",
            "",
            "```sh",
            f"systemctl status {enable}",
            "journalctl -f -u 'psctl-*'",
            f"{bin_dir}/psctl health --cluster {config_dir}/cluster.json",
        ]
    else:
        lines.append(f"systemctl enable {TARGET}")
    lines.append("```")
    if plan.chief_port is not None:
        lines += [
            "",
            "## Train (this is the coordinator host)",
            "",
            f"Set the job in `{config_dir}/coordinator.env` (PSCTL_JOB, PSCTL_STEPS, ...).",
            "When every host's servers run:",
            "",
            "```sh",
            f"{bin_dir}/psctl deploy check --cluster {config_dir}/cluster.json",
            f"systemctl start {COORDINATOR_UNIT}",
            f"{bin_dir}/psctl watch      # or psctl status; journalctl -f -u {COORDINATOR_UNIT}",
            f"{bin_dir}/psctl stop       # graceful: checkpoint, evaluation, exit 0",
            "```",
            "",
            f"Checkpoints and the summary go to `{STATE_DIR}`; starting the unit again",
            "continues from the latest checkpoint.",
        ]
    else:
        lines += [
            "",
            f"Training starts from the coordinator host, {coordinator_host}, once every",
            "host's servers run.",
        ]
    lines += [
        "",
        "## Ports (TCP) to open on this host",
        "",
        "| task | port | what | reached from |",
        "|---|---|---|---|",
    ]
    lines += [f"| {t} | {p} | {w} | {f} |" for t, p, w, f in _port_rows(plan)]
    lines += [
        "",
        "TensorFlow's gRPC has no TLS and no authentication: open these to the cluster's",
        "private network only.",
        "",
    ]
    return "\n".join(lines)


def index_readme(plans: Sequence[HostPlan], *, source: str, coordinator_host: str) -> str:
    lines = [
        "# psctl deployment",
        "",
        f"Rendered by `psctl deploy render` from `{source}`: one directory per host.",
        "Copy each directory to its host and follow its README.md: start the servers on",
        f"every host first, then the coordinator on {coordinator_host}.",
        "",
        "| host | runs |",
        "|---|---|",
    ]
    lines += [f"| {p.host} | {p.task_names} |" for p in plans]
    lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- render


def _absolute_dir(value: str, flag: str) -> str:
    path = os.path.normpath(value)
    if not os.path.isabs(path):
        raise ConfigError(flag, f"{value!r} is not an absolute path", "give an absolute path")
    if any(ch.isspace() or ch in "\"'\\$%;" for ch in path):
        raise ConfigError(
            flag, f"{value!r} has spaces or special characters", "use a plain path in units"
        )
    return path


def default_bin_dir() -> str:
    """Where the running psctl lives: its console script's directory, else the Python's."""
    argv0 = sys.argv[0] if sys.argv else ""
    if Path(argv0).name == "psctl":
        found = shutil.which(argv0) if os.sep not in argv0 else argv0
        if found:
            return os.path.dirname(os.path.abspath(found))
    return os.path.dirname(os.path.abspath(sys.executable))


def render(
    *,
    cluster_file: str,
    out: Path,
    bin_dir: str,
    config_dir: str = DEFAULT_CONFIG_DIR,
    force: bool = False,
) -> list[HostPlan]:
    """Write OUT/README.md and OUT/<host>/ for every host of the cluster; returns the plan."""
    from psctl.coordinator.control.client import explicit_health_addresses

    bin_dir = _absolute_dir(bin_dir, "--bin-dir")
    config_dir = _absolute_dir(config_dir, "--config-dir")
    cluster = load_cluster_file(cluster_file)
    require_chief(cluster, source=cluster_file)
    plans = plan_hosts(cluster, explicit_health_addresses(cluster_file))
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ConfigError(
            "--out", f"{out} exists and is not empty", "give a new directory or pass --force"
        )
    text = Path(cluster_file).read_text(encoding="utf-8")
    chief_host = next(p.host for p in plans if p.chief_port is not None)
    for plan in plans:  # every name checked before anything is written
        _host_dir(out, plan.host)
    out.mkdir(parents=True, exist_ok=True)
    units = unit_files(bin_dir=bin_dir, config_dir=config_dir)
    for plan in plans:
        files = {
            "README.md": host_readme(
                plan, bin_dir=bin_dir, config_dir=config_dir, coordinator_host=chief_host
            ),
            "cluster.json": text,
            "psctl.env": host_env(config_dir=config_dir, host=plan.host),
            TARGET: units[TARGET],
        }
        for role in plan.roles:
            files[unit_name(role)] = units[unit_name(role)]
        for server in plan.servers:
            files[server.env_file] = task_env(server)
        if plan.chief_port is not None:
            files[COORDINATOR_UNIT] = units[COORDINATOR_UNIT]
            files["coordinator.env"] = coordinator_env()
        _write_dir(out, _host_dir(out, plan.host), files)
    _write_dir(
        out,
        out,
        {"README.md": index_readme(plans, source=cluster_file, coordinator_host=chief_host)},
    )
    return plans


# ---------------------------------------------------------------- --strategy sync

SYNC_UNIT = "psctl-sync@.service"


def _sync_unit(*, bin_dir: str, config_dir: str) -> str:
    head = f"""\
# psctl sync training: one worker of a --strategy sync job (MultiWorkerMirroredStrategy).
# The instance (%i) is the worker's index in the cluster file: `systemctl start
# {SYNC_UNIT.replace("@", "@0")}` runs cluster.worker[0], the chief (checkpoints, the
# control API, metrics). Start one on every worker host; they wait for each other.
# Written by `psctl deploy render --strategy sync`; see docs/sync.md.
"""
    train = _train_exec(
        bin_dir=bin_dir,
        config_dir=config_dir,
        env_file="sync.env",
        args="--strategy sync --cluster ${PSCTL_CLUSTER} --task-index %i",
    )
    service = f"""\
{train}
# psctl train restarts its own training process (a lost peer, a crash) within its budget:
# every status it ends with is final (as the coordinator unit's).
{_TRAIN_RESTART}
# SIGTERM is a graceful stop of the whole group: checkpoint (chief), evaluation, exit 0.
KillMode=mixed
TimeoutStopSec=300
# Checkpoints (the chief's) and the summary: {STATE_DIR}.
StateDirectory=psctl
SyslogIdentifier=psctl-sync-%i
Environment=HOME={STATE_DIR}
"""
    return _unit(
        head=head,
        description="psctl sync training (worker %i)",
        order=f"Wants={TARGET}\n",
        start_limit="StartLimitIntervalSec=600\n",
        service=service,
        devices=_WORKER_DEVICES,
    )


def sync_env() -> str:
    """The training settings of a sync worker: the coordinator's, read by every worker
    (only worker 0 serves the control API and metrics and writes checkpoints)."""
    return coordinator_env().replace(COORDINATOR_UNIT, SYNC_UNIT)


def render_sync(
    *, cluster_file: str, out: Path, bin_dir: str, config_dir: str, force: bool
) -> list[tuple[str, list[int]]]:
    """``--strategy sync``: OUT/<host>/ for every worker host, a training unit per worker
    (no ps or worker-server units; ps entries are ignored); returns (host, worker indexes)."""
    bin_dir = _absolute_dir(bin_dir, "--bin-dir")
    config_dir = _absolute_dir(config_dir, "--config-dir")
    cluster = load_cluster_file(cluster_file, required=SYNC_REQUIRED)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ConfigError(
            "--out", f"{out} exists and is not empty", "give a new directory or pass --force"
        )
    hosts: dict[str, tuple[str, list[int]]] = {}
    for task_type, index, address in cluster.task_addresses():
        if task_type == "worker":
            key = canonical_host(address.host)
            hosts.setdefault(key, (address.host, []))[1].append(index)
    plans = list(hosts.values())
    for host, _ in plans:
        _host_dir(out, host)
    out.mkdir(parents=True, exist_ok=True)
    text = Path(cluster_file).read_text(encoding="utf-8")
    unit = _sync_unit(bin_dir=bin_dir, config_dir=config_dir)
    for host, indexes in plans:
        starts = " ".join(SYNC_UNIT.replace("@", f"@{i}") for i in indexes)
        readme = "\n".join(
            [
                f"# psctl on {host} (--strategy sync)",
                "",
                f"Runs worker(s) {', '.join(map(str, indexes))} of a synchronous job"
                + (" (worker 0 is the chief)." if 0 in indexes else "."),
                "Run as root in this directory:",
                "",
                "```sh",
                f"install -d -m 0755 {config_dir}",
                f"install -m 0644 cluster.json psctl.env sync.env {config_dir}/",
                f"install -m 0644 {SYNC_UNIT} {TARGET} {UNIT_DIR}/",
                "systemctl daemon-reload",
                f"systemctl start {starts}",
                "```",
                "",
                "Open the workers' TF ports to the other worker hosts"
                + (
                    f"; the chief's control API stays on loopback ({CONTROL_ADDRESS}) and "
                    f"its metrics are on port {COORDINATOR_METRICS_PORT}."
                    if 0 in indexes
                    else "."
                ),
                "Each worker serves grpc.health.v1 on its TF port + 1000 and (but worker 0) "
                "/metrics on its TF port + 2000, for the coordinator's status and Prometheus.",
                "",
            ]
        )
        files = {
            "README.md": readme,
            "cluster.json": text,
            "psctl.env": host_env(config_dir=config_dir, host=host),
            "sync.env": sync_env(),
            SYNC_UNIT: unit,
            TARGET: _TARGET_UNIT,
        }
        _write_dir(out, _host_dir(out, host), files)
    return plans


def _host_dir(out: Path, host: str) -> Path:
    """OUT/<host>: a host name used as one path component, never a way out of OUT."""
    if host in ("", ".", "..") or any(ch in host for ch in "/\\\0") or host != host.strip():
        raise ConfigError(
            f"cluster: host {echo(host)}",
            "cannot name a directory of --out",
            "use a host name or an IP address",
        )
    return out / host


def _inside(out: Path, path: Path) -> Path:
    """``path`` with its links resolved; ConfigError unless it lies under ``out``."""
    resolved = path.resolve()
    if not resolved.is_relative_to(out.resolve()):
        raise ConfigError(
            "--out",
            f"{path} leads to {resolved}, outside {out}",
            "give a new --out directory (links inside it point elsewhere)",
        )
    return resolved


def _write_dir(out: Path, path: Path, files: Mapping[str, str]) -> None:
    """Write ``files`` into ``path``, every one checked to stay under ``out`` (a link left
    in a reused --out could point anywhere)."""
    _inside(out, path)
    path.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        target = _inside(out, path / name)
        target.write_text(content, encoding="utf-8")
        target.chmod(0o644)


def _warn_about_bin_dir(bin_dir: str) -> None:
    if any((bin_dir + "/").startswith(p) for p in _HIDDEN_PREFIXES):
        print(
            f"psctl: warning: --bin-dir {bin_dir} is under /home, /root or /run/user, which "
            "the units' DynamicUser cannot read; install psctl in e.g. /opt/psctl/venv on "
            "the hosts and pass --bin-dir /opt/psctl/venv/bin",
            file=sys.stderr,
        )
    missing = [s for s in ("psctl", "ps-server", "worker-server") if not Path(bin_dir, s).exists()]
    if missing:
        print(
            f"psctl: warning: {', '.join(missing)} not found in {bin_dir} here; the units "
            "expect psctl installed there on every host",
            file=sys.stderr,
        )


def cmd_render(args: argparse.Namespace) -> int:
    bin_dir = args.bin_dir or default_bin_dir()
    out = Path(args.out)
    if getattr(args, "strategy", "async") == "sync":
        hosts = render_sync(
            cluster_file=args.cluster,
            out=out,
            bin_dir=bin_dir,
            config_dir=args.config_dir,
            force=args.force,
        )
        print(f"rendered {len(hosts)} worker hosts into {out}/ (--strategy sync):")
        for host, indexes in hosts:
            print(f"  {host}/  worker {', '.join(map(str, indexes))}")
        return 0
    plans = render(
        cluster_file=args.cluster,
        out=out,
        bin_dir=bin_dir,
        config_dir=args.config_dir,
        force=args.force,
    )
    _warn_about_bin_dir(os.path.normpath(bin_dir))
    width = max(len(p.host) for p in plans)
    print(f"rendered {len(plans)} hosts into {out}/ (psctl in {os.path.normpath(bin_dir)}):")
    for plan in plans:
        print(f"  {plan.host + '/':<{width + 1}}  {plan.task_names}")
    print(f"next: copy each directory to its host and follow its README.md ({out}/README.md)")
    return 0


# ---------------------------------------------------------------- check


def _tcp_open(host: str, port: int, timeout: float) -> str:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return "open"
    except TimeoutError:
        return "timeout"
    except ConnectionRefusedError:
        return "refused"
    except OSError as err:
        return err.strerror or type(err).__name__


def cmd_check(args: argparse.Namespace) -> int:
    """`psctl health`'s table of every health service, then every server's TF port tried
    from here (the coordinator host needs them all)."""
    from psctl.cluster.spec import resolve_cluster
    from psctl.coordinator.control.client import cmd_health, explicit_health_addresses

    cluster, _ = resolve_cluster(cluster_file=args.cluster, environ=os.environ)
    plans = plan_hosts(cluster, explicit_health_addresses(args.cluster))
    health = cmd_health(
        argparse.Namespace(
            cluster=args.cluster, health_port_offset=HEALTH_PORT_OFFSET, timeout=args.timeout
        )
    )
    rows = [("HOST", "TASK", "TF PORT (from here)")]
    closed = 0
    servers = [s for p in plans for s in p.servers]
    for s in servers:
        state = _tcp_open(s.host, s.tf_port, args.timeout)
        closed += state != "open"
        rows.append((s.host, s.name, f"{s.tf_port} {state}"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    hosts = sum(1 for p in plans if p.servers)
    if closed == 0 and health == 0:
        print(f"up: all {len(servers)} servers on {hosts} hosts SERVING, every TF port open")
        return 0
    problems = [] if health == 0 else ["not every server is SERVING"]
    if closed:
        problems.append(f"{closed} TF port(s) not reachable from here")
    print(f"not ready: {'; '.join(problems)}")
    return EXIT_UNAVAILABLE


def write_reference(directory: Path) -> list[Path]:
    """Rewrite deploy/systemd/ from the templates above."""
    written = []
    for name, content in reference_files().items():
        path = directory / name
        path.write_text(content, encoding="utf-8")
        written.append(path)
    return written


if __name__ == "__main__":
    for written_path in write_reference(Path(__file__).resolve().parents[2] / "deploy/systemd"):
        print(written_path)
