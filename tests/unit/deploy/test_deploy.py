"""`psctl deploy render` and the systemd units it writes (Kubernetes: test_kubernetes.py).

`systemd-analyze verify` checks every unit (the Debian package systemd ships it;
tools/ensure-systemd-tools.sh installs it): these tests fail, never skip, without it.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness.netns_hosts import (
    Unit,
    exec_argv,
    parse_unit,
    read_env_file,
    service_env,
    unescape_instance,
    value,
    values,
)
from psctl.cluster import server as server_cli
from psctl.cluster.errors import EXIT_CONFIG, ConfigError
from psctl.cluster.ports import HEALTH_PORT_OFFSET, METRICS_PORT_OFFSET
from psctl.coordinator.cli import main as cli
from psctl.coordinator.deploy.plan import (
    COORDINATOR_UNIT,
    REFERENCE_BIN_DIR,
    STATE_DIR,
    TUNNEL_UNIT,
)
from psctl.coordinator.deploy.render import host_dir, render
from psctl.coordinator.deploy.tunnel import Keys, netns_name, read_peers
from psctl.coordinator.deploy.units import PLACEHOLDER, PROXYD, fill, reference_files
from psctl.coordinator.failures import EXIT_RESTART, EXIT_STATUS, EXIT_USAGE, FINAL_EXIT_STATUSES
from tests.conftest import REPO, require_tool

BIN_DIR = str(Path(sys.executable).parent)  # real psctl, ps-server, worker-server
SYSTEMD_DIR = REPO / "deploy" / "systemd"

# 2 ps, 3 workers on 4 server hosts (10.0.0.3 runs a ps and a worker), chief on its own.
CLUSTER = {
    "cluster": {
        "chief": ["10.0.0.1:2222"],
        "ps": ["10.0.0.2:2222", "10.0.0.3:2222"],
        "worker": ["10.0.0.3:2223", "10.0.0.4:2222", "10.0.0.5:2222"],
    }
}
HOST_FILES = {
    "10.0.0.1": {"coordinator.env", "psctl-coordinator.service"},
    "10.0.0.2": {"ps-0.env", "psctl-ps@.service"},
    "10.0.0.3": {"ps-1.env", "worker-0.env", "psctl-ps@.service", "psctl-worker@.service"},
    "10.0.0.4": {"worker-1.env", "psctl-worker@.service"},
    "10.0.0.5": {"worker-2.env", "psctl-worker@.service"},
}
COMMON_FILES = {"README.md", "cluster.json", "psctl.env", "psctl.target"}
# With --keys (the default way): each host's tunnel, its key and the side ports' proxies.
TUNNEL_FILES = {"tunnel.conf", TUNNEL_UNIT, "psctl-proxy@.socket", "psctl-proxy@.service"}
HARDENING = {
    "DynamicUser": "yes",
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectControlGroups": "yes",
    "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes",
    "CapabilityBoundingSet": "",
    "MemoryDenyWriteExecute": "false",
    "SystemCallErrorNumber": "EPERM",
    "ProtectProc": "invisible",
    "PrivateMounts": "yes",
    "UMask": "0077",
}
SYSTEM_CALL_FILTER = ["@system-service", "~@privileged @resources"]


def fake_keys(directory: Path, hosts: list[str]) -> Keys:
    """A key directory as `psctl deploy keys` writes it, without wg: the renderer only
    copies keys (32 random bytes, base64, as WireGuard's are)."""
    directory.mkdir(exist_ok=True)
    for host in hosts:
        for kind in ("key", "pub"):
            (directory / f"{host}.{kind}").write_text(base64.b64encode(os.urandom(32)).decode())
    return Keys(directory)


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return fake_keys(tmp_path / "keys", list(HOST_FILES))


@pytest.fixture
def rendered(tmp_path: Path, keys: Keys) -> Path:
    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text(json.dumps(CLUSTER))
    out = tmp_path / "out"
    render(cluster_file=str(cluster_file), out=out, bin_dir=BIN_DIR, keys=keys)
    return out


# OUT's own files: the index README and the Prometheus scrape config with its targets.
TOP_FILES = ["README.md", "prometheus.yml"] + [
    f"prometheus-{role}.json" for role in ("coordinator", "ps", "worker")
]


def unit(path: Path) -> Unit:
    return parse_unit(path.read_text())


def systemd_analyze() -> str:
    return require_tool(
        "systemd-analyze", "tools/ensure-systemd-tools.sh (installs the Debian package systemd)"
    )


def verify(directory: Path, names: list[str]) -> None:
    proc = subprocess.run(
        [systemd_analyze(), "verify", *names],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=60,
    )
    # verify exits 0 on unknown keys and bad values, but says so: no output is the bar.
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), (
        f"systemd-analyze verify {' '.join(names)} in {directory}:\n{proc.stdout}{proc.stderr}"
    )


