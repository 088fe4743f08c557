"""Flags of `psctl status / watch / checkpoint / pause / resume / stop` and `psctl health`.
What they do is coordinator/operations/client.py's (no TensorFlow there)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from psctl.cluster.ports import HEALTH_PORT_OFFSET
from psctl.coordinator.cli.numbers import decimal, whole_number
from psctl.coordinator.operations.client import (
    cmd_checkpoint,
    cmd_health,
    cmd_pause,
    cmd_resume,
    cmd_scale,
    cmd_status,
    cmd_stop,
    cmd_watch,
)
from psctl.coordinator.operations.security import ENV
from psctl.coordinator.settings import DEFAULT_CONTROL_ADDRESS


def add_address(parser: argparse.ArgumentParser, *, acts: bool = False) -> argparse.ArgumentParser:
    """``--address`` and the credentials of a client command; ``acts``: it changes the job
    (checkpoint, pause, resume, stop), which a read-only token may not."""
    parser.add_argument(
        "--address",
        default=DEFAULT_CONTROL_ADDRESS,
        metavar="HOST:PORT",
        help=f"coordinator's control address (default {DEFAULT_CONTROL_ADDRESS})",
    )
    add_control_security(parser, server=False, acts=acts)
    return parser


def add_control_security(
    parser: argparse.ArgumentParser, *, server: bool, acts: bool = False
) -> None:
    """The control API's credential flags (docs/security.md); each has a PSCTL_* variable.
    ``server``: the coordinator's (psctl local / train), else a client command's."""
    group = parser.add_argument_group(
        "control API credentials (default: the job's token files of this user, plaintext "
        "on loopback)"
    )
    group.add_argument(
        "--control-token-file",
        metavar="FILE",
        help=(
            "the control token (every command): required off loopback "
            if server
            else "the job's control token (a read-only token is refused) "
            if acts
            else "the job's control or read-only token "
        )
        + f"(${ENV['token_file']})",
    )
    if server:
        group.add_argument(
            "--control-read-token-file",
            metavar="FILE",
            help=f"a read-only token, for status and watch (${ENV['read_token_file']})",
        )
    cert, key, ca = (
        (
            "this coordinator's TLS certificate (PEM)",
            "its private key",
            "client CA: require client certificates it signed (mTLS)",
        )
        if server
        else (
            "client certificate for mTLS (PEM)",
            "its private key",
            "CA that signed the coordinator's certificate (turns TLS on)",
        )
    )
    group.add_argument("--control-tls-cert", metavar="PEM", help=f"{cert} (${ENV['tls_cert']})")
    group.add_argument("--control-tls-key", metavar="PEM", help=f"{key} (${ENV['tls_key']})")
    group.add_argument("--control-tls-ca", metavar="PEM", help=f"{ca} (${ENV['tls_ca']})")
    if server:
        group.add_argument(
            "--insecure-control",
            action="store_true",
            help="allow a non-loopback --control-address without TLS and a token file "
            f"(${ENV['insecure']}=1)",
        )


def add_client_commands(sub: Any) -> dict[str, Callable[[argparse.Namespace], int]]:
    """Register the control API's commands and `health` on the CLI's subparsers; returns
    {name: handler}."""

    def command(name: str, summary: str, description: str, *, acts: bool = False) -> Any:
        parser = sub.add_parser(name, help=summary, description=description)
        return add_address(parser, acts=acts)

    status = command(
        "status",
        "show the running job's status",
        "The running job's state, step, rates, loss and metrics, last evaluation and "
        "checkpoint, and every task with its health, failures, pid and metrics URL.",
    )
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    watch = command(
        "watch",
        "live view of the job's status",
        "The job's status, redrawn on a terminal (one line per update when piped), until "
        "the job ends, --count updates or --duration seconds.",
    )
    watch.add_argument("--interval", type=decimal, default=1.0, help="seconds (0.1-60; 1)")
    watch.add_argument("--count", type=whole_number, default=0, help="stop after N updates")
    watch.add_argument("--duration", type=decimal, default=0.0, help="stop after S seconds")
    ckpt = command(
        "checkpoint",
        "save a checkpoint now",
        "Save a checkpoint now (RUNNING or PAUSED, with a --checkpoint-dir); prints its "
        "path and step.",
        acts=True,
    )
    ckpt.add_argument("--timeout", type=decimal, default=300.0, help="seconds (default 300)")
    command(
        "pause",
        "stop scheduling new steps",
        "Stop scheduling new steps: the steps in flight finish, the job stays PAUSED (and "
        "answers status and checkpoint) until resume.",
        acts=True,
    )
    command("resume", "go on after pause", "Go on training after a pause.", acts=True)
    stop = command(
        "stop",
        "graceful stop: checkpoint, eval, exit",
        "Graceful stop: in-flight steps finish, a checkpoint and the final evaluation, the "
        "job exits 0; waits for the coordinator to exit.",
        acts=True,
    )
    stop.add_argument(
        "--timeout",
        type=decimal,
        default=120.0,
        help="seconds to wait for the coordinator to exit (default 120)",
    )
    scale = command(
        "scale",
        "resize the running job's cluster",
        "Resize the running job's cluster with no step lost: the coordinator checkpoints at "
        "the current step and goes on with a fresh training process on the new cluster "
        "(tables re-split over the ps tasks). psctl local: --workers and/or --ps, the "
        "servers are started or stopped for you. psctl train: --cluster NEW.json, after the "
        "new hosts' servers are started (psctl deploy render); a cluster whose servers do "
        "not answer within --connect-timeout (or --timeout, if shorter) is refused and the "
        "job goes on.",
        acts=True,
    )
    scale.add_argument("--workers", type=whole_number, help="worker tasks (psctl local)")
    scale.add_argument("--ps", type=whole_number, help="ps tasks (psctl local)")
    scale.add_argument("--cluster", metavar="FILE", help="the new cluster file (psctl train)")
    scale.add_argument(
        "--timeout",
        type=decimal,
        default=300.0,
        help="seconds to wait for the answer, the new cluster's servers included (default 300)",
    )
    probe = sub.add_parser(
        "health",
        help="check every server's grpc health service",
        description="Check every ps and worker server's grpc.health.v1 service (like "
        "grpc_health_probe); exits non-zero if any is not SERVING.",
    )
    probe.add_argument("--cluster", metavar="FILE", help="cluster file (default: $TF_CONFIG)")
    probe.add_argument(
        "--health-port-offset",
        type=whole_number,
        default=HEALTH_PORT_OFFSET,
        help=f"health port = TF port + this (default {HEALTH_PORT_OFFSET})",
    )
    probe.add_argument("--timeout", type=decimal, default=2.0, help="seconds per check")
    return {
        "status": cmd_status,
        "watch": cmd_watch,
        "checkpoint": cmd_checkpoint,
        "pause": cmd_pause,
        "resume": cmd_resume,
        "stop": cmd_stop,
        "scale": cmd_scale,
        "health": cmd_health,
    }
