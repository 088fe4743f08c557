"""``bench/soak.py --netns``: the soak's cluster on hosts of their own, links that can be cut.

Every task runs on a host of bench/harness/netlab.py's lab (a network namespace joined to a router
by a veth pair; the direct network, or with ``rtt_ms`` its relay, which delays every
connection to a server's TF, health and /metrics ports by half of it each way): the ps and
worker servers as the systemd units run them (``ps-server`` / ``worker-server --cluster
FILE --index I``, restarted on failure one second later by
bench/harness/netns_hosts.py's stand-in for systemd's Restart=on-failure), the
coordinator (``psctl train --cluster FILE``) on host ``chief``.
Its control API listens on that host's loopback: the soak reaches it, and Prometheus runs
there too, through ``ip netns exec``. A ``cut-link`` sets the router's end of a host's link
down: the host's packets are dropped silently (no reset, no ICMP), as on a pulled cable,
until it is set up again.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.harness.netlab import TF_PORT, NetLab
from bench.harness.netns_hosts import NotifySocket, RestartPolicy, Service
from psctl.cluster.ports import HEALTH_PORT_OFFSET, METRICS_PORT_OFFSET
from psctl.coordinator.argv import server_argv

REPO = Path(__file__).resolve().parents[2]
CONTROL = "127.0.0.1:7070"  # psctl train's control API, on host "chief"
COORDINATOR_METRICS = 9940  # + the run's number: each run is its own Prometheus instance
# As deploy/systemd's units say: Restart=on-failure, RestartSec=1, no restart on 2 or 78.
POLICY = RestartPolicy(restart="on-failure", delay=1.0, prevent=frozenset({2, 78}))


class SoakHosts:
    """``num_ps`` + ``num_workers`` servers on hosts ``ps0``..., ``worker0``..., and host
    ``chief`` for the coordinator; ``work`` holds the cluster file and the servers' logs."""

    def __init__(
        self, num_ps: int, num_workers: int, work: Path, rtt_ms: float | None = None
    ) -> None:
        self.tasks = [("ps", i) for i in range(num_ps)]
        self.tasks += [("worker", i) for i in range(num_workers)]
        self.work = work
        names = ["chief", *(f"{t}{i}" for t, i in self.tasks)]
        ports = (TF_PORT, TF_PORT + HEALTH_PORT_OFFSET, TF_PORT + METRICS_PORT_OFFSET)
        self.lab = NetLab(names, rtt_ms, work / "lab", ports)
        self.cluster_file = work / "cluster.json"
        self.services: dict[str, Service] = {}
        self._sockets_dir = Path(tempfile.mkdtemp(prefix="psoak"))  # AF_UNIX: short paths
        self._sockets: list[NotifySocket] = []

    def start(self, timeout: float = 150.0) -> None:
        """Build the lab, start every server, return once each said READY=1 (sd_notify)."""
        self.work.mkdir(parents=True, exist_ok=True)
        self.lab.start()
        cluster = {"chief": [self.lab.dial("chief")]}
        for task_type, index in self.tasks:
            cluster.setdefault(task_type, []).append(self.lab.dial(f"{task_type}{index}"))
        self.cluster_file.write_text(json.dumps({"cluster": cluster}, indent=1))
        for task_type, index in self.tasks:
            host = self.lab.hosts[f"{task_type}{index}"]
            notify = NotifySocket(self._sockets_dir / f"{task_type}-{index}")
            self._sockets.append(notify)
            flags = ["--cluster", str(self.cluster_file), "--index", str(index)]
            argv = server_argv(task_type, [*flags, "--bind-host", host.ip])
            env = {
                **os.environ,
                "PYTHONPATH": str(REPO),
                "TF_CPP_MIN_LOG_LEVEL": "2",
                "NOTIFY_SOCKET": str(notify.path),
            }
            service = Service(
                name=f"{task_type}:{index}",
                argv=self.lab.exec_argv(host.name, argv),
                env=env,
                policy=POLICY,
                log_path=self.work / f"{task_type}-{index}.log",
            )
            self.services[service.name] = service
            service.start()
        for notify, service in zip(self._sockets, self.services.values(), strict=True):
            notify.wait_for("READY", "1", count=1, timeout=timeout, alive=service.alive)

    def prefix(self) -> list[str]:
        """What runs a command on the coordinator's host."""
        return self.lab.exec_argv("chief", [])

    def coordinator_env(self) -> dict[str, str]:
        """psctl train's side ports (/metrics) on host ``chief``'s own address: the cluster
        file names the relay's for it when there is one."""
        return {"PSCTL_BIND_HOST": self.lab.hosts["chief"].ip}

    def set_link(self, host: str, up: bool) -> None:
        """Cut (or plug back) ``host``'s link: the router's end of its veth pair."""
        self.lab.set_link(host, up)

    def targets(self, coordinators: Sequence[int]) -> list[dict[str, object]]:
        """Prometheus file_sd groups: each of ``coordinators`` (/metrics ports of psctl train
        on host ``chief``) and every server (its TF port + 2000), labelled as psctl local
        labels them."""
        chief = self.lab.hosts["chief"].ip  # psctl train serves /metrics on its TF address
        groups: list[dict[str, object]] = [
            _group(f"{chief}:{port}", "psctl-coordinator", "chief", 0) for port in coordinators
        ]
        for task_type, index in self.tasks:
            host, port = self.lab.dial(f"{task_type}{index}").rsplit(":", 1)
            metrics = f"{host}:{int(port) + METRICS_PORT_OFFSET}"
            groups.append(_group(metrics, f"psctl-{task_type}", task_type, index))
        return groups

    def restarts(self) -> dict[str, int]:
        """Each server's starts after its first (the restart loop's)."""
        return {name: max(0, s.starts - 1) for name, s in self.services.items()}

    def stop(self) -> None:
        """Every server stopped (thawed first: a frozen one ignores SIGTERM), every link and
        namespace deleted."""
        for service in self.services.values():
            with contextlib.suppress(ProcessLookupError, AttributeError):
                os.kill(service.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
            service.stop()
        for notify in self._sockets:
            notify.close()
        shutil.rmtree(self._sockets_dir, ignore_errors=True)
        self.lab.stop()


def _group(address: str, job: str, task_type: str, index: int) -> dict[str, object]:
    labels = {"job": job, "task_type": task_type, "task_index": str(index)}
    return {"targets": [address], "labels": labels}