def test_one_directory_per_host_with_its_units_env_files_and_readme(rendered: Path):
    assert sorted(p.name for p in rendered.iterdir()) == sorted([*HOST_FILES, *TOP_FILES])
    for host, files in HOST_FILES.items():
        assert {p.name for p in (rendered / host).iterdir()} == files | COMMON_FILES | TUNNEL_FILES
        assert json.loads((rendered / host / "cluster.json").read_text()) == CLUSTER
    index = (rendered / "README.md").read_text()
    for host in HOST_FILES:
        assert f"| {host} |" in index
    assert "coordinator on 10.0.0.1" in index


def test_env_files_name_the_cluster_file_and_every_tasks_ports(rendered: Path):
    for host in HOST_FILES:
        env = read_env_file(rendered / host / "psctl.env")
        assert env["PSCTL_CLUSTER"] == "/etc/psctl/cluster.json"
        assert env["GRPC_FAIL_FAST"] == "use_caller"
    tasks = [("ps", 0, "10.0.0.2", 2222), ("ps", 1, "10.0.0.3", 2222)]
    tasks += [("worker", 0, "10.0.0.3", 2223), ("worker", 1, "10.0.0.4", 2222)]
    tasks += [("worker", 2, "10.0.0.5", 2222)]
    for task_type, index, host, tf_port in tasks:
        env = read_env_file(rendered / host / f"{task_type}-{index}.env")
        assert env == {
            "PSCTL_HEALTH_PORT": str(tf_port + HEALTH_PORT_OFFSET),
            "PSCTL_METRICS_PORT": str(tf_port + METRICS_PORT_OFFSET),
        }
    coordinator = read_env_file(rendered / "10.0.0.1" / "coordinator.env")
    assert coordinator["PSCTL_CHECKPOINT_DIR"].startswith(STATE_DIR + "/")
    assert coordinator["PSCTL_CONTROL_ADDRESS"] == cli.DEFAULT_CONTROL_ADDRESS
    assert coordinator["PSCTL_COORDINATOR_METRICS_PORT"] == str(cli.DEFAULT_METRICS_PORT)


def test_a_health_section_in_the_cluster_file_sets_the_health_port(tmp_path: Path):
    body = {**CLUSTER, "health": {"ps": ["10.0.0.2:9000"]}}
    (tmp_path / "c.json").write_text(json.dumps(body))
    render(cluster_file=str(tmp_path / "c.json"), out=tmp_path / "out", bin_dir=BIN_DIR, keys=None)
    env = read_env_file(tmp_path / "out" / "10.0.0.2" / "ps-0.env")
    assert env["PSCTL_HEALTH_PORT"] == "9000"
    assert read_env_file(tmp_path / "out" / "10.0.0.3" / "ps-1.env")["PSCTL_HEALTH_PORT"] == "3222"


