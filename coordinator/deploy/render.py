"""`psctl deploy render`: OUT/<host>/ for every host of a cluster file (env files, units, a
README), written only under OUT.

``python -m psctl.coordinator.deploy.render`` rewrites deploy/systemd/ (the units rendered
for /opt/psctl/venv; a test fails when it is stale).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from psctl.cluster.address import canonical_host
from psctl.cluster.errors import ConfigError, echo
from psctl.cluster.ports import HealthAddresses
from psctl.cluster.spec import SYNC_REQUIRED, load_cluster_file, require_chief
from psctl.coordinator.deploy.plan import (
    COORDINATOR_UNIT,
    SYNC_UNIT,
    TARGET,
    HostPlan,
    plan_hosts,
    sync_side_addresses,
    unit_name,
)
from psctl.coordinator.deploy.prometheus import prometheus_files, sync_prometheus_files
from psctl.coordinator.deploy.readme import host_readme, index_readme, sync_readme
from psctl.coordinator.deploy.tls import holds_psks, make_psks, tls_conf
from psctl.coordinator.deploy.tunnel import CONFIG_FILE as TUNNEL_CONF
from psctl.coordinator.deploy.tunnel import Keys, make_keys, netns_name, tunnel_conf
from psctl.coordinator.deploy.units import (
    coordinator_env,
    host_env,
    reference_files,
    sync_env,
    sync_unit,
    target_unit,
    task_env,
    tunnel_units,
    unit_files,
)
from psctl.coordinator.settings import DEFAULT_CONFIG_DIR

# Where a unit's paths may not reach under DynamicUser= and ProtectHome=.
_HIDDEN_PREFIXES = ("/home/", "/root/", "/run/user/")


def _absolute_dir(value: str, flag: str) -> str:
    path = os.path.normpath(value)
    if not os.path.isabs(path):
        raise ConfigError(flag, f"{value!r} is not an absolute path", "give an absolute path")
    if any(ch.isspace() or ch in "\"'\\$%;" for ch in path):
        raise ConfigError(
            flag, f"{value!r} has spaces or special characters", "use a plain path in units"
        )
    return path


def _check_out(out: Path, *, force: bool) -> None:
    """ConfigError when ``out`` holds anything and ``force`` is not given."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ConfigError(
            "--out", f"{out} exists and is not empty", "give a new directory or pass --force"
        )


def tunnel_keys(keys: str | None, *, open_tf_ports: bool) -> Keys | None:
    """The key directory to render with, None for --open-tf-ports; ConfigError for
    neither (or both)."""
    if keys is not None and open_tf_ports:
        raise ConfigError("--keys", "given with --open-tf-ports", "pass one of them")
    if keys is None and not open_tf_ports:
        raise ConfigError(
            "--keys",
            "no tunnel keys: TensorFlow's ports would be open to every host that reaches them",
            "run psctl deploy keys --cluster FILE --out DIR and pass --keys DIR, or pass "
            "--open-tf-ports (a trusted network only)",
        )
    if keys is None:
        return None
    if not Path(keys).is_dir():
        raise ConfigError("--keys", f"{keys} is not a directory", "psctl deploy keys --out DIR")
    return Keys(Path(keys))


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
    keys: Keys | None,
    config_dir: str = DEFAULT_CONFIG_DIR,
    force: bool = False,
) -> list[HostPlan]:
    """Write OUT/README.md and OUT/<host>/ for every host of the cluster (with ``keys``, each
    host's tunnel.conf and units in the job's namespace); returns the plan."""
    bin_dir = _absolute_dir(bin_dir, "--bin-dir")
    config_dir = _absolute_dir(config_dir, "--config-dir")
    cluster = load_cluster_file(cluster_file)
    require_chief(cluster, source=cluster_file)
    plans = plan_hosts(cluster, HealthAddresses.of_file(cluster_file))
    _check_out(out, force=force)
    text = Path(cluster_file).read_text(encoding="utf-8")
    chief_host = next(p.host for p in plans if p.chief_port is not None)
    hosts = [p.host for p in plans]
    secrets = _tunnel_confs(hosts, keys)  # every name and key checked before any write
    transport = _transport(keys)
    for plan in plans:
        host_dir(out, plan.host)
    out.mkdir(parents=True, exist_ok=True)
    for plan in plans:
        netns = netns_name(plan.host) if keys is not None else None
        units = unit_files(bin_dir=bin_dir, config_dir=config_dir, netns=netns)
        files = {
            "README.md": host_readme(
                plan,
                bin_dir=bin_dir,
                config_dir=config_dir,
                coordinator_host=chief_host,
                tunnel=keys is not None,
                transport=transport,
            ),
            "cluster.json": text,
            "psctl.env": host_env(config_dir=config_dir, tunnel=keys is not None, host=plan.host),
            TARGET: units[TARGET],
        }
        if netns is not None:
            files.update(tunnel_units(bin_dir=bin_dir, config_dir=config_dir, netns=netns))
        for role in plan.roles:
            files[unit_name(role)] = units[unit_name(role)]
        for server in plan.servers:
            files[server.env_file] = task_env(server)
        if plan.chief_port is not None:
            files[COORDINATOR_UNIT] = units[COORDINATOR_UNIT]
            files["coordinator.env"] = coordinator_env()
        _write_host(out, plan.host, files, secrets.get(plan.host))
    _write_dir(
        out,
        out,
        {
            "README.md": index_readme(plans, source=cluster_file, coordinator_host=chief_host),
            **prometheus_files(cluster, plans),
        },
    )
    return plans


