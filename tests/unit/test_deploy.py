"""`psctl deploy render`, the systemd units it writes, and the Kubernetes TFJob manifest.

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
from psctl.cluster.errors import EXIT_CONFIG
from psctl.cluster.ports import HEALTH_PORT_OFFSET, METRICS_PORT_OFFSET
from psctl.cluster.spec import parse_tf_config
from psctl.coordinator.cli import main as cli
from psctl.coordinator.launch import deploy
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
TFJOB = REPO / "deploy" / "kubernetes" / "tfjob.yaml"
PVC = REPO / "deploy" / "kubernetes" / "checkpoints-pvc.yaml"

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
}


@pytest.fixture
def rendered(tmp_path: Path) -> Path:
    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text(json.dumps(CLUSTER))
    out = tmp_path / "out"
    deploy.render(cluster_file=str(cluster_file), out=out, bin_dir=BIN_DIR)
    return out


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
    assert sorted(p.name for p in rendered.iterdir()) == sorted([*HOST_FILES, "README.md"])
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
    assert coordinator["PSCTL_CHECKPOINT_DIR"].startswith(deploy.STATE_DIR + "/")
    assert coordinator["PSCTL_CONTROL_ADDRESS"] == cli.DEFAULT_CONTROL_ADDRESS
    assert coordinator["PSCTL_COORDINATOR_METRICS_PORT"] == str(cli.DEFAULT_METRICS_PORT)


def test_a_health_section_in_the_cluster_file_sets_the_health_port(tmp_path: Path):
    body = {**CLUSTER, "health": {"ps": ["10.0.0.2:9000"]}}
    (tmp_path / "c.json").write_text(json.dumps(body))
    deploy.render(cluster_file=str(tmp_path / "c.json"), out=tmp_path / "out", bin_dir=BIN_DIR)
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
    assert value(u, "Service", "RestartPreventExitStatus") == str(EXIT_CONFIG)
    assert values(u, "Service", "EnvironmentFile") == [
        "/etc/psctl/psctl.env",
        f"-/etc/psctl/{role}-%i.env",
    ]
    for key, expected in HARDENING.items():
        assert value(u, "Service", key) == expected, key
    assert value(u, "Unit", "PartOf") == "psctl.target"
    assert value(u, "Install", "WantedBy") == "psctl.target"
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
    assert value(u, "Service", "RestartPreventExitStatus") == str(EXIT_CONFIG)
    assert value(u, "Service", "StateDirectory") == "psctl"
    assert value(u, "Service", "KillMode") == "mixed"  # one SIGTERM, via the supervisor
    for key, expected in HARDENING.items():
        assert value(u, "Service", key) == expected, key
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
    for port in (2222, 9400, 7070):
        assert re.search(rf"^\| chief \| {port} \|", chief, re.M), port


def test_systemd_analyze_verify_passes_on_every_rendered_unit(rendered: Path):
    for host, files in HOST_FILES.items():
        names = ["psctl.target"]
        for name in sorted(files):
            task = re.fullmatch(r"(ps|worker)-(\d+)\.env", name)
            if task:  # an instance of its template
                names.append(f"psctl-{task[1]}@{task[2]}.service")
            elif name == deploy.COORDINATOR_UNIT:
                names.append(name)
        verify(rendered / host, names)


def test_deploy_systemd_is_the_renderer_output(tmp_path: Path):
    """deploy/systemd/ is rendered for /opt/psctl/venv
    (python -m psctl.coordinator.launch.deploy)."""
    for name, content in deploy.reference_files().items():
        assert (SYSTEMD_DIR / name).read_text() == content, (
            f"deploy/systemd/{name} is stale: run python -m psctl.coordinator.launch.deploy"
        )
    # The same units verify once their binaries exist (here: this checkout's).
    for name in deploy.reference_files():
        text = (SYSTEMD_DIR / name).read_text().replace(deploy.REFERENCE_BIN_DIR, BIN_DIR)
        (tmp_path / name).write_text(text)
    names = ["psctl-ps@0.service", "psctl-worker@0.service", "psctl-coordinator.service"]
    verify(tmp_path, [*names, "psctl.target"])


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
        deploy.render(cluster_file=str(tmp_path / "c.json"), out=tmp_path / "o", bin_dir=BIN_DIR)


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


# ---------------------------------------------------------------- Kubernetes


def load_json_yaml(path: Path) -> dict:
    """The manifests are YAML in JSON's syntax plus full-line comments."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    return json.loads("\n".join(lines))