@pytest.mark.parametrize("role", ["ps", "worker"])
def test_server_units_notify_restart_and_hardening(rendered: Path, role: str):
    host = "10.0.0.3"
    text = (rendered / host / f"psctl-{role}@.service").read_text()
    u = parse_unit(text)
    assert value(u, "Service", "Type") == "notify"
    assert value(u, "Service", "Restart") == "on-failure"
    # A bad instance (psctl-ps@foo: argparse's 2) stops there, as a configuration error does.
    assert value(u, "Service", "RestartPreventExitStatus") == f"{EXIT_USAGE} {EXIT_CONFIG}"
    assert values(u, "Service", "EnvironmentFile") == [
        "/etc/psctl/psctl.env",
        f"-/etc/psctl/{role}-%i.env",
    ]
    for key, expected in HARDENING.items():
        assert value(u, "Service", key) == expected, key
    assert values(u, "Service", "SystemCallFilter") == SYSTEM_CALL_FILTER
    assert value(u, "Unit", "PartOf") == "psctl.target"
    assert value(u, "Install", "WantedBy") == "psctl.target"
    # Stopped after the coordinator of the same host (its final checkpoint needs them).
    assert value(u, "Unit", "Before") == "psctl-coordinator.service"
    # The comment right above MemoryDenyWriteExecute=false says why.
    lines = text.splitlines()
    at = lines.index("MemoryDenyWriteExecute=false")
    why = " ".join(line for line in lines[at - 4 : at] if line.startswith("#"))
    assert "MemoryDenyWriteExecute=yes" in why and "executable" in why, why


@pytest.mark.parametrize(("role", "index"), [("ps", 1), ("worker", 0)])
def test_exec_start_is_the_server_cli_for_the_instance(rendered: Path, role: str, index: int):
    host = rendered / "10.0.0.3"
    u = unit(host / f"psctl-{role}@.service")

    def local(path: str) -> Path:
        return host / path.removeprefix("/etc/psctl/")

    env = service_env(u, str(index), local)
    assert env["PSCTL_HEALTH_PORT"] == str((2222 if role == "ps" else 2223) + HEALTH_PORT_OFFSET)
    argv = exec_argv(value(u, "Service", "ExecStart"), str(index), env)
    assert argv[0] == f"{BIN_DIR}/{role}-server"
    args = server_cli.build_parser(role).parse_args(argv[1:])
    assert (args.cluster, args.index) == ("/etc/psctl/cluster.json", index)


def test_coordinator_unit_runs_psctl_train_with_the_cli_flags(rendered: Path):
    host = rendered / "10.0.0.1"
    u = unit(host / "psctl-coordinator.service")
    assert value(u, "Service", "Restart") == "on-failure"
    # psctl train retries inside (75 never leaves it): every status it ends with is final.
    prevented = [int(s) for s in value(u, "Service", "RestartPreventExitStatus").split()]
    assert prevented == list(FINAL_EXIT_STATUSES)
    ends_with = {s for s in EXIT_STATUS.values() if s != EXIT_RESTART} | {EXIT_USAGE}
    assert set(prevented) == ends_with and {EXIT_CONFIG, EXIT_USAGE} <= set(prevented)
    assert value(u, "Service", "StateDirectory") == "psctl"
    assert value(u, "Service", "KillMode") == "mixed"  # one SIGTERM, via the supervisor
    for key, expected in HARDENING.items():
        assert value(u, "Service", key) == expected, key
    assert values(u, "Service", "SystemCallFilter") == SYSTEM_CALL_FILTER
    # Starting it starts the servers of its host, which are ordered before it.
    assert values(u, "Unit", "Wants") == ["network-online.target", "psctl.target"]
    after = values(u, "Unit", "After")
    assert "psctl.target" not in after, "After=psctl.target would be a cycle"
    assert after == ["network-online.target", TUNNEL_UNIT]
    env = service_env(u, "", lambda p: host / p.removeprefix("/etc/psctl/"))
    argv = exec_argv(value(u, "Service", "ExecStart"), "", env)
    assert argv[0] == f"{BIN_DIR}/psctl"
    args = cli.build_parser().parse_args(argv[1:])
    assert args.command == "train"
    assert args.cluster == "/etc/psctl/cluster.json"
    assert args.control_address == cli.DEFAULT_CONTROL_ADDRESS
    assert args.metrics_port == cli.DEFAULT_METRICS_PORT


