"""deploy/prometheus checked by promtool: scrape config, alert rules, and the rules' tests.

Needs `promtool` on PATH (tools/ensure-prometheus.sh installs it); fails, never skips,
when it is missing.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from prometheus_client import CollectorRegistry

from psctl.coordinator.operations.metrics import CoordinatorMetrics
from tests.conftest import REPO, require_tool

PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
DASHBOARD = REPO / "deploy" / "grafana" / "psctl.json"
RUNBOOK = REPO / "docs" / "runbook.md"
ALERTS = {
    "PsctlCoordinatorDown",
    "PsctlPsDown",
    "PsctlWorkerDown",
    "PsctlTrainingStalled",
    "PsctlWatchdogStall",
    "PsctlServerNotServing",
    "PsctlCheckpointTooOld",
    "PsctlLossNaN",
    "PsctlRestartLoop",
    "PsctlMetricsMissing",
    "PsctlTargetsMissing",
    "PsctlInputLagHigh",
    "PsctlPublishStale",
}
RECORDING_RULES = {"psctl:coordinator_finished"}


def promtool(*args: str) -> str:
    binary = require_tool(
        "promtool", "tools/ensure-prometheus.sh (installs the Debian package prometheus)"
    )
    proc = subprocess.run(
        [binary, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"promtool {' '.join(args)} failed:\n{output}"
    return output


@pytest.mark.timeout(90)
def test_scrape_config_is_valid_and_its_target_files_exist():
    output = promtool("check", "config", "deploy/prometheus/prometheus.yml")
    # A missing file_sd file is only a warning to promtool; here it is an error.
    assert "WARNING" not in output, output
    assert "SUCCESS: 1 rule files found" in output, output


@pytest.mark.timeout(90)
def test_alert_rules_are_valid():
    output = promtool("check", "rules", "deploy/prometheus/alerts.yml")
    assert f"SUCCESS: {len(ALERTS) + len(RECORDING_RULES)} rules found" in output, output
    text = (PROMETHEUS_DIR / "alerts.yml").read_text()
    assert set(re.findall(r"- alert: (\w+)\n", text)) == ALERTS
    assert set(re.findall(r"- record: ([\w:]+)\n", text)) == RECORDING_RULES


def rule_blocks() -> dict[str, str]:
    """Each alert's text in alerts.yml, by name (the file lists one rule per ``- `` item)."""
    text = (PROMETHEUS_DIR / "alerts.yml").read_text()
    blocks = re.split(r"\n      - (?=alert:|record:)", text)
    return {m.group(1): b for b in blocks if (m := re.match(r"alert: (\w+)\n", b))}