def container(spec: dict, replica: str) -> dict:
    pod = spec["spec"]["tfReplicaSpecs"][replica]["template"]["spec"]
    (only,) = pod["containers"]
    return only


def console_scripts() -> set[str]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    return set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"])


def test_tfjob_has_chief_ps_and_worker_replicas_as_the_operator_wants():
    job = load_json_yaml(TFJOB)
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "TFJob")
    replicas = job["spec"]["tfReplicaSpecs"]
    assert set(replicas) == {"Chief", "PS", "Worker"}
    assert replicas["Chief"]["replicas"] == 1
    assert replicas["Chief"]["restartPolicy"] == "OnFailure"
    for name in ("PS", "Worker"):
        assert replicas[name]["replicas"] >= 1
        assert replicas[name]["restartPolicy"] == "Always"
    for name in replicas:
        c = container(job, name)
        # The operator finds the TF container and port by these names.
        assert c["name"] == "tensorflow"
        assert {"name": "tfjob-port", "containerPort": 2222} in c["ports"]
        env = {e["name"]: e["value"] for e in c["env"]}
        assert env["GRPC_FAIL_FAST"] == "use_caller"
        assert "TF_CONFIG" not in env  # the operator sets it
        assert c["command"][0] in console_scripts()
    pvc = load_json_yaml(PVC)
    volumes = replicas["Chief"]["template"]["spec"]["volumes"]
    assert {"name": "state", "persistentVolumeClaim": {"claimName": pvc["metadata"]["name"]}} in (
        volumes
    )


@pytest.mark.parametrize(("replica", "task_type"), [("PS", "ps"), ("Worker", "worker")])
def test_tfjob_servers_probe_health_and_expose_metrics_on_the_cli_ports(replica, task_type):
    job = load_json_yaml(TFJOB)
    c = container(job, replica)
    assert c["command"] == [f"{task_type}-server"]
    args = server_cli.build_parser(task_type).parse_args(c["args"])
    assert args.cluster is None  # the task comes from the operator's TF_CONFIG
    tf_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "tfjob-port")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["health"] == tf_port + HEALTH_PORT_OFFSET
    assert ports["metrics"] == tf_port + METRICS_PORT_OFFSET
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": ports["health"]}, probe
    annotations = job["spec"]["tfReplicaSpecs"][replica]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(ports["metrics"])
    # What the operator's TF_CONFIG looks like for this replica parses as this server's task.
    tf_config = {
        "cluster": {
            "chief": ["psctl-mlp-chief-0.default.svc:2222"],
            "ps": ["psctl-mlp-ps-0.default.svc:2222"],
            "worker": [f"psctl-mlp-worker-{i}.default.svc:2222" for i in range(2)],
        },
        "task": {"type": task_type, "index": 0},
        "environment": "cloud",
    }
    assert parse_tf_config(json.dumps(tf_config)).task_type == task_type


def test_tfjob_chief_runs_psctl_train_with_flags_the_cli_knows():
    job = load_json_yaml(TFJOB)
    c = container(job, "Chief")
    assert c["command"] == ["psctl", "train"]
    args = cli.build_parser().parse_args([*c["command"][1:], *c["args"]])
    assert args.command == "train" and args.cluster is None  # TF_CONFIG from the operator
    assert args.control_address.startswith("127.0.0.1:")  # no authentication: loopback
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["metrics"] == args.metrics_port
    annotations = job["spec"]["tfReplicaSpecs"]["Chief"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(args.metrics_port)
    mounts = [m["mountPath"] for m in c["volumeMounts"]]
    assert any(args.checkpoint_dir.startswith(m + "/") for m in mounts), args.checkpoint_dir
    assert any(args.summary_json.startswith(m + "/") for m in mounts), args.summary_json