def test_readme_per_host_has_the_commands_and_every_port(rendered: Path):
    ps_host = (rendered / "10.0.0.3" / "README.md").read_text()
    assert "install -m 0644 cluster.json psctl.env ps-1.env worker-0.env /etc/psctl/" in ps_host
    assert "systemctl daemon-reload" in ps_host
    assert "systemctl enable --now psctl.target psctl-ps@1.service psctl-worker@0.service" in (
        ps_host
    )
    for task, ports in {"ps:1": (2222, 3222, 4222), "worker:0": (2223, 3223, 4223)}.items():
        for port in ports:
            assert re.search(rf"^\| {task} \| {port} \|", ps_host, re.M), (task, port)
    chief = (rendered / "10.0.0.1" / "README.md").read_text()
    assert "systemctl start psctl-coordinator.service" in chief
    assert f"{BIN_DIR}/psctl deploy check --cluster /etc/psctl/cluster.json" in chief
    for port in (2222, cli.DEFAULT_METRICS_PORT, 7070):
        assert re.search(rf"^\| chief \| {port} \|", chief, re.M), port


def test_systemd_analyze_verify_passes_on_every_rendered_unit(rendered: Path):
    for host, files in HOST_FILES.items():
        names = ["psctl.target"]
        for name in sorted(files):
            task = re.fullmatch(r"(ps|worker)-(\d+)\.env", name)
            if task:  # an instance of its template
                names.append(f"psctl-{task[1]}@{task[2]}.service")
            elif name == COORDINATOR_UNIT:
                names.append(name)
        verify(rendered / host, names)


def test_the_multihost_sandbox_knows_every_sandboxing_setting(rendered: Path):
    """bench/harness/sandbox.py applies the units' sandbox to the multi-host test's
    processes, or lists a setting as not applied (docs/deploy.md says which): a new
    setting in the units must be one or the other."""
    from bench.harness.sandbox import APPLIED, NOT_APPLIED

    other = {"Type", "NotifyAccess", "EnvironmentFile", "Environment", "ExecStart", "Restart"}
    other |= {"RestartSec", "RestartPreventExitStatus", "TimeoutStartSec", "TimeoutStopSec"}
    other |= {"SyslogIdentifier", "LimitNOFILE", "KillMode", "WatchdogSec"}
    # The multi-host test runs every unit in its host's job namespace itself (nsenter).
    other |= {"NetworkNamespacePath"}
    for host, files in HOST_FILES.items():
        for name in files:
            if name.endswith(".service"):
                keys = {k for s, k, _ in unit(rendered / host / name) if s == "Service"}
                assert keys - other <= APPLIED | NOT_APPLIED, (name, keys - other - APPLIED)


@pytest.mark.parametrize(
    ("host", "name", "most"),
    [
        ("10.0.0.1", "psctl-coordinator.service", 1.5),
        ("10.0.0.3", "psctl-ps@.service", 1.5),
        ("10.0.0.3", "psctl-worker@.service", 1.8),  # no PrivateDevices=: GPUs
        ("10.0.0.3", "psctl-proxy@.service", 1.5),
        # Root with CAP_SYS_ADMIN and CAP_NET_ADMIN, and no mount namespace: it makes the
        # job's network namespace and moves the TUN device into it (5.6 measured).
        ("10.0.0.3", TUNNEL_UNIT, 6.0),
    ],
)
def test_units_expose_little_by_systemd_analyze_security(
    rendered: Path, host: str, name: str, most: float
):
    proc = subprocess.run(
        [systemd_analyze(), "security", "--offline=true", "--no-pager", f"./{name}"],
        cwd=rendered / host,
        capture_output=True,
        text=True,
        timeout=60,
    )
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout)
    assert found, proc.stdout + proc.stderr
    assert float(found[1]) <= most, proc.stdout


