"""What runs where: the cluster's tasks grouped by host with every port each one uses, and
the names and paths every rendered file shares."""

from __future__ import annotations

from dataclasses import dataclass

from psctl.cluster.address import Address, canonical_host
from psctl.cluster.errors import ConfigError
from psctl.cluster.ports import HEALTH_PORT_OFFSET, METRICS_PORT_OFFSET, HealthAddresses, side_port
from psctl.cluster.spec import ClusterConfig
from psctl.coordinator.settings import (
    DEFAULT_CONTROL_ADDRESS,
    DEFAULT_METRICS_PORT,
    SERVICE_STATE_DIR,
)

REFERENCE_BIN_DIR = "/opt/psctl/venv/bin"
UNIT_DIR = "/etc/systemd/system"
STATE_DIR = SERVICE_STATE_DIR  # StateDirectory=psctl; the unit's HOME
SERVER_ROLES = ("ps", "worker")
# The coordinator's own ports: `psctl train`'s defaults.
COORDINATOR_METRICS_PORT = DEFAULT_METRICS_PORT
CONTROL_ADDRESS = DEFAULT_CONTROL_ADDRESS
CONTROL_PORT = Address.parse(CONTROL_ADDRESS, field="control address").port
TARGET = "psctl.target"
COORDINATOR_UNIT = "psctl-coordinator.service"
SYNC_UNIT = "psctl-sync@.service"
# The tunnel (coordinator/deploy/tunnel.py) and the side ports' way out of its namespace.
TUNNEL_UNIT = "psctl-tunnel.service"
PROXY_SOCKET = "psctl-proxy@.socket"
PROXY_SERVICE = "psctl-proxy@.service"
# Where the coordinator unit's job token lands: its HOME is the state directory.
CONTROL_TOKEN_FILE = f"{STATE_DIR}/.local/state/psctl/127.0.0.1_{CONTROL_PORT}.token"


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
    def side_addresses(self) -> list[str]:
        """HOST:PORT of every side port psctl listens on here (health, /metrics, the control
        API): what the proxies carry out of the job's namespace."""
        found = []
        if self.chief_port is not None:
            found += [CONTROL_ADDRESS, str(Address(self.host, COORDINATOR_METRICS_PORT))]
        for s in self.servers:
            found += [
                str(s.address.with_port(s.health_port)),
                str(s.address.with_port(s.metrics_port)),
            ]
        return found

    @property
    def task_names(self) -> str:
        names = [s.name for s in self.servers]
        if self.chief_port is not None:
            names.insert(0, "chief (coordinator)")
        return ", ".join(names)


def plan_hosts(cluster: ClusterConfig, health: HealthAddresses | None = None) -> list[HostPlan]:
    """Group the cluster's tasks by host, with every port each server will use.

    Health ports are TF port + 1000 unless ``health`` (from the cluster file's optional
    "health" section) names one; metrics ports are TF port + 2000. Two tasks on one host
    that would share a port are a ConfigError.
    """
    health = health or HealthAddresses()
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
        health_port = health.require(task_type, index, address, field=f"{field} health port").port
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
    """ConfigError when two of the ports one host would listen on are the same."""
    used: dict[int, str] = {}
    claims: list[tuple[int, str]] = []
    if plan.chief_port is not None:
        claims += [
            (plan.chief_port, "chief TF port"),
            (COORDINATOR_METRICS_PORT, "coordinator metrics port"),
            (CONTROL_PORT, "coordinator control port"),
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
                f"{COORDINATOR_METRICS_PORT} and {CONTROL_PORT}",
            )
        used[port] = what


def sync_metrics_port(index: int, tf_port: int) -> int:
    """Where sync worker ``index`` serves /metrics: worker 0 the coordinator's series at the
    coordinator's port, every other worker at its TF port + METRICS_PORT_OFFSET."""
    return COORDINATOR_METRICS_PORT if index == 0 else tf_port + METRICS_PORT_OFFSET


def sync_side_addresses(cluster: ClusterConfig, health: HealthAddresses) -> dict[str, list[str]]:
    """``--strategy sync``: HOST:PORT of every side port of each host's workers (health,
    /metrics, worker 0's control API), by canonical host: HostPlan.side_addresses' twin."""
    found: dict[str, list[str]] = {}
    for task_type, index, address in cluster.task_addresses():
        if task_type != "worker":
            continue
        field = f"cluster.worker[{index}]"
        sides = [str(health.require("worker", index, address, field=f"{field} health port"))]
        if index == 0:
            sides.append(CONTROL_ADDRESS)
        else:  # a ConfigError when TF port + the offset is no port
            side_port(address.port, METRICS_PORT_OFFSET, field=f"{field} metrics port")
        sides.append(str(address.with_port(sync_metrics_port(index, address.port))))
        found.setdefault(canonical_host(address.host), []).extend(sides)
    return found


def escape_instance(text: str) -> str:
    """``text`` as a unit's instance, as `systemd-escape` writes it, and ':' as ``\\x3a``
    too (``%I`` undoes both): systemd-analyze verify (252) cannot load an instance with
    ':' in its name."""
    out = []
    for i, ch in enumerate(text):
        if ch == "/":
            out.append("-")
        elif (ch.isascii() and ch.isalnum()) or ch == "_" or (ch == "." and i > 0):
            out.append(ch)
        else:
            out.append("".join(f"\\x{b:02x}" for b in ch.encode()))
    return "".join(out)


def proxy_unit(address: str) -> str:
    """The socket unit that carries the side port ``address`` (HOST:PORT) to the host."""
    return PROXY_SOCKET.replace("@", f"@{escape_instance(address)}")
