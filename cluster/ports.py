"""Side ports (health, metrics) and checks that a port is free before anything binds it."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import socket
import time
from collections.abc import Collection, Mapping
from typing import Any

from psctl.cluster.address import Address
from psctl.cluster.errors import ConfigError

log = logging.getLogger(__name__)

# With no explicit port, a server's side ports sit at fixed offsets from its TF port, so that
# `psctl health --cluster FILE` can find every health service from the cluster file alone.
HEALTH_PORT_OFFSET = 1000
METRICS_PORT_OFFSET = 2000
DATA_PORT_OFFSET = 3000  # a worker server's tf.data service worker (--epochs)


def side_port(tf_port: int, offset: int, *, field: str) -> int:
    port = tf_port + offset
    if not 0 < port < 65536:
        raise ConfigError(
            field,
            f"default port {tf_port}+{offset}={port} is out of range",
            f"set {field} explicitly",
        )
    return port


class HealthAddresses:
    """Where each server's grpc.health.v1 service listens: at the address a cluster file's
    optional "health" section names (shaped like "cluster"; psctl local writes one), else at
    its TF port + ``offset``. The one place psctl health, status, scale and deploy look it up.
    """

    SHAPE = 'give "health": {"ps": ["host:port", ...], "worker": [...]} or leave it out'

    def __init__(
        self,
        explicit: Mapping[tuple[str, int], Address] | None = None,
        *,
        offset: int = HEALTH_PORT_OFFSET,
        source: str = "",
    ) -> None:
        self.explicit = dict(explicit or {})
        self.offset = offset
        self.source = source

    @classmethod
    def of_file(
        cls, cluster_file: str | None, *, offset: int = HEALTH_PORT_OFFSET
    ) -> HealthAddresses:
        if not cluster_file:
            return cls(offset=offset)
        with open(cluster_file) as f:
            return cls.of_json(json.load(f), source=cluster_file, offset=offset)

    @classmethod
    def of_json(cls, top: Any, *, source: str, offset: int = HEALTH_PORT_OFFSET) -> HealthAddresses:
        """From a decoded cluster file (``source`` names it in errors)."""
        section = top.get("health", {}) if isinstance(top, dict) else {}
        if not isinstance(section, dict):
            raise ConfigError(f"{source}: health", "is not an object", cls.SHAPE)
        found: dict[tuple[str, int], Address] = {}
        for task_type, addresses in section.items():
            if task_type not in ("ps", "worker"):
                raise ConfigError(
                    f"{source}: health.{task_type}",
                    "is not a task type with a health service",
                    'give "ps" or "worker" (the servers; the others have none)',
                )
            if not isinstance(addresses, list):
                raise ConfigError(f"{source}: health.{task_type}", "is not a list", cls.SHAPE)
            for index, address in enumerate(addresses):
                field = f"{source}: health.{task_type}[{index}]"
                if not isinstance(address, str):
                    raise ConfigError(field, "is not a string", 'give "host:port"')
                found[(task_type, index)] = Address.parse(address, field=field)
        return cls(found, offset=offset, source=source)

    def get(self, task_type: str, index: int, address: Address) -> Address | None:
        """The task's health address; None where the file names none and TF port + offset is
        not a port."""
        if (task_type, index) in self.explicit:
            return self.explicit[(task_type, index)]
        port = address.port + self.offset
        return address.with_port(port) if 0 < port < 65536 else None

    def require(self, task_type: str, index: int, address: Address, *, field: str) -> Address:
        """As ``get``, a ConfigError naming ``field`` where there is none."""
        if (task_type, index) in self.explicit:
            return self.explicit[(task_type, index)]
        return address.with_port(side_port(address.port, self.offset, field=field))

    def check_tasks(self, counts: Mapping[str, int]) -> None:
        """Every named task is one the cluster has (``counts``: tasks by type)."""
        for (task_type, index), _ in sorted(self.explicit.items()):
            count = counts.get(task_type, 0)
            if index >= count:
                raise ConfigError(
                    f"{self.source}: health.{task_type}[{index}]",
                    f"names a task the cluster does not have (it has {count} {task_type})",
                    f'give one health address per {task_type} task, in the order of "cluster"',
                )


def check_port_free(port: int, *, host: str = "", field: str) -> None:
    """Fail with one clear line when ``port`` is taken.

    gRPC binds with SO_REUSEPORT, so without this check a second server on the same port
    would start silently and share the traffic.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # Connections of a just-killed predecessor linger in TIME_WAIT; they do not make
        # the port taken. A listener does, SO_REUSEADDR or not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise PortInUseError(field, port) from None
            raise ConfigError(
                field,
                f"cannot bind {host or '*'}:{port}: {err.strerror}",
                "choose another port or host",
            ) from None


def wait_port_free(port: int, *, field: str, grace: float, host: str = "") -> None:
    """``check_port_free``, waiting up to ``grace`` seconds for a port that is taken: a
    process of the job's previous run may still be stopping (a training process whose
    launcher was killed checkpoints, then exits), and a new run started at once (systemd's
    restart, an operator's) should not fail on it."""
    deadline = time.monotonic() + grace
    announced = False
    while True:
        try:
            return check_port_free(port, host=host, field=field)
        except PortInUseError:
            if time.monotonic() >= deadline:
                raise
            if not announced:
                log.warning(
                    "%s: port %d is in use (the job's previous process still stopping?): "
                    "waiting up to %.0fs for it",
                    field,
                    port,
                    grace,
                )
                announced = True
            time.sleep(0.5)


class PortInUseError(ConfigError):
    """The port is taken by another process. Not a configuration loop risk: exit 1."""

    exit_status = 1

    def __init__(self, field: str, port: int) -> None:
        super().__init__(
            field,
            f"port {port} is already in use",
            f"stop the process holding it (ss -ltnp 'sport = :{port}') or pick another port",
        )


def free_ports(count: int, host: str = "127.0.0.1", *, avoid: Collection[int] = ()) -> list[int]:
    """``count`` distinct ports that were free a moment ago (for local clusters and tests),
    none of ``avoid``: ports chosen already but not bound yet, which the kernel may hand out
    again (seen: ``psctl local``'s control port given to a worker's /metrics)."""
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < count:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET  # [::1]:0 too
            sock = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
            sock.bind((host, 0))  # held until the end: the next bind gets another port
            port = int(sock.getsockname()[1])
            if port not in avoid:
                ports.append(port)
        return ports