def test_deploy_systemd_is_the_renderer_output(tmp_path: Path):
    """deploy/systemd/ is rendered for /opt/psctl/venv
    (python -m psctl.coordinator.deploy.render)."""
    for name, content in reference_files().items():
        assert (SYSTEMD_DIR / name).read_text() == content, (
            f"deploy/systemd/{name} is stale: run python -m psctl.coordinator.deploy.render"
        )
    # The same units verify once their binaries exist (here: this checkout's).
    for name in reference_files():
        text = (SYSTEMD_DIR / name).read_text().replace(REFERENCE_BIN_DIR, BIN_DIR)
        (tmp_path / name).write_text(text)
    names = ["psctl-ps@0.service", "psctl-worker@0.service", "psctl-coordinator.service"]
    verify(tmp_path, [*names, "psctl-sync@0.service", "psctl.target"])


def test_a_template_placeholder_without_a_value_is_an_error():
    with pytest.raises(ValueError, match=r"^templates/target\.in: no value for @target@$"):
        fill("target.in")
    # A value is not searched for placeholders: it lands as it is.
    assert "@state_dir@.service" in fill("target.in", target="@state_dir@.service")
    assert not [n for n, c in reference_files().items() if PLACEHOLDER.search(c)]


def test_render_refuses_a_non_empty_out_and_a_relative_bin_dir(tmp_path: Path, capsys):
    cluster_file = tmp_path / "c.json"
    cluster_file.write_text(json.dumps(CLUSTER))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("")
    argv = ["deploy", "render", "--open-tf-ports", "--cluster", str(cluster_file)]
    argv += ["--out", str(tmp_path / "out")]
    assert cli.run_command(cli.build_parser().parse_args(argv)) == EXIT_CONFIG
    assert "--out" in capsys.readouterr().err
    argv2 = [*argv[:-1], str(tmp_path / "new"), "--bin-dir", "venv/bin"]
    assert cli.run_command(cli.build_parser().parse_args(argv2)) == EXIT_CONFIG
    assert "--bin-dir: 'venv/bin' is not an absolute path" in capsys.readouterr().err


def test_render_refuses_ports_that_collide_on_one_host(tmp_path: Path):
    body = {"cluster": {"chief": ["h0:2222"], "ps": ["h1:2222"], "worker": ["h1:3222"]}}
    (tmp_path / "c.json").write_text(json.dumps(body))
    with pytest.raises(Exception, match=r"host h1: worker:0 TF port 3222 is also the ps:0 health"):
        render(
            cluster_file=str(tmp_path / "c.json"), out=tmp_path / "o", bin_dir=BIN_DIR, keys=None
        )


def test_psctl_deploy_does_not_import_tensorflow(tmp_path: Path):
    (tmp_path / "c.json").write_text(json.dumps(CLUSTER))
    code = (
        "import sys; from psctl.coordinator.cli import main as cli; "
        "rc = cli.main(['deploy', 'render', '--open-tf-ports', "
        f"'--cluster', {str(tmp_path / 'c.json')!r}, "
        f"'--out', {str(tmp_path / 'out')!r}, '--bin-dir', {BIN_DIR!r}]); "
        "assert rc == 0, rc; assert 'tensorflow' not in sys.modules, 'tensorflow imported'"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr
    assert "rendered 5 hosts" in proc.stdout


# -- render writes under --out only -----------------------------------------------------------


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_render_refuses_host_names_that_leave_out(tmp_path: Path, capsys):
    """`..` as a host once rendered OUT/../ (the cluster parser refuses it now); render checks
    every host it uses as a directory name itself, too."""
    body = {"cluster": {"chief": ["..:2222"], "ps": ["h1:2222"], "worker": ["h2:2222"]}}
    (tmp_path / "c.json").write_text(json.dumps(body))
    out = tmp_path / "deep" / "out"
    argv = ["deploy", "render", "--open-tf-ports", "--cluster", str(tmp_path / "c.json")]
    argv += ["--out", str(out)]
    assert cli.run_command(cli.build_parser().parse_args(argv)) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and '".." is not a valid host name' in err, err
    assert files_under(tmp_path) == {"c.json"}
    for host in ("..", ".", "", "a/b", "a\\b", " h"):
        with pytest.raises(ConfigError, match="cannot name a directory of --out"):
            host_dir(out, host)


def test_render_does_not_write_through_links_out_of_out(tmp_path: Path):
    (tmp_path / "c.json").write_text(json.dumps(CLUSTER))
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "10.0.0.4").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ConfigError, match=r"^--out: .*10\.0\.0\.4 leads to .*elsewhere"):
        render(
            cluster_file=str(tmp_path / "c.json"), out=out, bin_dir=BIN_DIR, keys=None, force=True
        )
    (out / "10.0.0.4").unlink()
    (out / "README.md").symlink_to(elsewhere / "README.md")
    with pytest.raises(ConfigError, match=r"README\.md leads to"):
        render(
            cluster_file=str(tmp_path / "c.json"), out=out, bin_dir=BIN_DIR, keys=None, force=True
        )
    assert files_under(elsewhere) == set()


