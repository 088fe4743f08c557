"""`psctl deploy check`: every server's health service and TF port, tried from here."""

from __future__ import annotations

import argparse
import os
import socket
import time
from pathlib import Path
from typing import Any

from psctl.cluster import netns
from psctl.cluster.errors import EXIT_UNAVAILABLE, ConfigError
from psctl.cluster.ports import HEALTH_PORT_OFFSET, HealthAddresses
from psctl.cluster.tunnel_state import read_state
from psctl.coordinator.deploy.plan import TUNNEL_UNIT, ServerTask, plan_hosts
from psctl.coordinator.deploy.tls import is_tls_conf
from psctl.coordinator.deploy.tunnel import CONFIG_FILE as TUNNEL_CONF
from psctl.coordinator.deploy.tunnel import (
    NETNS_DIR,
    interface_name,
    netns_name,
    peer_states,
)

CHECK_JOB = "psctl_deploy_check"  # this process's name for the ps tasks


# An HTTP/2 client's first bytes (RFC 9113 3.4): the preface, then an empty SETTINGS frame.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def grpc_answers(host: str, port: int, timeout: float) -> str:
    """Whether a gRPC server (TensorFlow's) answers at host:port within ``timeout`` seconds:
    "open" once its SETTINGS frame comes back, or why not. Connecting is not enough: with the
    TLS transport, the job's namespace accepts every connection to another host and only the
    far end's TensorFlow answers."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            conn.sendall(_H2_PREFACE)
            header = conn.recv(9)
    except TimeoutError:
        return "timeout"
    except ConnectionRefusedError:
        return "refused"
    except OSError as err:
        return err.strerror or type(err).__name__
    if len(header) >= 4 and header[3] == 4:  # a SETTINGS frame
        return "open"
    return "closed (no gRPC answer)" if not header else "not gRPC"


def cmd_check(args: argparse.Namespace) -> int:
    """`psctl health`'s table of every health service, then every server's TF port tried
    from here (the coordinator host needs them all)."""
    from psctl.cluster.tf_config import resolve_cluster
    from psctl.coordinator.operations.client import cmd_health

    cluster, _ = resolve_cluster(cluster_file=args.cluster, environ=os.environ)
    plans = plan_hosts(cluster, HealthAddresses.of_file(args.cluster))
    health = cmd_health(
        argparse.Namespace(
            cluster=args.cluster, health_port_offset=HEALTH_PORT_OFFSET, timeout=args.timeout
        )
    )
    servers = [s for p in plans for s in p.servers]
    here = args.address or next(p.host for p in plans if p.chief_port is not None)
    where = NETNS_DIR / netns_name(here)
    tunnel = where.exists()
    rendered_with_tunnel = args.cluster and (Path(args.cluster).parent / TUNNEL_CONF).exists()
    if rendered_with_tunnel and not tunnel:
        print(
            f"not ready: {TUNNEL_CONF} is installed but {where} does not exist: start "
            f"{TUNNEL_UNIT} on this host (journalctl -u {TUNNEL_UNIT} says why it is not up)"
        )
        return EXIT_UNAVAILABLE
    rows = [("HOST", "TASK", "TF PORT (through the tunnel)" if tunnel else "TF PORT (from here)")]
    states = _tf_ports(servers, args.timeout, where if tunnel else None)
    closed = 0
    for s, state in zip(servers, states, strict=True):
        closed += state != "open"
        rows.append((s.host, s.name, f"{s.tf_port} {state}"))
    _table(rows)
    if tunnel:
        _table([("TUNNEL PEER", "ENDPOINT", "LAST HANDSHAKE"), *_peer_rows(args.cluster, here)])
    hosts = sum(1 for p in plans if p.servers)
    if args.checkpoint_dir and closed == 0 and health == 0:
        if tunnel:  # TensorFlow's threads and sockets in this host's end of the tunnel
            netns.enter({netns.ENV: str(where)})
        check_checkpoint_dir(cluster, args.checkpoint_dir)
        print(f"checkpoint dir: every ps reads {args.checkpoint_dir} as this host writes it")
    if closed == 0 and health == 0:
        print(f"up: all {len(servers)} servers on {hosts} hosts SERVING, every TF port open")
        return 0
    problems = [] if health == 0 else ["not every server is SERVING"]
    if closed:
        problems.append(f"{closed} TF port(s) not reachable from here")
    print(f"not ready: {'; '.join(problems)}")
    return EXIT_UNAVAILABLE


def _peer_rows(cluster_file: str | None, here: str) -> list[tuple[str, str, str]]:
    """Every tunnel peer of this host: WireGuard's own view, or what the TLS transport last
    wrote (its connections: a peer is up while one is open)."""
    conf = Path(cluster_file or "").parent / TUNNEL_CONF
    try:
        tls = cluster_file is not None and is_tls_conf(conf.read_text())
    except OSError:
        tls = False
    if not tls:
        return peer_states(interface_name(here))
    state = read_state(here)
    if state is None:
        return [("-", "-", f"no state from {TUNNEL_UNIT} (is it running?)")]
    now = time.time()
    return [
        (p["address"], "TLS", f"{now - p['handshake']:.0f}s ago" if p["handshake"] else "never")
        for p in state.get("peers", [])
    ]


def _table(rows: list[tuple[str, str, str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def _tf_ports(servers: list[ServerTask], timeout: float, inside: Path | None) -> list[str]:
    """Each server's TF port tried from here, or from the job's namespace ``inside`` (this
    host's end of the tunnel: where the coordinator reaches them from)."""

    def probe() -> list[str]:
        return [grpc_answers(s.host, s.tf_port, timeout) for s in servers]

    if inside is None:
        return probe()
    try:
        return netns.run_inside(probe, {netns.ENV: str(inside)})
    except PermissionError:
        raise ConfigError(
            "psctl deploy check",
            f"TensorFlow's ports are reached from {inside}, which only root may enter",
            "run it as root, as docs/deploy.md does",
        ) from None


def check_checkpoint_dir(cluster: Any, directory: str) -> None:
    """Every ps reads a file written here in ``directory`` and writes one read back here
    (ConfigError, exit 78, if one cannot): the same check the training process makes at
    start. This process joins the
    ps tasks' eager runtime as a job of its own, as TensorFlow's ``connect_to_host`` does;
    the running job is not touched."""
    import tensorflow as tf

    from psctl.coordinator.training.saving.checkpoint_files import require_writable_dir
    from psctl.coordinator.training.saving.sharded_save import check_shared

    require_writable_dir(directory, field="--checkpoint-dir")
    addresses = list(cluster.as_dict().get("ps", []))
    if not addresses:
        return
    tf.config.experimental_connect_to_cluster(
        tf.train.ClusterSpec({CHECK_JOB: addresses}), job_name="localhost"
    )
    devices = [f"/job:{CHECK_JOB}/replica:0/task:{i}/device:CPU:0" for i in range(len(addresses))]
    check_shared(directory, devices, names=[f"ps:{i}" for i in range(len(addresses))])