def _transport(keys: Keys | None) -> str:
    """The transport of a key directory: "tls" (psctl deploy keys' default) or "wireguard"."""
    return "tls" if keys is None or holds_psks(keys.directory) else "wireguard"


def _tunnel_confs(hosts: list[str], keys: Keys | None) -> dict[str, str]:
    """Every host's tunnel.conf (its peers: the other hosts), none without ``keys``."""
    if keys is None:
        return {}
    if holds_psks(keys.directory):  # psctl deploy keys --transport tls
        return {h: tls_conf(h, [p for p in hosts if p != h], keys.directory) for h in hosts}
    return {h: tunnel_conf(h, [p for p in hosts if p != h], keys) for h in hosts}


def render_sync(
    *,
    cluster_file: str,
    out: Path,
    bin_dir: str,
    keys: Keys | None,
    config_dir: str,
    force: bool,
) -> list[tuple[str, list[int]]]:
    """``--strategy sync``: OUT/<host>/ for every worker host, a training unit per worker
    (no ps or worker-server units; ps entries are ignored); returns (host, worker indexes)."""
    bin_dir = _absolute_dir(bin_dir, "--bin-dir")
    config_dir = _absolute_dir(config_dir, "--config-dir")
    cluster = load_cluster_file(cluster_file, required=SYNC_REQUIRED)
    _check_out(out, force=force)
    hosts: dict[str, tuple[str, list[int]]] = {}
    for task_type, index, address in cluster.task_addresses():
        if task_type == "worker":
            key = canonical_host(address.host)
            hosts.setdefault(key, (address.host, []))[1].append(index)
    tunnel = keys is not None
    proxies = sync_side_addresses(cluster, HealthAddresses.of_file(cluster_file)) if tunnel else {}
    plans = list(hosts.values())
    secrets = _tunnel_confs([host for host, _ in plans], keys)
    for host, _ in plans:
        host_dir(out, host)
    out.mkdir(parents=True, exist_ok=True)
    text = Path(cluster_file).read_text(encoding="utf-8")
    for host, indexes in plans:
        netns = netns_name(host) if tunnel else None
        sides = proxies.get(canonical_host(host), [])
        files = {
            "README.md": sync_readme(
                host,
                indexes,
                config_dir=config_dir,
                tunnel=tunnel,
                proxies=sides,
                transport=_transport(keys),
            ),
            "cluster.json": text,
            "psctl.env": host_env(config_dir=config_dir, tunnel=tunnel, host=host),
            "sync.env": sync_env(),
            SYNC_UNIT: sync_unit(bin_dir=bin_dir, config_dir=config_dir, netns=netns),
            TARGET: target_unit(),
        }
        if netns is not None:
            files.update(tunnel_units(bin_dir=bin_dir, config_dir=config_dir, netns=netns))
        _write_host(out, host, files, secrets.get(host))
    _write_dir(out, out, sync_prometheus_files(cluster))
    return plans


