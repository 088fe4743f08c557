"""`psctl deploy render` and the systemd units it writes (Kubernetes: test_kubernetes.py).

`systemd-analyze verify` checks every unit (the Debian package systemd ships it;
tools/ensure-systemd-tools.sh installs it): these tests fail, never skip, without it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from psctl.cluster import server as server_cli
from psctl.cluster.errors import EXIT_CONFIG, ConfigError
from psctl.cluster.ports import HEALTH_PORT_OFFSET, METRICS_PORT_OFFSET
from psctl.coordinator.cli import main as cli
from psctl.coordinator.deploy.plan import COORDINATOR_UNIT, REFERENCE_BIN_DIR, STATE_DIR
from psctl.coordinator.deploy.render import host_dir, render
from psctl.coordinator.deploy.units import PLACEHOLDER, fill, reference_files
from psctl.coordinator.failures import EXIT_RESTART, EXIT_STATUS, EXIT_USAGE, FINAL_EXIT_STATUSES
from tests.conftest import REPO, require_tool
from tests.integration.netns_hosts import (
    Unit,
    exec_argv,
    parse_unit,
    read_env_file,
    service_env,
    value,
    values,
)

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


@pytest.fixture
def rendered(tmp_path: Path) -> Path:
    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text(json.dumps(CLUSTER))
    out = tmp_path / "out"
    render(cluster_file=str(cluster_file), out=out, bin_dir=BIN_DIR)
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
        assert {p.name for p in (rendered / host).iterdir()} == files | COMMON_FILES, host
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
    render(cluster_file=str(tmp_path / "c.json"), out=tmp_path / "out", bin_dir=BIN_DIR)
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
    assert not values(u, "Unit", "After")[1:], "After=psctl.target would be a cycle"
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
    """tests/integration/sandbox.py applies the units' sandbox to the multi-host test's
    processes, or lists a setting as not applied (docs/deploy.md says which): a new
    setting in the units must be one or the other."""
    from tests.integration.sandbox import APPLIED, NOT_APPLIED

    other = {"Type", "NotifyAccess", "EnvironmentFile", "Environment", "ExecStart", "Restart"}
    other |= {"RestartSec", "RestartPreventExitStatus", "TimeoutStartSec", "TimeoutStopSec"}
    other |= {"SyslogIdentifier", "LimitNOFILE", "KillMode", "WatchdogSec"}
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
    argv = ["deploy", "render", "--cluster", str(cluster_file), "--out", str(tmp_path / "out")]
    assert cli.run_command(cli.build_parser().parse_args(argv)) == EXIT_CONFIG
    assert "--out" in capsys.readouterr().err
    argv2 = [*argv[:-1], str(tmp_path / "new"), "--bin-dir", "venv/bin"]
    assert cli.run_command(cli.build_parser().parse_args(argv2)) == EXIT_CONFIG
    assert "--bin-dir: 'venv/bin' is not an absolute path" in capsys.readouterr().err


def test_render_refuses_ports_that_collide_on_one_host(tmp_path: Path):
    body = {"cluster": {"chief": ["h0:2222"], "ps": ["h1:2222"], "worker": ["h1:3222"]}}
    (tmp_path / "c.json").write_text(json.dumps(body))
    with pytest.raises(Exception, match=r"host h1: worker:0 TF port 3222 is also the ps:0 health"):
        render(cluster_file=str(tmp_path / "c.json"), out=tmp_path / "o", bin_dir=BIN_DIR)


def test_psctl_deploy_does_not_import_tensorflow(tmp_path: Path):
    (tmp_path / "c.json").write_text(json.dumps(CLUSTER))
    code = (
        "import sys; from psctl.coordinator.cli import main as cli; "
        f"rc = cli.main(['deploy', 'render', '--cluster', {str(tmp_path / 'c.json')!r}, "
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
    argv = ["deploy", "render", "--cluster", str(tmp_path / "c.json"), "--out", str(out)]
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
        render(cluster_file=str(tmp_path / "c.json"), out=out, bin_dir=BIN_DIR, force=True)
    (out / "10.0.0.4").unlink()
    (out / "README.md").symlink_to(elsewhere / "README.md")
    with pytest.raises(ConfigError, match=r"README\.md leads to"):
        render(cluster_file=str(tmp_path / "c.json"), out=out, bin_dir=BIN_DIR, force=True)
    assert files_under(elsewhere) == set()


def test_one_host_spelt_two_ways_is_one_directory(tmp_path: Path):
    body = {"cluster": {"chief": ["[::1]:2222"], "ps": ["[::0:1]:2223"], "worker": ["W:2224"]}}
    body["cluster"]["evaluator"] = ["w:2230"]
    (tmp_path / "c.json").write_text(json.dumps(body))
    plans = render(cluster_file=str(tmp_path / "c.json"), out=tmp_path / "o", bin_dir=BIN_DIR)
    assert [(p.host, p.chief_port, [s.name for s in p.servers]) for p in plans] == [
        ("::1", 2222, ["ps:0"]),
        ("W", None, ["worker:0"]),
    ]
    assert {p.name for p in (tmp_path / "o").iterdir()} == {"::1", "W", *TOP_FILES}
