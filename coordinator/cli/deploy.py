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
    from psctl.coordinator.deploy.render import cmd_keys, cmd_render
    from psctl.coordinator.deploy.tls import cmd_tunnel

    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "render": cmd_render,
        "check": cmd_check,
        "keys": cmd_keys,
        "tunnel": cmd_tunnel,
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
        "--keys",
        metavar="DIR",
        help="the cluster's tunnel keys (psctl deploy keys): every host's TensorFlow ports "
        "are reached only through an encrypted, authenticated tunnel (docs/security.md)",
    )
    render_p.add_argument(
        "--open-tf-ports",
        action="store_true",
        help="no tunnel: TensorFlow's ports open on every interface of every host, as "
        "TensorFlow serves them (a trusted network only)",
    )
    render_p.add_argument(
        "--strategy",
        choices=("async", "sync"),
        default="async",
        help="async: ps and worker servers plus the coordinator; sync: a training unit on "
        "every worker host (psctl train --strategy sync), no ps (default %(default)s)",
    )
    keys_p = dsub.add_parser(
        "keys",
        help="make the cluster's tunnel keys: one per host",
        description="Write DIR/<host>.psk (0600: the TLS transport's pre-shared key; with "
        "--transport wireguard, DIR/<host>.key and .pub from wg genkey) for every host of "
        "the cluster file that has none; keys already there are kept, so run it again after "
        "adding hosts. --rotate makes new keys for every host: render and install every "
        "host's tunnel.conf again (docs/deploy.md).",
    )
    keys_p.add_argument("--cluster", required=True, metavar="FILE", help="cluster file")
    keys_p.add_argument("--out", required=True, metavar="DIR", help="the key directory")
    keys_p.add_argument("--rotate", action="store_true", help="new keys for every host")
    keys_p.add_argument(
        "--transport",
        choices=("wireguard", "tls"),
        default="tls",
        help="tls: a pre-shared key per host, for TLS 1.3 through stunnel4 (DIR/<host>.psk); "
        "wireguard: a WireGuard key pair per host, for wireguard-go, which costs about 9 "
        "times the CPU per byte (docs/security.md; default %(default)s)",
    )
    tunnel_p = dsub.add_parser(
        "tunnel",
        help="run this host's tunnel (the psctl-tunnel unit's process; root)",
        description="Make the job's network namespace (/run/netns/psctl-ADDRESS) if missing "
        "and give it this host's way to the others, as its tunnel.conf says: TLS (stunnel4 "
        "for each connection between hosts, nftables redirecting them in the namespace) or "
        "WireGuard (wireguard-go's interface moved in, a route to every peer); tell systemd "
        "READY=1 and log each peer until SIGTERM (SIGHUP: reload tunnel.conf and, with TLS, "
        "the cluster file).",
    )
    tunnel_p.add_argument(
        "--config", required=True, metavar="FILE", help="this host's tunnel.conf (0600)"
    )
    tunnel_p.add_argument(
        "--address", required=True, help="this host's address in the cluster file"
    )
    tunnel_p.add_argument(
        "--cluster",
        metavar="FILE",
        help="the cluster file (default $PSCTL_CLUSTER, as psctl.env sets it): the TLS "
        "transport listens for this host's TF ports and encrypts connections to the others'",
    )
    tunnel_p.add_argument(
        "--listen",
        metavar="ADDRESS",
        help="TLS: where this host's TF ports take TLS on its network (default --address; "
        "another address only where the cluster address forwards to this one)",
    )
    tunnel_p.add_argument(
        "--netns", help="namespace name (default psctl-ADDRESS: what the units name)"
    )
    tunnel_p.add_argument(
        "--interface", help="WireGuard interface (default wgp + 12 hex digits of ADDRESS)"
    )
    check_p = dsub.add_parser(
        "check",
        help="reach every server's TF port and health service; non-zero if any is not up",
        description="From this host, check every server of the cluster: its grpc.health.v1 "
        "service (psctl health's table) and whether its TF port accepts connections (with "
        "the tunnel: from this host's end of it, as root, and every peer's last handshake); "
        "exit 69 if any is not up. With --checkpoint-dir, also that every ps reads a file this "
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
    check_p.add_argument(
        "--address",
        help="this host's address in the cluster file (default: the chief's): with the "
        "tunnel, TF ports are tried from this host's end of it, as the coordinator does",
    )
    return {"deploy": cmd_deploy}