def host_dir(out: Path, host: str) -> Path:
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


def _write_dir(out: Path, path: Path, files: Mapping[str, str], mode: int = 0o644) -> None:
    """Write ``files`` into ``path`` with ``mode`` from their first byte, every one checked
    to stay under ``out`` (a link left in a reused --out could point anywhere)."""
    _inside(out, path)
    path.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        target = _inside(out, path / name)
        target.unlink(missing_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(content)
        target.chmod(mode)


def _write_host(out: Path, host: str, files: Mapping[str, str], secret: str | None) -> None:
    """OUT/<host>/: ``files``, and the host's tunnel.conf (0600) when it has one."""
    directory = host_dir(out, host)
    _write_dir(out, directory, files)
    if secret is not None:
        _write_dir(out, directory, {TUNNEL_CONF: secret}, 0o600)


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
    """`psctl deploy render`: write the directories, then say what went where."""
    bin_dir = args.bin_dir or default_bin_dir()
    out = Path(args.out)
    # The same flags for either strategy.
    keys = tunnel_keys(args.keys, open_tf_ports=args.open_tf_ports)
    options: dict[str, Any] = {
        "cluster_file": args.cluster,
        "out": out,
        "bin_dir": bin_dir,
        "keys": keys,
        "config_dir": args.config_dir,
        "force": args.force,
    }
    if getattr(args, "strategy", "async") == "sync":
        hosts = render_sync(**options)
        print(f"rendered {len(hosts)} worker hosts into {out}/ (--strategy sync):")
        for host, indexes in hosts:
            print(f"  {host}/  worker {', '.join(map(str, indexes))}")
        return 0
    plans = render(**options)
    _warn_about_bin_dir(os.path.normpath(bin_dir))
    width = max(len(p.host) for p in plans)
    print(f"rendered {len(plans)} hosts into {out}/ (psctl in {os.path.normpath(bin_dir)}):")
    for plan in plans:
        print(f"  {plan.host + '/':<{width + 1}}  {plan.task_names}")
    if keys is None:
        print(
            "psctl: warning: --open-tf-ports: TensorFlow's ports will listen on every interface "
            "of every host, with no authentication (docs/security.md)",
            file=sys.stderr,
        )
    else:
        print(f"tunnel: each host's {TUNNEL_CONF} (0600) holds its private key: copy it only there")
    print(f"next: copy each directory to its host and follow its README.md ({out}/README.md)")
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    """`psctl deploy keys`: a key pair for every host of the cluster file without one."""
    cluster = load_cluster_file(args.cluster, required=())
    hosts = list(dict.fromkeys(a.host for _, _, a in cluster.task_addresses()))
    tls = getattr(args, "transport", "wireguard") == "tls"
    out = Path(args.out)
    if out.is_dir() and any(out.iterdir()) and holds_psks(out) != tls:
        raise ConfigError(
            "--transport",
            f"{out} holds keys of the other transport",
            "give another --out, or the --transport its keys are for",
        )
    made = (make_psks if tls else make_keys)(hosts, out, rotate=args.rotate)
    kept = len(hosts) - len(made)
    print(f"keys for {len(hosts)} hosts in {args.out}/: {len(made)} new, {kept} kept")
    for host in made:
        print(f"  {host}.psk (0600)" if tls else f"  {host}.key (0600), {host}.pub")
    if made:
        print(f"next: psctl deploy render --cluster {args.cluster} --keys {args.out} ...")
    return 0


def write_reference(directory: Path) -> list[Path]:
    """Rewrite deploy/systemd/ from the templates."""
    written = []
    for name, content in reference_files().items():
        path = directory / name
        path.write_text(content, encoding="utf-8")
        written.append(path)
    return written


if __name__ == "__main__":
    for written_path in write_reference(Path(__file__).resolve().parents[2] / "deploy/systemd"):
        print(written_path)
