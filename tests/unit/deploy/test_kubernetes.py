"""The Kubernetes manifests in deploy/kubernetes/, read as Kubernetes reads them.

The TFJob is validated against the training operator's CRD schema (a fixture, with the
source it was taken from) and its webhook's rules; its restart policies, probes, ports and
environment against what psctl's own parsers and servers do; the PodMonitor's relabeling,
applied the way the Prometheus Operator and Prometheus apply it, against the job labels
the alert rules and the dashboard select. promtool checks the scrape config it amounts to
(the Debian package `prometheus`, tools/ensure-prometheus.sh): that test fails, never
skips, without it.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from psctl.cluster import server as server_cli
from psctl.cluster.errors import EXIT_CONFIG, ConfigError
from psctl.cluster.tf_config import parse_tf_config
from psctl.coordinator import failures, settings
from psctl.coordinator.cli import main as cli
from psctl.coordinator.launch import train
from tests.conftest import REPO, require_tool

KUBE = REPO / "deploy" / "kubernetes"
TFJOB = KUBE / "tfjob.yaml"
PVC = KUBE / "checkpoints-pvc.yaml"
PDB = KUBE / "pdb.yaml"
PODMONITOR = KUBE / "podmonitor.yaml"
DOCKERFILE = KUBE / "Dockerfile"
JOB_DOCKERFILE = KUBE / "Dockerfile.job"
EVALUATE_JOB = KUBE / "evaluate-job.yaml"
EXPORT_JOB = KUBE / "export-job.yaml"
NETWORK_POLICY = KUBE / "networkpolicy.yaml"
# The core kinds are checked against Kubernetes' own OpenAPI schemas (kubernetes-validate,
# offline) for the oldest release the probes need (grpc probes GA) and the newest it knows.
CORE_KINDS = {"PersistentVolumeClaim", "PodDisruptionBudget", "Job", "NetworkPolicy"}
CRD_SCHEMA = REPO / "tests" / "fixtures" / "tfjob-crd-openapi-v1.9.yaml"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
DASHBOARDS = sorted((REPO / "deploy" / "grafana").glob("*.json"))

NAMESPACE = "training"
# What the operator knows (kubeflow.org/v1 TFJob replica types) and its names for them.
REPLICA_TYPES = {"Chief", "Master", "PS", "Worker", "Evaluator"}
CONTAINER = "tensorflow"  # TFJobDefaultContainerName: TF_CONFIG and the exit code
PORT_NAME = "tfjob-port"  # TFJobDefaultPortName: the port in TF_CONFIG and the Service
# How the operator judges a container's exit code under restartPolicy ExitCode
# (pkg/util/train.IsRetryableExitCode): 1-127 permanent, 128-255 retried with a new pod.
RETRYABLE_FROM = 128
JOB_OF_COMPONENT = {
    "coordinator": "psctl-coordinator",
    "ps": "psctl-ps",
    "worker": "psctl-worker",
}


def documents(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def has_aliases(path: Path) -> bool:
    """Whether a node appears twice (an *alias of an &anchor): kubectl follows them, but
    people editing one copy change the other without seeing it."""
    seen: set[int] = set()

    def walk(node: yaml.Node) -> bool:
        if id(node) in seen:
            return True
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            return any(walk(k) or walk(v) for k, v in node.value)
        if isinstance(node, yaml.SequenceNode):
            return any(walk(item) for item in node.value)
        return False

    with path.open() as f:
        return any(walk(doc) for doc in yaml.compose_all(f) if doc is not None)


def one(path: Path) -> dict[str, Any]:
    (doc,) = documents(path)
    return doc


def replica_specs() -> dict[str, dict[str, Any]]:
    return one(TFJOB)["spec"]["tfReplicaSpecs"]


def pod_spec(replica: str) -> dict[str, Any]:
    return replica_specs()[replica]["template"]["spec"]


def container(replica: str) -> dict[str, Any]:
    (only,) = pod_spec(replica)["containers"]
    return only


def named_ports(c: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c["ports"]}


POD_IP = "10.244.0.7"  # what the downward API's fieldRef status.podIP gives


def env_of(c: dict[str, Any]) -> dict[str, str]:
    env = {}
    for e in c.get("env", []):
        if "value" not in e:
            assert e["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}, e
        env[e["name"]] = e.get("value", POD_IP)
    return env


def operator_tf_config(job: dict[str, Any], replica: str, index: int) -> str:
    """TF_CONFIG as the operator writes it (genTFConfigJSONStr): every replica type in
    lower case, hosts <job>-<type>-<index>.<namespace>.svc:<tfjob-port>, "environment"."""
    cluster = {}
    for rtype, spec in job["spec"]["tfReplicaSpecs"].items():
        (tf_container,) = [
            c for c in spec["template"]["spec"]["containers"] if c["name"] == CONTAINER
        ]
        port = named_ports(tf_container)[PORT_NAME]
        rt = rtype.lower()
        cluster[rt] = [
            f"{job['metadata']['name']}-{rt}-{i}.{NAMESPACE}.svc:{port}"
            for i in range(spec.get("replicas", 1))
        ]
    task = {"type": replica.lower(), "index": index}
    return json.dumps({"cluster": cluster, "task": task, "environment": "cloud"})


# ---------------------------------------------------------------- YAML and the CRD schema


def test_every_manifest_is_plain_yaml_with_psctl_labels():
    manifests = sorted(KUBE.glob("*.yaml"))
    assert {p.name for p in manifests} == {
        "tfjob.yaml",
        "checkpoints-pvc.yaml",
        "pdb.yaml",
        "podmonitor.yaml",
        "evaluate-job.yaml",
        "export-job.yaml",
        "networkpolicy.yaml",
    }
    kinds = set()
    for path in manifests:
        code = [ln for ln in path.read_text().splitlines() if ln.strip() and ln[0] != "#"]
        assert not code[0].startswith("{"), f"{path.name} is JSON, not YAML"
        assert not has_aliases(path), f"{path.name}: plain YAML, without anchors and aliases"
        for doc in documents(path):
            kinds.add(doc["kind"])
            assert doc["apiVersion"] and doc["metadata"]["name"], path.name
            assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "psctl", path.name
    assert kinds == {
        "TFJob",
        "PersistentVolumeClaim",
        "PodDisruptionBudget",
        "PodMonitor",
        "Job",
        "NetworkPolicy",
    }


def strict(schema: Any) -> Any:
    """The CRD schema with unknown fields rejected, as `kubectl apply`'s server-side field
    validation does (the API server would otherwise drop them silently). Subtrees the
    fixture abbreviates, and free-form ones, accept anything."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
        and not schema.get("x-psctl-abbreviated")
    ):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def crd_validator() -> jsonschema.Draft7Validator:
    schema = strict(yaml.safe_load(CRD_SCHEMA.read_text()))
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def schema_errors(validator: jsonschema.Draft7Validator, doc: dict[str, Any]) -> list[str]:
    return [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.path)))
    ]


