"""A real Prometheus server scrapes psctl: targets up, series sane, rules and dashboard valid,
and the alerts fire (or stay silent) against real jobs: a clean finish, a NaN loss in every
training process (a restart loop).

Needs `prometheus` and `promtool` on PATH (tools/ensure-prometheus.sh installs them). The
tests never skip when they are missing: they fail and say how to install them.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from prometheus_client import CollectorRegistry, start_http_server

from bench.harness.promserver import Prometheus, http_get, wait_for
from psctl.cluster.ports import free_ports
from psctl.coordinator.operations.metrics import CoordinatorMetrics
from tests.conftest import REPO, child_env, kill_if_running, psctl_argv, require_tool
from tests.deploy.test_prometheus_rules import ALERTS as ALERT_NAMES
from tests.deploy.test_prometheus_rules import DASHBOARD

pytestmark = pytest.mark.integration

T = TypeVar("T")
# Grafana's variables, as the dashboard's queries use them.
GRAFANA_VARIABLES = {
    "$__rate_interval": "5s",
    "$__interval": "1s",
    "$__range": "1m",
}


def tool(name: str) -> str:
    return require_tool(
        name,
        "tools/ensure-prometheus.sh (installs the Debian package prometheus, which ships "
        "prometheus and promtool)",
    )


@pytest.fixture
def prometheus_factory(tmp_path: Path) -> Iterator[Callable[[list[dict[str, Any]]], Prometheus]]:
    started: list[Prometheus] = []

    def make(scrape_configs: list[dict[str, Any]]) -> Prometheus:
        server = Prometheus(
            tmp_path / f"prometheus-{len(started)}", scrape_configs, binary=tool("prometheus")
        )
        started.append(server)
        server.start()
        return server

    yield make
    for server in started:
        server.stop()


def check_metrics(text: str, source: str) -> None:
    """`promtool check metrics` (naming, HELP, units lint) finds no problem."""
    proc = subprocess.run(
        [tool("promtool"), "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=30,
    )
    report = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0 and not report, f"promtool check metrics {source}:\n{report}"


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query in the Grafana dashboard, variables filled in."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(name, value)
            assert "$" not in expr, f"unknown Grafana variable in {panel['title']!r}: {expr}"
            queries.append((panel["title"], expr))
    assert queries
    return queries


def check_dashboard_queries(prom: Prometheus) -> list[str]:
    """Run every dashboard query; returns the titles of panels with data."""
    errors, with_data = [], []
    for title, expr in dashboard_queries():
        try:
            if prom.query(expr):
                with_data.append(title)
        except AssertionError as err:
            errors.append(f"{title}: {expr}\n  {err}")
    assert not errors, "dashboard queries failed:\n" + "\n".join(errors)
    return with_data


def check_rules_healthy(prom: Prometheus) -> None:
    rules = prom.wait_rules_evaluated(timeout=30)
    assert {r["name"] for r in rules} >= ALERT_NAMES
    bad = [(r["name"], r["health"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad, bad


# -- CoordinatorMetrics alone, served by prometheus_client: fast ------------------------------


@contextlib.contextmanager
def serve(registry: CollectorRegistry) -> Iterator[int]:
    port = free_ports(1)[0]
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        yield port
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@contextlib.contextmanager
def training_simulation(metrics: CoordinatorMetrics) -> Iterator[None]:
    """A thread that drives the metrics as a training loop would, until the block ends."""
    stop = threading.Event()

    def loop() -> None:
        step = 0
        while not stop.wait(0.05):
            metrics.observe_call(steps=20, seconds=0.2)
            step += 20
            metrics.set_global_step(step)
            metrics.set_closures(in_flight=8, queued=2)
            if step % 400 == 0:
                metrics.observe_checkpoint(seconds=0.3, step=step, timestamp=time.time())

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


@pytest.mark.timeout(120)
def test_prometheus_scrapes_coordinator_metrics(prometheus_factory):
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(
        registry=registry, job="mlp", num_workers=2, num_ps=1, batch_size=64
    )
    metrics.set_state("running")
    metrics.set_target_steps(1_000_000)
    metrics.set_steps_per_execution(20)
    metrics.set_train_values({"loss": math.nan, "accuracy": 0.5})  # fires PsctlLossNaN
    metrics.set_eval_values({"loss": 0.1, "accuracy": 0.97}, step=20)
    with serve(registry) as port, training_simulation(metrics):
        check_metrics(http_get(f"http://127.0.0.1:{port}/metrics"), "CoordinatorMetrics")
        prom = prometheus_factory(
            [
                {
                    "job_name": "psctl-coordinator",
                    "static_configs": [
                        {
                            "targets": [f"127.0.0.1:{port}"],
                            "labels": {"task_type": "chief", "task_index": "0"},
                        }
                    ],
                }
            ]
        )
        prom.wait_targets_up(1, timeout=30)
        check_rules_healthy(prom)

        first = wait_for(
            "psctl_global_step", lambda: prom.value("psctl_global_step"), timeout=20, every=0.5
        )
        wait_for(
            "psctl_global_step to rise",
            lambda: (prom.value("psctl_global_step") or 0) > first,
            timeout=20,
        )
        # Enough samples for 5s rates and quantiles.
        rate = wait_for(
            "a steps/s rate",
            lambda: prom.value('sum(rate(psctl_train_steps_total{job="psctl-coordinator"}[5s]))'),
            timeout=20,
        )
        assert rate > 0
        p50 = prom.value(
            "histogram_quantile(0.5, sum by (le) (rate(psctl_step_duration_seconds_bucket[5s])))"
        )
        assert p50 is not None and 0.005 < p50 <= 0.01  # 0.2 s / 20 steps = 10 ms
        # Checkpoints (every 500 steps) show as "checkpointing" for a moment while training
        # goes on: running comes back within a scrape or two.
        wait_for(
            "psctl_coordinator_state running",
            lambda: prom.value('psctl_coordinator_state{state="running"}') == 1,
            timeout=20,
            every=0.5,
        )
        assert prom.value('psctl_task_info{task_type="chief"}') == 1
        assert prom.value('psctl_eval_metric{name="accuracy"}') == 0.97

        with_data = check_dashboard_queries(prom)
        for title in ("Steps / s", "Examples / s", "Step time", "Loss", "Metrics", "Tasks up"):
            assert title in with_data, (title, with_data)

        alerts = wait_for("PsctlLossNaN", lambda: prom.alerts("PsctlLossNaN"), timeout=20)
        assert alerts[0]["state"] in ("pending", "firing")
        assert alerts[0]["labels"]["job"] == "psctl-coordinator"


# -- a whole psctl local cluster -----------------------------------------------------------


class LineWatcher:
    """Reads a child's stderr in a thread (so the pipe never fills) and watches for a line."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        self.stream = proc.stderr
        self.lines: list[str] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.stream:
            with self.lock:
                self.lines.append(line)

    def seen(self, needle: str) -> bool:
        with self.lock:
            return any(needle in line for line in self.lines)

    def tail(self, count: int = 40) -> str:
        with self.lock:
            return "".join(self.lines[-count:])


