"""Side ports (health, metrics) and checks that a port is free before anything binds it."""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Collection

from psctl.cluster.errors import ConfigError

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