def test_tfjob_is_valid_against_the_tfjob_crd_schema(crd_validator):
    job = one(TFJOB)
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "TFJob")
    assert schema_errors(crd_validator, job) == []


_DELETE = object()
_PS_CONTAINER = "spec.tfReplicaSpecs.PS.template.spec.containers.0"


def _set(doc: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node: Any = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value


@pytest.mark.parametrize(
    ("path", "value", "complaint"),
    [
        # A typo the API server would drop without a word: the probe would be gone.
        (f"{_PS_CONTAINER}.readinesProbe", {"grpc": {"port": 3222}}, "readinesProbe"),
        # gRPC probes take a port number only, never a port's name.
        (f"{_PS_CONTAINER}.livenessProbe.grpc.port", "health", "is not of type 'integer'"),
        ("spec.tfReplicaSpecs.Worker.replicas", "2", "is not of type 'integer'"),
        ("spec.tfReplicaSpecs.Chief.template.spec.containers", _DELETE, "'containers'"),
        ("spec.tfReplicaSpecs", _DELETE, "'tfReplicaSpecs' is a required property"),
        ("spec.runPolicy.backoffLimits", 3, "backoffLimits"),
        (f"{_PS_CONTAINER}.resources.limits.memory", "8 GiB", "does not match"),
    ],
)
def test_the_crd_schema_rejects_what_the_api_server_would(crd_validator, path, value, complaint):
    """The fixture is not vacuous: broken copies of the TFJob fail, naming the field."""
    job = copy.deepcopy(one(TFJOB))
    _set(job, path, value)
    errors = schema_errors(crd_validator, job)
    assert any(complaint in e for e in errors), errors


def test_tfjob_passes_the_operators_webhook_rules():
    """pkg/webhooks/tensorflow: a DNS-1035 name, a "tensorflow" container with an image in
    every replica, at most one Chief or Master; and replica types the operator knows."""
    job = one(TFJOB)
    name = job["metadata"]["name"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63, name
    replicas = job["spec"]["tfReplicaSpecs"]
    assert set(replicas) <= REPLICA_TYPES
    assert len(set(replicas) & {"Chief", "Master"}) <= 1
    for rtype, spec in replicas.items():
        containers = spec["template"]["spec"]["containers"]
        assert [c["name"] for c in containers] == [CONTAINER], rtype
        assert all(c.get("image") for c in containers), rtype
        assert spec["template"]["spec"].get("restartPolicy") is None, rtype  # the operator's


# ---------------------------------------------------------------- restart policies


def test_chief_final_statuses_are_permanent_under_exit_code_and_75_never_reaches_it():
    """ExitCode: 1-127 fail the TFJob, 128-255 get a new pod. `psctl train` (without --once)
    supervises the training process, so status 75 (restart from the latest checkpoint)
    stays inside the container; whatever the container ends with is final."""
    chief = replica_specs()["Chief"]
    assert chief["replicas"] == 1
    assert chief["restartPolicy"] == "ExitCode"
    c = container("Chief")
    args = cli.build_parser().parse_args([*c["command"][1:], *c["args"]])
    assert c["command"] == ["psctl", "train"] and not args.once

    # 130 (stopped by a signal before the job finished) is 128 + SIGINT: a new pod resumes
    # the job. On Kubernetes that signal comes with the pod's deletion (an eviction); a job
    # is ended with `psctl stop` (exit 0) or by deleting the TFJob.
    assert failures.EXIT_INTERRUPTED >= RETRYABLE_FROM
    final = set(failures.FINAL_EXIT_STATUSES) - {failures.EXIT_INTERRUPTED}
    assert {EXIT_CONFIG, failures.EXIT_USAGE} <= final
    for status in final:
        assert 0 < status < RETRYABLE_FROM, f"exit {status} would be retried by the operator"
    assert failures.EXIT_RESTART not in final  # handled by psctl's own supervisor


def test_servers_restart_in_place_within_the_jobs_backoff_limit():
    """A server exits 0 on SIGTERM, as after a liveness kill: under ExitCode its pod would
    be Succeeded and never started again. Always restarts it in place; backoffLimit counts
    those restarts. Finished jobs delete their running servers."""
    for replica in ("PS", "Worker"):
        spec = replica_specs()[replica]
        assert spec["restartPolicy"] == "Always", replica
        assert spec["replicas"] >= 1
    run_policy = one(TFJOB)["spec"]["runPolicy"]
    assert run_policy["cleanPodPolicy"] == "Running"
    assert run_policy["backoffLimit"] > 0


# ---------------------------------------------------------------- servers: TF_CONFIG, probes


@pytest.mark.parametrize(("replica", "task_type"), [("PS", "ps"), ("Worker", "worker")])
def test_probes_and_ports_are_the_ones_the_server_listens_on(replica, task_type):
    """The server resolves its ports from the operator's TF_CONFIG exactly as in the pod:
    every probe is a gRPC health check on its health port; the metrics port is named."""
    job = one(TFJOB)
    c = container(replica)
    assert c["command"] == [f"{task_type}-server"]
    args = server_cli.build_parser(task_type).parse_args(c["args"])
    environ = {**env_of(c), "TF_CONFIG": operator_tf_config(job, replica, 0)}
    opts = server_cli.resolve_options(task_type, args, environ)
    assert opts.task.task_type == task_type
    assert opts.bind_host == POD_IP  # side ports on the pod's IP, not every interface
    ports = named_ports(c)
    assert ports[PORT_NAME] == opts.task.port
    assert ports["health"] == opts.health_port
    assert ports["metrics"] == opts.metrics_port
    assert len(set(ports.values())) == len(ports)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": opts.health_port}, probe
    # Long enough for TensorFlow's import: liveness starts only once startup passed.
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120


def test_every_replica_reads_the_operators_tf_config_as_its_task():
    job = one(TFJOB)
    for rtype, spec in job["spec"]["tfReplicaSpecs"].items():
        for index in range(spec["replicas"]):
            task = parse_tf_config(operator_tf_config(job, rtype, index))
            assert (task.task_type, task.task_index) == (rtype.lower(), index)
            assert task.port == named_ports(container(rtype))[PORT_NAME]


# ---------------------------------------------------------------- the Chief


def test_chief_runs_psctl_train_with_flags_the_cli_knows(monkeypatch):
    c = container("Chief")
    args = cli.build_parser().parse_args([*c["command"][1:], *c["args"]])
    assert args.command == "train" and args.cluster is None  # TF_CONFIG from the operator
    job = one(TFJOB)
    monkeypatch.setenv("TF_CONFIG", operator_tf_config(job, "Chief", 0))
    cluster, source = train.resolve_chief_cluster(args.cluster)
    assert source == "TF_CONFIG"
    assert (cluster.num_ps, cluster.num_workers) == (
        replica_specs()["PS"]["replicas"],
        replica_specs()["Worker"]["replicas"],
    )
    assert args.control_address.startswith("127.0.0.1:")  # no authentication: loopback
    ports = named_ports(c)
    assert ports["metrics"] == args.metrics_port == settings.DEFAULT_METRICS_PORT
    assert PORT_NAME in ports
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    for path in (args.checkpoint_dir, args.summary_json):
        assert any(path.startswith(m + "/") for m in mounts), path
    volumes = {v["name"]: v for v in pod_spec("Chief")["volumes"]}
    state = volumes[mounts["/var/lib/psctl"]]
    assert state["persistentVolumeClaim"]["claimName"] == one(PVC)["metadata"]["name"]
    # The graceful stop (in-flight steps, checkpoint, evaluation) gets what systemd gives it.
    assert pod_spec("Chief")["terminationGracePeriodSeconds"] >= 300


def test_containers_are_psctl_programs_with_their_volumes():
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for replica in replica_specs():
        c = container(replica)
        assert c["command"][0] in scripts, replica
        volumes = {v["name"] for v in pod_spec(replica).get("volumes", [])}
        assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes, replica
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}, replica
        assert env_of(c)["HOME"] == "/tmp"


def test_no_psctl_variable_reaches_psctl_that_it_would_reject():
    """psctl rejects unknown PSCTL_* variables (exit 78). Kubernetes' Service links would
    add <SERVICE>_SERVICE_HOST and the like for every Service in the namespace, and a
    Service named psctl-... yields PSCTL_..._SERVICE_HOST: every pod turns them off."""
    for replica in replica_specs():
        assert pod_spec(replica)["enableServiceLinks"] is False, replica
        env = env_of(container(replica))
        assert "TF_CONFIG" not in env  # the operator's
        settings.check_environ(env)
    with pytest.raises(ConfigError):
        settings.check_environ({"PSCTL_MLP_PS_0_SERVICE_HOST": "10.96.0.7"})


def test_pdb_keeps_evictions_from_the_chief_only():
    """The operator counts a Chief that exits 0 (as after SIGTERM) as the TFJob Succeeded.
    minAvailable as a number: a TFJob has no scale subresource for maxUnavailable."""
    pdb = one(PDB)
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["minAvailable"] == 1 and "maxUnavailable" not in pdb["spec"]
    selector = pdb["spec"]["selector"]["matchLabels"]
    chosen = [
        r
        for r, spec in replica_specs().items()
        if selector.items() <= spec["template"]["metadata"]["labels"].items()
    ]
    assert chosen == ["Chief"]


# ---------------------------------------------------------------- PodMonitor and the rules


def sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def discovered_targets(job: dict[str, Any]) -> Iterator[dict[str, str]]:
    """Prometheus' kubernetes_sd role "pod": one target per container port of every pod the
    operator creates, with the labels it adds to them (training.kubeflow.org/*)."""
    name = job["metadata"]["name"]
    ip = 10
    for rtype, spec in job["spec"]["tfReplicaSpecs"].items():
        template = spec["template"]
        rt = rtype.lower()
        for index in range(spec["replicas"]):
            ip += 1
            labels = {
                **template["metadata"]["labels"],
                "training.kubeflow.org/job-name": name,
                "training.kubeflow.org/operator-name": "tfjob-controller",
                "training.kubeflow.org/replica-type": rt,
                "training.kubeflow.org/replica-index": str(index),
            }
            pod = {
                "__meta_kubernetes_namespace": NAMESPACE,
                "__meta_kubernetes_pod_name": f"{name}-{rt}-{index}",
                "__meta_kubernetes_pod_ip": f"10.0.0.{ip}",
                "__meta_kubernetes_pod_phase": "Running",
            }
            for key, value in labels.items():
                pod[f"__meta_kubernetes_pod_label_{sanitize(key)}"] = value
                pod[f"__meta_kubernetes_pod_labelpresent_{sanitize(key)}"] = "true"
            for c in template["spec"]["containers"]:
                for port in c["ports"]:
                    yield {
                        **pod,
                        "__address__": f"10.0.0.{ip}:{port['containerPort']}",
                        "__meta_kubernetes_pod_container_name": c["name"],
                        "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                        "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                        "__meta_kubernetes_pod_container_port_protocol": "TCP",
                    }


def podmonitor_relabel_configs(monitor: dict[str, Any], endpoint: dict[str, Any]) -> list:
    """The relabel_configs the Prometheus Operator writes for one podMetricsEndpoint
    (generatePodMonitorConfig): running pods, the selector, the port, namespace/container/
    pod labels, job = <namespace>/<name>, endpoint; the endpoint's relabelings last."""
    configs: list[dict[str, Any]] = [
        {
            "action": "drop",
            "source_labels": ["__meta_kubernetes_pod_phase"],
            "regex": "(Failed|Succeeded)",
        }
    ]
    for key in sorted(monitor["spec"]["selector"]["matchLabels"]):
        configs.append(
            {
                "action": "keep",
                "source_labels": [
                    f"__meta_kubernetes_pod_label_{sanitize(key)}",
                    f"__meta_kubernetes_pod_labelpresent_{sanitize(key)}",
                ],
                "regex": f"({monitor['spec']['selector']['matchLabels'][key]});true",
            }
        )
    configs += [
        {
            "action": "keep",
            "source_labels": ["__meta_kubernetes_pod_container_port_name"],
            "regex": endpoint["port"],
        },
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"target_label": "job", "replacement": f"{NAMESPACE}/{monitor['metadata']['name']}"},
        {"target_label": "endpoint", "replacement": endpoint["port"]},
    ]
    snake = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    for relabeling in endpoint.get("relabelings", []):
        configs.append({snake.get(k, k): v for k, v in relabeling.items()})
    return configs


