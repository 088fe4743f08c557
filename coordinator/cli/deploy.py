"""Flags of `psctl deploy render` and `psctl deploy check`. What they do is
coordinator/deploy/'s (no TensorFlow there)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from psctl.coordinator.cli.numbers import decimal
from psctl.coordinator.settings import DEFAULT_CONFIG_DIR


def cmd_deploy(args: argparse.Namespace) -> int:
    # Imported here: every other command (`psctl status` most of all) starts faster.
    from psctl.coordinator.deploy.check import cmd_check
    from psctl.coordinator.deploy.render import cmd_render

    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "render": cmd_render,
        "check": cmd_check,
    }
    return commands[args.deploy_command](args)


def add_deploy_commands(sub: Any) -> dict[str, Callable[[argparse.Namespace], int]]:
    """Register `psctl deploy render` and `psctl deploy check`; returns {name: handler}."""
    deploy = sub.add_parser(
        "deploy",
        help="systemd units per host from a cluster file; check every host",
        description="Deploy psctl on hosts with systemd. See docs/deploy.md.",
    )
    dsub = deploy.add_subparsers(dest="deploy_command", required=True, metavar="COMMAND")
    render_p = dsub.add_parser(
        "render",
        help="write per-host directories: env files, units, README",
        description=(
            "From one cluster file, write OUT/<host>/ for every host: cluster.json, psctl.env, "
            "a <type>-<index>.env per server, the systemd units to install and enable, and a "
            "README.md with the commands to run and the ports to open."
        ),
    )
    render_p.add_argument("--cluster", required=True, metavar="FILE", help="cluster file")
    render_p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    render_p.add_argument(
        "--bin-dir",
        metavar="DIR",
        help="where psctl, ps-server and worker-server are on the hosts "
        "(default: the directory of the running psctl)",
    )
    render_p.add_argument(
        "--config-dir",
        default=DEFAULT_CONFIG_DIR,
        metavar="DIR",
        help=f"where the env files and cluster.json go on the hosts (default {DEFAULT_CONFIG_DIR})",
    )
    render_p.add_argument("--force", action="store_true", help="write into a non-empty --out")
    render_p.add_argument(
        "--strategy",
        choices=("async", "sync"),
        default="async",
        help="async: ps and worker servers plus the coordinator; sync: a training unit on "
        "every worker host (psctl train --strategy sync), no ps (default %(default)s)",
    )
    check_p = dsub.add_parser(
        "check",
        help="reach every server's TF port and health service; non-zero if any is not up",
        description="From this host, check every server of the cluster: its grpc.health.v1 "
        "service (psctl health's table) and whether its TF port accepts connections; exit "
        "69 if any is not up. With --checkpoint-dir, also that every ps reads a file this "
        "host writes there (each ps saves its own shards of every checkpoint): exit 78 if "
        "one does not.",
    )
    check_p.add_argument("--cluster", metavar="FILE", help="cluster file (default: $TF_CONFIG)")
    check_p.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="the job's checkpoint directory: check that every ps host shares it at this path",
    )
    check_p.add_argument("--timeout", type=decimal, default=2.0, help="seconds per check")
    return {"deploy": cmd_deploy}