def test_one_host_spelt_two_ways_is_one_directory(tmp_path: Path):
    body = {"cluster": {"chief": ["[::1]:2222"], "ps": ["[::0:1]:2223"], "worker": ["W:2224"]}}
    body["cluster"]["evaluator"] = ["w:2230"]
    (tmp_path / "c.json").write_text(json.dumps(body))
    plans = render(
        cluster_file=str(tmp_path / "c.json"), out=tmp_path / "o", bin_dir=BIN_DIR, keys=None
    )
    assert [(p.host, p.chief_port, [s.name for s in p.servers]) for p in plans] == [
        ("::1", 2222, ["ps:0"]),
        ("W", None, ["worker:0"]),
    ]
    assert {p.name for p in (tmp_path / "o").iterdir()} == {"::1", "W", *TOP_FILES}


# -- the tunnel (coordinator/deploy/tunnel.py) ------------------------------------------------


def test_render_without_keys_or_open_tf_ports_is_one_line_naming_both(tmp_path: Path, capsys):
    (tmp_path / "c.json").write_text(json.dumps(CLUSTER))
    argv = ["deploy", "render", "--cluster", str(tmp_path / "c.json"), "--out", str(tmp_path / "o")]
    assert cli.run_command(cli.build_parser().parse_args(argv)) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("psctl: error: --keys: no tunnel keys"), err
    assert "psctl deploy keys" in err and "--open-tf-ports" in err
    assert not (tmp_path / "o").exists()
    argv += ["--open-tf-ports", "--keys", str(tmp_path)]
    assert cli.run_command(cli.build_parser().parse_args(argv)) == EXIT_CONFIG
    assert "--keys: given with --open-tf-ports" in capsys.readouterr().err


def test_each_host_gets_its_own_key_and_every_other_host_as_a_peer(rendered: Path, keys: Keys):
    hosts = list(HOST_FILES)
    for host in hosts:
        conf = rendered / host / "tunnel.conf"
        assert conf.stat().st_mode & 0o777 == 0o600, host  # its private key
        assert f"PrivateKey = {keys.private(host)}" in conf.read_text()
        peers = read_peers(conf)
        assert [p.allowed for p in peers] == [(f"{h}/32",) for h in hosts if h != host]
        assert [p.public_key for p in peers] == [keys.public(h) for h in hosts if h != host]
        assert [p.endpoint for p in peers] == [f"{h}:51820" for h in hosts if h != host]
        for other in hosts:  # no other host's secret
            assert other == host or keys.private(other) not in conf.read_text()
        env = read_env_file(rendered / host / "psctl.env")
        assert env["PSCTL_TUNNEL_ADDRESS"] == host