def _expand(template: str, match: re.Match[str]) -> str:
    """Go's regexp Expand, as Prometheus uses it: $1, ${1}, $name; $$ is a dollar."""

    def group(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        key = m.group(1) or m.group(2)
        try:
            return match.group(int(key) if key.isdigit() else key) or ""
        except IndexError:  # no such group: empty, as in Go
            return ""

    return re.sub(r"\$\$|\$\{(\w+)\}|\$(\w+)", group, template)


def relabel(labels: dict[str, str], configs: list[dict[str, Any]]) -> dict[str, str] | None:
    """Prometheus' target relabeling for the actions used here (replace, keep, drop), then
    its defaults: instance from __address__, and no label that starts with __."""
    labels = dict(labels)
    for cfg in configs:
        action = cfg.get("action", "replace").lower()
        value = cfg.get("separator", ";").join(
            labels.get(s, "") for s in cfg.get("source_labels", [])
        )
        match = re.fullmatch(cfg.get("regex", "(.*)"), value)
        if (action == "keep" and match is None) or (action == "drop" and match is not None):
            return None
        if action == "replace" and match is not None:
            result = _expand(cfg.get("replacement", "$1"), match)
            target = _expand(cfg["target_label"], match)
            if result:
                labels[target] = result
            else:
                labels.pop(target, None)
        elif action not in ("keep", "drop", "replace"):
            raise AssertionError(f"relabel action {action!r} is not simulated here")
    labels.setdefault("instance", labels["__address__"])
    return {k: v for k, v in labels.items() if not k.startswith("__")}


def scraped_targets() -> list[dict[str, str]]:
    monitor = one(PODMONITOR)
    job = one(TFJOB)
    # A pod of another TFJob in the namespace, which must not be scraped.
    other = copy.deepcopy(job)
    other["metadata"]["name"] = "other"
    for spec in other["spec"]["tfReplicaSpecs"].values():
        spec["template"]["metadata"]["labels"]["app.kubernetes.io/instance"] = "other"
    found = []
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        configs = podmonitor_relabel_configs(monitor, endpoint)
        for target in [*discovered_targets(job), *discovered_targets(other)]:
            kept = relabel(target, configs)
            if kept is not None:
                found.append({**kept, "__address__": target["__address__"]})
    return found


def test_podmonitor_gives_every_pod_one_target_with_the_rules_job_label():
    monitor = one(PODMONITOR)
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    job = one(TFJOB)
    targets = {t["instance"]: t for t in scraped_targets()}
    expected_pods = {
        f"{job['metadata']['name']}-{rtype.lower()}-{i}": rtype
        for rtype, spec in replica_specs().items()
        for i in range(spec["replicas"])
    }
    assert set(targets) == set(expected_pods)  # one per pod, none of the other job
    for pod, rtype in expected_pods.items():
        t = targets[pod]
        component = replica_specs()[rtype]["template"]["metadata"]["labels"][
            "app.kubernetes.io/component"
        ]
        assert t["job"] == JOB_OF_COMPONENT[component], t
        assert t["task_type"] == rtype.lower()
        assert t["task_index"] == pod.rsplit("-", 1)[1]
        assert t["namespace"] == NAMESPACE and t["pod"] == pod
        # The scraped port is the one the process serves /metrics on.
        assert t["__address__"].endswith(f":{named_ports(container(rtype))['metrics']}")


def job_matchers(expr: str) -> list[tuple[str, str]]:
    return re.findall(r'\bjob\s*(=~|!~|!=|=)\s*"([^"]*)"', expr)


def rule_and_dashboard_exprs() -> Iterator[tuple[str, str]]:
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            yield f"{ALERTS.name}: {rule.get('alert') or rule.get('record')}", str(rule["expr"])

    def walk(node: Any, where: str) -> Iterator[tuple[str, str]]:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "expr" and isinstance(value, str):
                    yield where, value
                else:
                    yield from walk(value, where)
        elif isinstance(node, list):
            for item in node:
                yield from walk(item, where)

    for path in DASHBOARDS:
        yield from walk(json.loads(path.read_text()), path.name)


def test_rules_and_dashboard_select_the_job_labels_the_podmonitor_gives():
    produced = {t["job"] for t in scraped_targets()}
    assert produced == set(JOB_OF_COMPONENT.values())
    selected: set[str] = set()
    count = 0
    for where, expr in rule_and_dashboard_exprs():
        for op, value in job_matchers(expr):
            if "$" in value or op in ("!=", "!~"):
                continue  # a dashboard variable, or a negative matcher
            count += 1
            hits = {j for j in produced if (j == value if op == "=" else re.fullmatch(value, j))}
            assert hits, f'{where}: job{op}"{value}" matches no target on Kubernetes'
            selected |= hits
    assert count > 0
    assert selected == produced  # every role's series is used somewhere


def test_podmonitor_relabeling_is_a_valid_prometheus_scrape_config(tmp_path):
    """The scrape job the operator generates from the PodMonitor, checked by promtool
    (RE2 regexes, label names, actions). Debian's promtool is built without Kubernetes
    discovery, so the job lists its targets statically: the relabel_configs are the point."""
    promtool = require_tool("promtool", "tools/ensure-prometheus.sh")
    monitor = one(PODMONITOR)
    jobs = [
        {
            "job_name": f"podMonitor/{NAMESPACE}/{monitor['metadata']['name']}/{i}",
            "static_configs": [{"targets": [t["__address__"] for t in scraped_targets()]}],
            "metrics_path": endpoint.get("path", "/metrics"),
            "scrape_interval": endpoint.get("interval", "30s"),
            "relabel_configs": podmonitor_relabel_configs(monitor, endpoint),
        }
        for i, endpoint in enumerate(monitor["spec"]["podMetricsEndpoints"])
    ]
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"scrape_configs": jobs}))
    proc = subprocess.run(
        [promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------- the image


def dockerfile_copies() -> list[tuple[list[str], str]]:
    copies = []
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY "):
            words = [w for w in shlex.split(line)[1:] if not w.startswith("--")]
            copies.append((words[:-1], words[-1]))
    return copies


def test_dockerfile_copies_enough_to_build_the_package(tmp_path):
    """What the Dockerfile copies, laid out as it copies it (links kept), builds the wheel
    with every part of the one import name psctl, and its TensorFlow extra exists."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    root = tmp_path / "image"
    for sources, dest in dockerfile_copies():
        for source in sources:
            src = REPO / source
            target = root / dest.lstrip("/")
            if dest.endswith("/"):
                target = target / src.name
            target.parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
                shutil.copytree(src, target, symlinks=True, ignore=ignore)
            else:
                shutil.copy2(src, target)
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    default = re.search(r"^ARG TENSORFLOW=(\S+)$", DOCKERFILE.read_text(), re.M)
    assert default and default.group(1) in extras
    assert '"/src[${TENSORFLOW}]"' in DOCKERFILE.read_text()

    wheel_argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    proc = subprocess.run(
        [*wheel_argv, "--quiet", "-w", str(tmp_path / "dist"), str(root / "src")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("psctl-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        scripts = zf.read(entry_points).decode()
    for module in (
        "psctl/cluster/server.py",
        "psctl/coordinator/cli/main.py",
        "psctl/ps_server/main.py",
        "psctl/worker_server/main.py",
        "psctl/jobs/mlp.py",
    ):
        assert module in names, module
    assert any(n.startswith("psctl/control/v1/") and n.endswith("_pb2.py") for n in names)
    assert {n.split("/")[0] for n in names if not n.startswith("psctl-")} == {"psctl"}
    for script in ("psctl", "ps-server", "worker-server"):
        assert re.search(rf"^{script} = ", scripts, re.M), script


@pytest.mark.parametrize("version", ["1.27", "latest"])
def test_core_manifests_are_valid_kubernetes_objects(version: str):
    """What `kubectl apply --dry-run=server` would check of the core objects, offline:
    every field known, every type right (strict: no unknown fields)."""
    import kubernetes_validate

    release = kubernetes_validate.latest_version() if version == "latest" else version
    checked = set()
    for path in sorted(KUBE.glob("*.yaml")):
        for doc in documents(path):
            if doc["kind"] in CORE_KINDS:
                kubernetes_validate.validate(doc, release, strict=True)  # raises if not
                checked.add(doc["kind"])
    assert checked == CORE_KINDS


def test_no_istio_sidecar_in_any_psctl_pod():
    """Kubeflow's TFJob docs: Istio's sidecar must stay out of a TFJob's pods."""
    templates = [spec["template"] for spec in replica_specs().values()]
    templates += [one(path)["spec"]["template"] for path in (EVALUATE_JOB, EXPORT_JOB)]
    for template in templates:
        annotations = template["metadata"].get("annotations", {})
        assert annotations.get("sidecar.istio.io/inject") == "false", template["metadata"]


def test_the_evaluator_and_the_export_read_the_chiefs_checkpoints_from_a_shared_volume():
    claim = one(PVC)
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # pods on other nodes too
    chief = cli.build_parser().parse_args(
        [*container("Chief")["command"][1:], *container("Chief")["args"]]
    )
    for path, command, writes in ((EVALUATE_JOB, "evaluate", False), (EXPORT_JOB, "export", True)):
        job = one(path)
        spec = job["spec"]["template"]["spec"]
        [c] = spec["containers"]
        assert c["image"] == container("Chief")["image"]
        args = cli.build_parser().parse_args([*c["command"][1:], *c["args"]])
        assert args.command == command
        assert args.checkpoint_dir == chief.checkpoint_dir and args.job == chief.job
        volumes = {v["name"]: v for v in spec["volumes"]}
        [state] = [m for m in c["volumeMounts"] if m["mountPath"] == "/var/lib/psctl"]
        volume = volumes[state["name"]]["persistentVolumeClaim"]
        assert volume["claimName"] == claim["metadata"]["name"]
        assert state["readOnly"] is (not writes) and volume["readOnly"] is (not writes)
        if writes:
            assert args.out.startswith("/var/lib/psctl/")
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert spec["enableServiceLinks"] is False and env_of(c)["HOME"] == "/tmp"


def test_a_users_job_goes_into_an_image_made_from_psctls():
    text = JOB_DOCKERFILE.read_text()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert lines[0] == f"ARG BASE={container('Chief')['image']}"
    assert "FROM ${BASE}" in lines and "COPY ${JOB} /opt/psctl/jobs/" in lines
    # The documented --job path is one psctl loads as a file.
    assert "--job /opt/psctl/jobs/my_job.py" in text


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector of matchLabels only (what psctl's manifests use) against labels."""
    assert set(selector) <= {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def test_only_the_jobs_own_pods_reach_its_tf_ports():
    """networkpolicy.yaml covers every pod of the TFJob; its TF and health ports admit the
    job's own pods and nothing wider (no rule without `from`, no namespace or IP block);
    /metrics admits Prometheus' pods only; every named port is one the pods declare."""
    policy = one(NETWORK_POLICY)["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    pods = {name: spec["template"]["metadata"]["labels"] for name, spec in replica_specs().items()}
    for name, labels in pods.items():
        assert selects(policy["podSelector"], labels), f"{name} pods are not covered"
    declared = {p["name"] for r in replica_specs() for p in container(r).get("ports", [])}
    admitted: dict[str, list[dict[str, Any]]] = {}
    for rule in policy["ingress"]:
        assert rule.get("from"), f"a rule without `from` admits every pod: {rule}"
        for port in rule["ports"]:
            assert port["protocol"] == "TCP" and port["port"] in declared, port
            admitted.setdefault(port["port"], []).extend(rule["from"])
    assert set(admitted) == {PORT_NAME, "health", "metrics"}
    for name in (PORT_NAME, "health"):
        for peer in admitted[name]:
            assert set(peer) == {"podSelector"}, f"{name} admits more than pods: {peer}"
            assert all(selects(peer["podSelector"], labels) for labels in pods.values())
            stranger = {"app.kubernetes.io/name": "psctl", "app.kubernetes.io/instance": "other"}
            assert not selects(peer["podSelector"], stranger), f"{name}: another job's pods"
    for peer in admitted["metrics"]:
        assert peer["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