def read_targets(path: Path) -> list[dict[str, Any]] | None:
    if not path.is_file():
        return None
    groups = json.loads(path.read_text())  # ValueError while half written: polled again
    jobs = {g["labels"]["job"] for g in groups}
    return groups if "psctl-coordinator" in jobs else None


class LocalJob:
    """``psctl local`` in a subprocess, its stderr watched; fails fast if it exits early."""

    def __init__(self, workdir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.proc = subprocess.Popen(
            psctl_argv("local", "--workdir", str(workdir), *args),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env or child_env(),
        )
        self.watcher = LineWatcher(self.proc)

    def running(self, check: Callable[[], T | None]) -> Callable[[], T | None]:
        """``check``, failing at once (with psctl local's last lines) once it has exited."""

        def guarded() -> T | None:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"psctl local exited with {self.proc.returncode}:\n{self.watcher.tail()}"
                )
            return check()

        return guarded

    def wait_for_targets(self, *, timeout: float) -> tuple[Path, list[dict[str, Any]]]:
        targets_file = self.workdir / "targets.json"
        try:
            groups = wait_for(
                f"{targets_file} (psctl local writes it once its servers are up)",
                self.running(lambda: read_targets(targets_file)),
                timeout=timeout,
            )
        except AssertionError as err:
            raise AssertionError(f"{err}\npsctl local stderr:\n{self.watcher.tail()}") from None
        return targets_file, groups

    def kill(self) -> None:
        kill_if_running(self.proc, 10)


