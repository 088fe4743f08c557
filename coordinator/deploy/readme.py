"""The READMEs `psctl deploy render` writes: one per host, with the commands to run there
and the ports to open, and an index of the hosts."""

from __future__ import annotations

from collections.abc import Sequence

from psctl.coordinator.deploy.plan import (
    CONTROL_ADDRESS,
    CONTROL_PORT,
    COORDINATOR_METRICS_PORT,
    COORDINATOR_UNIT,
    PROXY_SERVICE,
    PROXY_SOCKET,
    STATE_DIR,
    SYNC_UNIT,
    TARGET,
    TUNNEL_UNIT,
    UNIT_DIR,
    HostPlan,
    proxy_unit,
    unit_name,
)
from psctl.coordinator.deploy.tunnel import CONFIG_FILE as TUNNEL_CONF
from psctl.coordinator.deploy.tunnel import LISTEN_PORT, netns_name

_TUNNEL_UNITS = f"{TUNNEL_UNIT} {PROXY_SOCKET} {PROXY_SERVICE}"


def _tunnel_lines(config_dir: str, proxies: Sequence[str]) -> list[str]:
    """Install the host's key and start its tunnel and side-port proxies."""
    return [
        f"install -m 0600 {TUNNEL_CONF} {config_dir}/",
        f"install -m 0644 {_TUNNEL_UNITS} {UNIT_DIR}/",
        "systemctl daemon-reload",
        f"systemctl enable --now {TUNNEL_UNIT}" + "".join(f" '{p}'" for p in proxies),
    ]


def _tunnel_note(host: str, transport: str) -> list[str]:
    through = (
        "over TLS (stunnel4, at each TF port of this host), with"
        if transport == "tls"
        else f"through the cluster's WireGuard tunnel (UDP {LISTEN_PORT}), with"
    )
    return [
        "",
        "Every psctl service here runs in the network namespace",
        f"/run/netns/{netns_name(host)}, made by {TUNNEL_UNIT}: other hosts reach its",
        f"TensorFlow ports only {through}",
        "this cluster's keys; the side ports",
        f"(health, /metrics, control) are on {host}'s network through psctl-proxy@ sockets.",
        f"`{TUNNEL_CONF}` holds this host's private key: keep it 0600, on this host only.",
    ]


def _port_rows(plan: HostPlan, *, tunnel: bool, transport: str) -> list[tuple[str, str, str, str]]:
    def tf_from(hosts: str) -> str:
        if tunnel and transport == "tls":
            return f"{hosts}, over TLS (psctl-tunnel's stunnel4): the cluster's hosts only"
        return f"{hosts}, through the tunnel: do not open" if tunnel else hosts

    rows = []
    if tunnel and transport != "tls":
        rows.append(("tunnel", f"{LISTEN_PORT}/udp", "WireGuard", "the cluster's hosts"))
    if plan.chief_port is not None:
        rows += [
            (
                "chief",
                str(plan.chief_port),
                "TensorFlow gRPC (coordinator)",
                tf_from("the servers"),
            ),
            ("chief", str(COORDINATOR_METRICS_PORT), "Prometheus /metrics", "Prometheus"),
            ("chief", str(CONTROL_PORT), "psctl control API (loopback)", "nobody: do not open"),
        ]
    for s in plan.servers:
        rows += [
            (
                s.name,
                str(s.tf_port),
                "TensorFlow gRPC",
                tf_from("the coordinator, the other servers"),
            ),
            (s.name, str(s.health_port), "grpc.health.v1", "the coordinator host, probes"),
            (s.name, str(s.metrics_port), "Prometheus /metrics", "Prometheus"),
        ]
    return rows


