"""A Prometheus server of its own (a free loopback port, its own config and storage) that
scrapes psctl and evaluates deploy/prometheus/alerts.yml: the real-Prometheus tests
(tests/integration/operations/test_prometheus.py) and bench/soak.py share it. Needs ``prometheus``
on PATH (tools/ensure-prometheus.sh installs it)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from psctl.cluster.ports import free_ports

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"


T = TypeVar("T")


def wait_for(what: str, check: Callable[[], T | None], *, timeout: float, every: float = 0.5) -> T:
    """Poll ``check`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            result = check()
        except (OSError, ValueError) as err:  # not up yet, half-written file, ...
            last = err
        else:
            if result:
                return result
            last = result
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last}")
        time.sleep(every)


def http_get(url: str, *, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return str(response.read().decode())


# ``prefix``'s HTTP GET: the body, an HTTP error's too (its status said on stderr).
_FETCH = """import sys, urllib.error, urllib.request
try:
    reply = urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2]))
except urllib.error.HTTPError as err:
    reply = err
sys.stdout.write(reply.read().decode())
"""


class Prometheus:
    """A Prometheus server on a free loopback port with its own config and storage;
    ``prefix``: the command that runs it, and each of its HTTP requests, on another host (a
    network namespace: ``ip netns exec NS``), where its targets are."""

    def __init__(
        self,
        tmp: Path,
        scrape_configs: list[dict[str, Any]],
        *,
        binary: str,
        prefix: Sequence[str] = (),
    ) -> None:
        self.binary = binary
        self.prefix = list(prefix)
        self.dir = tmp
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config = self.dir / "prometheus.yml"
        # JSON is YAML: no YAML library needed to write the config.
        config = {
            "global": {
                "scrape_interval": "1s",
                "scrape_timeout": "1s",
                "evaluation_interval": "1s",
            },
            "rule_files": [str(ALERTS)],
            "scrape_configs": scrape_configs,
        }
        self.config.write_text(json.dumps(config, indent=2))
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = self.dir / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    *self.prefix,
                    self.binary,
                    f"--config.file={self.config}",
                    f"--storage.tsdb.path={self.dir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        wait_for("Prometheus to be ready", self._ready, timeout=60)

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(
                f"prometheus exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}"
            )
        try:
            self.get(f"{self.url}/-/ready", timeout=2)
        except urllib.error.URLError:
            return False
        return True

    def get(self, url: str, *, timeout: float = 10.0) -> str:
        """``http_get`` from Prometheus's host; on another host, an HTTP error's body is
        returned as a success's is (``api`` reads the reason from either)."""
        if not self.prefix:
            return http_get(url, timeout=timeout)
        argv = [*self.prefix, sys.executable, "-c", _FETCH, url, str(timeout)]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 20)
        except subprocess.TimeoutExpired as err:
            raise urllib.error.URLError(f"{url}: timed out") from err
        if done.returncode != 0:
            raise urllib.error.URLError(f"{url}: {done.stderr.strip()[-200:]}")
        return done.stdout

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            body = self.get(url)
        except urllib.error.HTTPError as err:  # 400/422: a bad query, with Prometheus' reason
            body = err.read().decode()
        reply = json.loads(body)
        if reply.get("status") != "success":
            raise AssertionError(f"{path} {params}: {reply.get('errorType')}: {reply.get('error')}")
        return reply["data"]

    def alerts(self, name: str) -> list[dict[str, Any]]:
        """The alert ``name``'s pending and firing instances."""
        return [a for a in self.api("alerts")["alerts"] if a["labels"]["alertname"] == name]

    def firing(self, name: str) -> list[dict[str, Any]]:
        return [a for a in self.alerts(name) if a["state"] == "firing"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        result = data["result"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": result}]
        return list(result)

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def active_targets(self) -> list[dict[str, Any]]:
        return list(self.api("targets", state="active")["activeTargets"])

    def wait_targets_up(self, count: int, *, timeout: float) -> list[dict[str, Any]]:
        def all_up() -> list[dict[str, Any]] | None:
            targets = self.active_targets()
            if len(targets) == count and all(t["health"] == "up" for t in targets):
                return targets
            return None

        try:
            return wait_for(f"{count} targets up", all_up, timeout=timeout)
        except AssertionError as err:
            shown = [(t["labels"], t["health"], t["lastError"]) for t in self.active_targets()]
            raise AssertionError(f"{err}\ntargets: {shown}") from None

    def wait_rules_evaluated(self, *, timeout: float) -> list[dict[str, Any]]:
        """Every alert rule loaded and evaluated at least once; returns them."""

        def evaluated() -> list[dict[str, Any]] | None:
            rules = [r for g in self.api("rules")["groups"] for r in g["rules"]]
            if rules and all(r.get("health") not in (None, "unknown") for r in rules):
                return rules
            return None

        return wait_for("alert rules evaluated", evaluated, timeout=timeout)
