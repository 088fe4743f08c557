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
    unit_name,
)
from psctl.coordinator.deploy.prometheus import prometheus_files, sync_prometheus_files
from psctl.coordinator.deploy.readme import host_readme, index_readme, sync_readme
from psctl.coordinator.deploy.units import (
    coordinator_env,
    host_env,
    reference_files,
    sync_env,
    sync_unit,
    target_unit,
    task_env,
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
    bin_dir = _absolute_dir(bin_dir, "--bin-dir")
    config_dir = _absolute_dir(config_dir, "--config-dir")
    cluster = load_cluster_file(cluster_file)
    require_chief(cluster, source=cluster_file)
    plans = plan_hosts(cluster, HealthAddresses.of_file(cluster_file))
    _check_out(out, force=force)
    text = Path(cluster_file).read_text(encoding="utf-8")
    chief_host = next(p.host for p in plans if p.chief_port is not None)
    for plan in plans:  # every name checked before anything is written
        host_dir(out, plan.host)
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
        _write_dir(out, host_dir(out, plan.host), files)
    _write_dir(
        out,
        out,
        {
            "README.md": index_readme(plans, source=cluster_file, coordinator_host=chief_host),
            **prometheus_files(cluster, plans),
        },
    )
    return plans


def render_sync(
    *, cluster_file: str, out: Path, bin_dir: str, config_dir: str, force: bool
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
    plans = list(hosts.values())
    for host, _ in plans:
        host_dir(out, host)
    out.mkdir(parents=True, exist_ok=True)
    text = Path(cluster_file).read_text(encoding="utf-8")
    unit = sync_unit(bin_dir=bin_dir, config_dir=config_dir)
    for host, indexes in plans:
        files = {
            "README.md": sync_readme(host, indexes, config_dir=config_dir),
            "cluster.json": text,
            "psctl.env": host_env(config_dir=config_dir, host=host),
            "sync.env": sync_env(),
            SYNC_UNIT: unit,
            TARGET: target_unit(),
        }
        _write_dir(out, host_dir(out, host), files)
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
    """`psctl deploy render`: write the directories, then say what went where."""
    bin_dir = args.bin_dir or default_bin_dir()
    out = Path(args.out)
    # The same flags for either strategy.
    options: dict[str, Any] = {
        "cluster_file": args.cluster,
        "out": out,
        "bin_dir": bin_dir,
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
    print(f"next: copy each directory to its host and follow its README.md ({out}/README.md)")
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