def test_every_unit_of_a_host_runs_in_its_job_namespace_behind_the_tunnel(rendered: Path):
    for host, files in HOST_FILES.items():
        units = [n for n in files | TUNNEL_FILES if n.endswith(".service") and n != TUNNEL_UNIT]
        for name in units:
            u = unit(rendered / host / name)
            where = f"/run/netns/psctl-{host}"
            assert value(u, "Service", "NetworkNamespacePath") == where, name
            assert values(u, "Unit", "Requires") == [TUNNEL_UNIT], name
            assert TUNNEL_UNIT in values(u, "Unit", "After"), name
    tunnel = unit(rendered / "10.0.0.3" / TUNNEL_UNIT)
    assert value(tunnel, "Service", "Type") == "notify"
    assert not values(tunnel, "Service", "ProtectSystem")  # its netns mount must be shared
    env = service_env(tunnel, "", lambda p: rendered / "10.0.0.3" / p.removeprefix("/etc/psctl/"))
    argv = exec_argv(value(tunnel, "Service", "ExecStart"), "", env)
    args = cli.build_parser().parse_args(argv[1:])
    assert (args.command, args.deploy_command) == ("deploy", "tunnel")
    assert (args.config, args.address) == ("/etc/psctl/tunnel.conf", "10.0.0.3")
    assert netns_name(args.address) == "psctl-10.0.0.3"


def test_readme_starts_the_tunnel_and_a_proxy_for_every_side_port(rendered: Path):
    readme = (rendered / "10.0.0.3" / "README.md").read_text()
    assert "install -m 0600 tunnel.conf /etc/psctl/" in readme
    enable = next(line for line in readme.splitlines() if "psctl-tunnel.service '" in line)
    proxies = [unescape_instance(i) for i in re.findall(r"'psctl-proxy@(\S+)\.socket'", enable)]
    assert proxies == ["10.0.0.3:3222", "10.0.0.3:4222", "10.0.0.3:3223", "10.0.0.3:4223"]
    chief = (rendered / "10.0.0.1" / "README.md").read_text()
    assert r"'psctl-proxy@127.0.0.1\x3a7070.socket' 'psctl-proxy@10.0.0.1\x3a9940.socket'" in chief
    assert re.search(r"^\| tunnel \| 51820/udp \|", readme, re.M)
    assert re.search(r"^\| ps:1 \| 2222 \| TensorFlow gRPC \| .*do not open \|$", readme, re.M)
    proxy = unit(rendered / "10.0.0.3" / "psctl-proxy@.socket")
    assert value(proxy, "Socket", "ListenStream") == "%I"
    forward = value(unit(rendered / "10.0.0.3" / "psctl-proxy@.service"), "Service", "ExecStart")
    assert exec_argv(forward, "10.0.0.3:3222", {}) == [PROXYD, "10.0.0.3:3222"]


def test_ipv6_side_ports_are_proxied_at_bracketed_addresses(tmp_path: Path):
    body = {"cluster": {"chief": ["[fd00::1]:2222"], "ps": ["[fd00::2]:2222"]}}
    body["cluster"]["worker"] = ["[fd00::2]:2223"]
    (tmp_path / "c.json").write_text(json.dumps(body))
    keys = fake_keys(tmp_path / "k", ["fd00::1", "fd00::2"])
    render(cluster_file=str(tmp_path / "c.json"), out=tmp_path / "o", bin_dir=BIN_DIR, keys=keys)
    found = {}
    for host in ("fd00::1", "fd00::2"):
        readme = (tmp_path / "o" / host / "README.md").read_text()
        found[host] = [
            unescape_instance(i) for i in re.findall(r"'psctl-proxy@(\S+)\.socket'", readme)
        ]
    assert found == {
        "fd00::1": ["127.0.0.1:7070", "[fd00::1]:9940"],
        "fd00::2": ["[fd00::2]:3222", "[fd00::2]:4222", "[fd00::2]:3223", "[fd00::2]:4223"],
    }
    peers = read_peers(tmp_path / "o" / "fd00::1" / "tunnel.conf")
    assert [(p.endpoint, p.allowed) for p in peers] == [("[fd00::2]:51820", ("fd00::2/128",))]


def test_tunnel_units_verify(rendered: Path):
    proxies = [r"psctl-proxy@10.0.0.3\x3a3222.socket", r"psctl-proxy@10.0.0.3\x3a3222.service"]
    verify(rendered / "10.0.0.3", [TUNNEL_UNIT, "psctl-ps@1.service", *proxies])


