"""Flags of `psctl status / watch / checkpoint / pause / resume / stop` and `psctl health`.
What they do is coordinator/control/client.py's (no TensorFlow there)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from psctl.cluster.ports import HEALTH_PORT_OFFSET
from psctl.coordinator.control.client import (
    cmd_checkpoint,
    cmd_health,
    cmd_pause,
    cmd_resume,
    cmd_status,
    cmd_stop,
    cmd_watch,
)
from psctl.coordinator.settings import DEFAULT_CONTROL_ADDRESS


def add_address(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--address",
        default=DEFAULT_CONTROL_ADDRESS,
        metavar="HOST:PORT",
        help=f"coordinator's control address (default {DEFAULT_CONTROL_ADDRESS})",
    )
    return parser


def add_client_commands(sub: Any) -> dict[str, Callable[[argparse.Namespace], int]]:
    """Register the control API's commands and `health` on the CLI's subparsers; returns
    {name: handler}."""
    status = add_address(sub.add_parser("status", help="show the running job's status"))
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    watch = add_address(sub.add_parser("watch", help="live view of the job's status"))
    watch.add_argument("--interval", type=float, default=1.0, help="seconds (0.1-60; 1)")
    watch.add_argument("--count", type=int, default=0, help="stop after N updates")
    watch.add_argument("--duration", type=float, default=0.0, help="stop after S seconds")
    ckpt = add_address(sub.add_parser("checkpoint", help="save a checkpoint now"))
    ckpt.add_argument("--timeout", type=float, default=300.0, help="seconds (default 300)")
    add_address(sub.add_parser("pause", help="stop scheduling new steps"))
    add_address(sub.add_parser("resume", help="go on after pause"))
    stop = add_address(sub.add_parser("stop", help="graceful stop: checkpoint, eval, exit"))
    stop.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds to wait for the coordinator to exit (default 120)",
    )
    probe = sub.add_parser("health", help="check every server's grpc health service")
    probe.add_argument("--cluster", metavar="FILE", help="cluster file (default: $TF_CONFIG)")
    probe.add_argument(
        "--health-port-offset",
        type=int,
        default=HEALTH_PORT_OFFSET,
        help=f"health port = TF port + this (default {HEALTH_PORT_OFFSET})",
    )
    probe.add_argument("--timeout", type=float, default=2.0, help="seconds per check")
    return {
        "status": cmd_status,
        "watch": cmd_watch,
        "checkpoint": cmd_checkpoint,
        "pause": cmd_pause,
        "resume": cmd_resume,
        "stop": cmd_stop,
        "health": cmd_health,
    }