@pytest.mark.timeout(240)
def test_psctl_local_is_scraped_by_prometheus(workdir, prometheus_factory):
    tool("prometheus")
    tool("promtool")
    job = LocalJob(workdir, "--steps", "100000", "--log-every", "1")
    proc, watcher = job.proc, job.watcher
    try:
        targets_file, groups = job.wait_for_targets(timeout=150)
        assert len(groups) == 4, groups  # coordinator + 1 ps + 2 workers
        by_job: dict[str, int] = {}
        for group in groups:
            assert set(group["labels"]) >= {"job", "task_type", "task_index"}, group
            assert len(group["targets"]) == 1 and re.fullmatch(
                r"127\.0\.0\.1:\d+", group["targets"][0]
            ), group
            by_job[group["labels"]["job"]] = by_job.get(group["labels"]["job"], 0) + 1
        assert by_job == {"psctl-coordinator": 1, "psctl-ps": 1, "psctl-worker": 2}, by_job

        wait_for(
            "the first 'train | step:' line",
            job.running(lambda: watcher.seen("train | step:")),
            timeout=120,
        )

        prom = prometheus_factory(
            [{"job_name": "psctl", "file_sd_configs": [{"files": [str(targets_file)]}]}]
        )
        targets = prom.wait_targets_up(4, timeout=60)
        assert sorted(t["labels"]["job"] for t in targets) == [
            "psctl-coordinator",
            "psctl-ps",
            "psctl-worker",
            "psctl-worker",
        ]
        up = prom.query('up{job=~"psctl-.*"}')
        assert len(up) == 4 and all(float(s["value"][1]) == 1 for s in up), up

        for group in groups:
            address = group["targets"][0]
            text = http_get(f"http://{address}/metrics")
            check_metrics(text, f"{group['labels']['job']} {address}")

        first = wait_for(
            "psctl_global_step from the coordinator",
            job.running(lambda: prom.value('psctl_global_step{job="psctl-coordinator"}')),
            timeout=30,
        )
        wait_for(
            "psctl_global_step to rise",
            job.running(
                lambda: (prom.value('psctl_global_step{job="psctl-coordinator"}') or 0) > first
            ),
            timeout=30,
            every=1.0,
        )
        assert prom.value('psctl_task_info{job="psctl-ps"}') == 1
        assert prom.value('count(psctl_task_info{job="psctl-worker"})') == 2
        assert (
            prom.value(
                'count(psctl_health_state{job=~"psctl-ps|psctl-worker",state="serving"} == 1)'
            )
            == 3
        )
        # Checkpoints (every 500 steps) show as "checkpointing" for a moment while training
        # goes on: running comes back within a scrape or two.
        wait_for(
            "psctl_coordinator_state running",
            lambda: prom.value('psctl_coordinator_state{state="running"}') == 1,
            timeout=20,
            every=0.5,
        )

        check_rules_healthy(prom)
        wait_for(
            "a steps/s rate",
            lambda: prom.value('sum(rate(psctl_train_steps_total{job="psctl-coordinator"}[5s]))'),
            timeout=20,
        )
        with_data = check_dashboard_queries(prom)
        for title in (
            "Steps / s",
            "Examples / s",
            "Step time",
            "Tasks up",
            "Coordinator state",
            "Stalls",
            "Server health",
        ):
            assert title in with_data, (title, with_data)
        for name in ("PsctlCoordinatorDown", "PsctlTrainingStalled", "PsctlMetricsMissing"):
            assert prom.alerts(name) == [], (name, prom.alerts(name))

        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=90)
        watcher.thread.join(timeout=10)
        assert proc.returncode == 0, watcher.tail()

        # A clean finish: the coordinator stayed until Prometheus saw DONE, so its exit is
        # no page (without that, PsctlCoordinatorDown is pending within two scrapes).
        assert prom.value('up{job="psctl-coordinator"}') is not None
        wait_for(
            "the coordinator's target to be down",
            lambda: prom.value('up{job="psctl-coordinator"}') == 0,
            timeout=15,
        )
        wait_for(
            "psctl:coordinator_finished",
            lambda: prom.value('psctl:coordinator_finished{job="psctl-coordinator"}') == 1,
            timeout=15,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            assert prom.alerts("PsctlCoordinatorDown") == [], prom.alerts("PsctlCoordinatorDown")
            time.sleep(1)
    finally:
        job.kill()


@pytest.mark.timeout(420)
def test_nan_loss_and_restart_loop_fire_against_a_real_poisoned_job(
    workdir, prometheus_factory, tmp_path
):
    # Every training process reads a NaN batch: each one publishes and counts the NaN loss,
    # exits 75, and the supervisor starts the next from the latest finite checkpoint, until
    # --max-restarts (4) is spent and the job ends FAILED.
    tool("prometheus")
    tool("promtool")
    marker = tmp_path / "poisoned"
    marker.write_text("every")
    job = LocalJob(
        workdir,
        "--job",
        str(REPO / "tests" / "jobs" / "poisoned.py"),
        "--steps",
        "100000",
        "--checkpoint-every",
        "300",
        "--max-restarts",
        "4",
        "--log-every",
        "2",
        env=child_env(PSCTL_TEST_POISON_MARKER=str(marker)),
    )
    try:
        targets_file, _ = job.wait_for_targets(timeout=150)
        prom = prometheus_factory(
            [{"job_name": "psctl", "file_sd_configs": [{"files": [str(targets_file)]}]}]
        )
        check_rules_healthy(prom)

        nan = wait_for(
            "PsctlLossNaN to fire", lambda: prom.firing("PsctlLossNaN"), timeout=240, every=1.0
        )
        assert nan[0]["labels"]["job"] == "psctl-coordinator", nan
        # Counted, and carried over: the count never went back at a restart.
        assert (prom.value('max(psctl_nonfinite_loss_total{job="psctl-coordinator"})') or 0) >= 1
        assert prom.value('resets(psctl_nonfinite_loss_total{job="psctl-coordinator"}[10m])') == 0

        loop = wait_for(
            "PsctlRestartLoop to fire",
            lambda: prom.firing("PsctlRestartLoop"),
            timeout=300,
            every=1.0,
        )
        assert loop[0]["labels"]["job"] == "psctl-coordinator", loop
        assert prom.value('resets(psctl_restarts_total{job="psctl-coordinator"}[10m])') == 0
        assert job.watcher.seen("training loss is nan") or job.watcher.seen("is not finite")

        # The budget runs out: the job ends FAILED. Its coordinator's last state was not
        # DONE, so its exit pages.
        job.proc.wait(timeout=300)
        assert job.proc.returncode != 0, job.watcher.tail()
        down = wait_for(
            "PsctlCoordinatorDown to be pending",
            lambda: prom.alerts("PsctlCoordinatorDown"),
            timeout=30,
        )
        assert down[0]["labels"]["job"] == "psctl-coordinator", down
    finally:
        job.kill()