def markdown_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file."""
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


@pytest.mark.timeout(30)
def test_every_alert_links_its_runbook_section_and_has_a_severity():
    anchors = markdown_anchors(RUNBOOK.read_text())
    blocks = rule_blocks()
    assert set(blocks) == ALERTS
    for name, block in blocks.items():
        url = re.search(r"\n +runbook_url: (\S+)\n", block)
        assert url, f"{name} has no runbook_url"
        path, _, anchor = url.group(1).partition("#")
        assert path == "docs/runbook.md", (name, url.group(1))
        assert anchor == name.lower() and anchor in anchors, (name, anchor)
        assert re.search(r"\n +severity: (critical|warning)\n", block), name


@pytest.mark.timeout(90)
def test_alert_rule_unit_tests_pass():
    output = promtool("test", "rules", "deploy/prometheus/alerts_test.yml")
    assert "SUCCESS" in output, output


@pytest.mark.timeout(30)
def test_every_alert_is_tested_firing_and_not_firing():
    tests = (PROMETHEUS_DIR / "alerts_test.yml").read_text()
    checks = re.findall(r"alertname: (\w+)\n +exp_alerts:(.*)\n", tests)
    firing = {name for name, rest in checks if rest.strip() != "[]"}
    silent = {name for name, rest in checks if rest.strip() == "[]"}
    assert firing == ALERTS, sorted(ALERTS ^ firing)
    assert silent == ALERTS, sorted(ALERTS ^ silent)


def exported_series() -> set[str]:
    """Every psctl_* series name the coordinator (and so every process) exports."""
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(
        registry=registry, job="mlp", num_workers=2, num_ps=1, batch_size=64
    )
    # Series that appear only once reported.
    metrics.set_train_values({"loss": 1.0, "accuracy": 0.5})
    metrics.set_eval_values({"loss": 1.0, "accuracy": 0.5}, step=1)
    return {s.name for family in registry.collect() for s in family.samples}


@pytest.mark.timeout(30)
def test_rules_and_dashboard_name_only_series_that_exist():
    # A misspelt series is no query error, just an empty panel or an alert that never fires.
    exported = exported_series()
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    texts = {
        "alerts.yml": (PROMETHEUS_DIR / "alerts.yml").read_text(),
        "psctl.json": "\n".join(exprs),
    }
    for source, text in texts.items():
        named = set(re.findall(r"\bpsctl_[a-z_]+", text))
        assert named, source
        missing = sorted(named - exported)
        assert not missing, f"{source} names series nobody exports: {missing}"


@pytest.mark.timeout(30)
def test_dashboard_uses_a_datasource_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["async", "sync"])
def test_deploy_render_writes_prometheus_targets_of_every_process(tmp_path, strategy):
    """`psctl deploy render`: a scrape config promtool accepts, with file_sd targets at
    every process's /metrics (the servers' TF port + 2000; the coordinator's 9940)."""
    import json

    from psctl.coordinator.deploy.render import render, render_sync

    cluster = tmp_path / "cluster.json"
    hosts = {"chief": ["10.0.0.1:2222"], "ps": ["10.0.0.2:2222"]}
    hosts["worker"] = ["10.0.0.3:2222", "10.0.0.4:2223"]
    cluster.write_text(json.dumps({"cluster": hosts}))
    out = tmp_path / "out"
    options = {
        "cluster_file": str(cluster),
        "out": out,
        "bin_dir": "/opt/psctl/venv/bin",
        "keys": None,  # the targets are the same with the tunnel: its proxies keep the ports
    }
    if strategy == "sync":
        render_sync(**options, config_dir="/etc/psctl", force=False)
    else:
        render(**options)
    output = promtool("check", "config", str(out / "prometheus.yml"))
    assert "SUCCESS" in output and "WARNING" not in output, output

    def targets(role: str) -> list[tuple[str, str, str]]:
        entries = json.loads((out / f"prometheus-{role}.json").read_text())
        return [
            (e["targets"][0], e["labels"]["task_type"], e["labels"]["task_index"]) for e in entries
        ]

    if strategy == "async":
        assert targets("coordinator") == [("10.0.0.1:9940", "chief", "0")]
        assert targets("ps") == [("10.0.0.2:4222", "ps", "0")]
        assert targets("worker") == [
            ("10.0.0.3:4222", "worker", "0"),
            ("10.0.0.4:4223", "worker", "1"),
        ]
    else:  # worker 0 is the coordinator; the ps task is unused
        assert targets("coordinator") == [("10.0.0.3:9940", "chief", "0")]
        assert targets("ps") == [] and targets("worker") == [("10.0.0.4:4223", "worker", "1")]


@pytest.mark.timeout(60)
def test_the_sample_targets_are_what_render_writes_for_deploy_mds_cluster(tmp_path):
    """deploy/prometheus/targets/ holds `psctl deploy render`'s targets for the cluster file
    that docs/deploy.md shows (so the sample and the guide name the same hosts)."""
    import json
    import re

    from psctl.coordinator.deploy.render import render

    guide = (REPO / "docs" / "deploy.md").read_text()
    [cluster_text] = re.findall(r"## 2\. Write the cluster file.*?```json\n(.*?)```", guide, re.S)
    cluster = tmp_path / "cluster.json"
    cluster.write_text(cluster_text)
    out = tmp_path / "out"
    render(cluster_file=str(cluster), out=out, bin_dir="/opt/psctl/venv/bin", keys=None)
    for role in ("coordinator", "ps", "worker"):
        sample = json.loads(
            (REPO / "deploy" / "prometheus" / "targets" / f"{role}.json").read_text()
        )
        assert sample == json.loads((out / f"prometheus-{role}.json").read_text()), role