def host_readme(
    plan: HostPlan,
    *,
    bin_dir: str,
    config_dir: str,
    coordinator_host: str,
    tunnel: bool,
    transport: str = "tls",
) -> str:
    """OUT/<host>/README.md: what to install and start on the host, and its ports."""
    configs = ["cluster.json", "psctl.env"] + [s.env_file for s in plan.servers]
    units = [unit_name(r) for r in plan.roles]
    if plan.chief_port is not None:
        configs.append("coordinator.env")
        units.append(COORDINATOR_UNIT)
    units.append(TARGET)
    lines = [
        f"# psctl on {plan.host}",
        "",
        f"Runs: {plan.task_names}. Rendered by `psctl deploy render` for psctl installed in",
        f"`{bin_dir}` (the same path on every host). Run these as root in this directory.",
        "",
        "## Install and start",
        "",
        "```sh",
        f"install -d -m 0755 {config_dir}",
        f"install -m 0644 {' '.join(configs)} {config_dir}/",
        f"install -m 0644 {' '.join(units)} {UNIT_DIR}/",
    ]
    if tunnel:
        lines += _tunnel_lines(config_dir, [proxy_unit(a) for a in plan.side_addresses])
    else:
        lines.append("systemctl daemon-reload")
    if plan.servers:
        enable = " ".join(s.unit for s in plan.servers)
        lines += [
            f"systemctl enable --now {TARGET} {enable}",
            "```",
            "",
            "Each server sends READY=1 once its TF, health and metrics ports listen, so",
            "`systemctl start` returns when it serves. Logs and state:",
            "",
            "```sh",
            f"systemctl status {enable}",
            "journalctl -f -u 'psctl-*'",
            f"{bin_dir}/psctl health --cluster {config_dir}/cluster.json",
        ]
    else:
        lines.append(f"systemctl enable {TARGET}")
    lines.append("```")
    if plan.chief_port is not None:
        lines += [
            "",
            "## Train (this is the coordinator host)",
            "",
            f"Set the job in `{config_dir}/coordinator.env` (PSCTL_JOB, PSCTL_STEPS, ...).",
            "When every host's servers run:",
            "",
            "```sh",
            f"{bin_dir}/psctl deploy check --cluster {config_dir}/cluster.json",
            f"systemctl start {COORDINATOR_UNIT}",
            f"{bin_dir}/psctl watch      # or psctl status; journalctl -f -u {COORDINATOR_UNIT}",
            f"{bin_dir}/psctl stop       # graceful: checkpoint, evaluation, exit 0",
            "```",
            "",
            f"Checkpoints and the summary go to `{STATE_DIR}`; starting the unit again",
            "continues from the latest checkpoint.",
        ]
    else:
        lines += [
            "",
            f"Training starts from the coordinator host, {coordinator_host}, once every",
            "host's servers run.",
        ]
    lines += [
        "",
        "## Ports (TCP) to open on this host",
        "",
        "| task | port | what | reached from |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {t} | {p} | {w} | {f} |"
        for t, p, w, f in _port_rows(plan, tunnel=tunnel, transport=transport)
    ]
    if tunnel:
        lines += _tunnel_note(plan.host, transport)
        lines.append("TensorFlow's TCP ports are not opened: they are reached through the tunnel.")
    else:
        lines += [
            "",
            "TensorFlow's gRPC has no TLS and no authentication (rendered with",
            "--open-tf-ports): open these to the cluster's private network only.",
        ]
    lines.append("")
    return "\n".join(lines)


def index_readme(plans: Sequence[HostPlan], *, source: str, coordinator_host: str) -> str:
    """OUT/README.md: every host and what runs there, in the order to start them."""
    lines = [
        "# psctl deployment",
        "",
        f"Rendered by `psctl deploy render` from `{source}`: one directory per host.",
        "Copy each directory to its host and follow its README.md: start the servers on",
        f"every host first, then the coordinator on {coordinator_host}.",
        "",
        "| host | runs |",
        "|---|---|",
    ]
    lines += [f"| {p.host} | {p.task_names} |" for p in plans]
    lines += [
        "",
        "For Prometheus: `prometheus.yml` here scrapes every process's /metrics from the",
        "file_sd targets beside it (`prometheus-coordinator.json`, `prometheus-ps.json`,",
        "`prometheus-worker.json`); copy them to the Prometheus host, or merge its",
        "scrape_configs into yours (alert rules: deploy/prometheus/alerts.yml).",
        "",
    ]
    return "\n".join(lines)


def sync_readme(
    host: str,
    indexes: Sequence[int],
    *,
    config_dir: str,
    tunnel: bool,
    proxies: Sequence[str],
    transport: str = "tls",
) -> str:
    """``--strategy sync``: OUT/<host>/README.md for the workers ``indexes`` on ``host``
    (``proxies``: its side ports' addresses)."""
    starts = " ".join(SYNC_UNIT.replace("@", f"@{i}") for i in indexes)
    tunnel_lines = _tunnel_lines(config_dir, [proxy_unit(a) for a in proxies]) if tunnel else []
    return "\n".join(
        [
            f"# psctl on {host} (--strategy sync)",
            "",
            f"Runs worker(s) {', '.join(map(str, indexes))} of a synchronous job"
            + (" (worker 0 is the chief)." if 0 in indexes else "."),
            "Run as root in this directory:",
            "",
            "```sh",
            f"install -d -m 0755 {config_dir}",
            f"install -m 0644 cluster.json psctl.env sync.env {config_dir}/",
            f"install -m 0644 {SYNC_UNIT} {TARGET} {UNIT_DIR}/",
            *tunnel_lines,
            "systemctl daemon-reload",
            f"systemctl start {starts}",
            "```",
            *(_tunnel_note(host, transport) if tunnel else []),
            "",
            "Open the workers' TF ports to the other worker hosts"
            + (
                f"; the chief's control API stays on loopback ({CONTROL_ADDRESS}) and "
                f"its metrics are on port {COORDINATOR_METRICS_PORT}."
                if 0 in indexes
                else "."
            ),
            "Each worker serves grpc.health.v1 on its TF port + 1000 and (but worker 0) "
            "/metrics on its TF port + 2000, for the coordinator's status and Prometheus.",
            "",
        ]
    )