def test_open_tf_ports_renders_no_tunnel_and_says_so(tmp_path: Path, capsys):
    (tmp_path / "c.json").write_text(json.dumps(CLUSTER))
    argv = ["deploy", "render", "--open-tf-ports", "--cluster", str(tmp_path / "c.json")]
    argv += ["--out", str(tmp_path / "o"), "--bin-dir", BIN_DIR]
    assert cli.run_command(cli.build_parser().parse_args(argv)) == 0
    assert "--open-tf-ports: TensorFlow's ports will listen on every interface" in (
        capsys.readouterr().err
    )
    files = {p.name for p in (tmp_path / "o" / "10.0.0.3").iterdir()}
    assert not files & TUNNEL_FILES
    u = unit(tmp_path / "o" / "10.0.0.3" / "psctl-ps@.service")
    assert not values(u, "Service", "NetworkNamespacePath") and not values(u, "Unit", "Requires")
    assert "PSCTL_TUNNEL_ADDRESS" not in read_env_file(tmp_path / "o" / "10.0.0.3" / "psctl.env")


def test_the_tunnel_needs_ip_addresses_and_a_key_for_every_host(tmp_path: Path):
    named = {"cluster": {"chief": ["a:2222"], "ps": ["b:2222"], "worker": ["c:2222"]}}
    (tmp_path / "named.json").write_text(json.dumps(named))
    keys = fake_keys(tmp_path / "k", ["10.0.0.1"])
    with pytest.raises(ConfigError, match=r"^cluster: host a: 'a' is not an IP address"):
        render(cluster_file=str(tmp_path / "named.json"), out=tmp_path / "o", bin_dir=BIN_DIR,
               keys=keys)  # fmt: skip
    (tmp_path / "c.json").write_text(json.dumps(CLUSTER))
    with pytest.raises(ConfigError, match=r"^--keys: no key for host 10\.0\.0\.2 .*deploy keys"):
        render(cluster_file=str(tmp_path / "c.json"), out=tmp_path / "o", bin_dir=BIN_DIR,
               keys=keys)  # fmt: skip
    assert not (tmp_path / "o").exists()  # nothing written


def test_deploy_keys_adds_keys_for_new_hosts_and_keeps_the_others(tmp_path: Path, capsys):
    require_tool(
        "wg", "tools/ensure-systemd-tools.sh (installs the Debian package wireguard-tools)"
    )
    (tmp_path / "c.json").write_text(json.dumps({"cluster": {"chief": ["10.0.0.1:2222"]}}))
    argv = ["deploy", "keys", "--cluster", str(tmp_path / "c.json"), "--out", str(tmp_path / "k")]
    argv += ["--transport", "wireguard"]
    assert cli.run_command(cli.build_parser().parse_args(argv)) == 0
    first = Keys(tmp_path / "k").private("10.0.0.1")
    assert (tmp_path / "k" / "10.0.0.1.key").stat().st_mode & 0o777 == 0o600
    (tmp_path / "c.json").write_text(json.dumps(CLUSTER))  # four hosts more
    assert cli.run_command(cli.build_parser().parse_args(argv)) == 0
    assert "keys for 5 hosts in" in capsys.readouterr().out.split("4 new, 1 kept")[0]
    assert Keys(tmp_path / "k").private("10.0.0.1") == first
    public = subprocess.run(["wg", "pubkey"], input=first, capture_output=True, text=True).stdout
    assert Keys(tmp_path / "k").public("10.0.0.1") == public.strip()
    assert cli.run_command(cli.build_parser().parse_args([*argv, "--rotate"])) == 0
    assert Keys(tmp_path / "k").private("10.0.0.1") != first


def test_a_tunnel_conf_readable_by_others_is_refused(tmp_path: Path):
    conf = tmp_path / "tunnel.conf"
    conf.write_text("[Interface]\nPrivateKey = x\n")
    conf.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        read_peers(conf)
    conf.chmod(0o600)
    assert read_peers(conf) == []
    conf.write_text("[Interface]\n")
    with pytest.raises(ConfigError, match="has no PrivateKey"):
        read_peers(conf)
