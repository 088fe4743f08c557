"""A network for the benchmarks: hosts as network namespaces, every connection between them
through a router whose relay adds a round-trip time (``--rtt MS`` in embeddings.py and
throughput.py).

This kernel has no netem, so the delay is a userspace relay (relay.c, built here with
``cc``): the router namespace owns one service address per host (10.79.0.N, on its
loopback), and the cluster file names those. A task dials a service address, the packets
route to the router, the relay there accepts, connects on to the host's own address
(10.78.N.2, where its TF server listens) and copies both ways, each chunk held RTT/2 per
direction. Every host (the coordinator included: ParameterServerStrategy's chief runs a
server too) has its own namespace, joined to the router by a veth pair; the root
namespace's network is never touched, and deleting the namespaces deletes every link.

``rtt_ms=None`` is the direct network: the same namespaces and router, the cluster file
naming the hosts' own addresses, forwarded by the kernel with no relay. Comparing it with
``rtt_ms=0`` (the relay, no delay) shows what the relay itself costs.

``tunnel=True`` protects the hosts as ``psctl deploy render --keys`` does: every host runs
``psctl deploy tunnel`` with keys from ``psctl deploy keys --transport TRANSPORT``, and its
server (and the coordinator, on host "chief") runs in its job namespace behind it, so every
TensorFlow byte between hosts is WireGuard's (coordinator/deploy/tunnel.py) or TLS's
(coordinator/deploy/tls.py). Each host's tunnel address is its cluster address (the service
address with the relay, its own without). With the relay and WireGuard, WireGuard's
endpoints are the service addresses too, and the relay holds its UDP datagrams (``udp:``
pairs of relay.c) as it holds TCP; with TLS, the relay holds the TLS connections to each
host's TF port and the plain ones to its health port: every packet between hosts takes the
RTT. A host's health port reaches its host's network as the units' psctl-proxy does
(systemd-socket-proxyd into the job namespace).

Needs root, iproute2 and a C compiler; a missing one is one clear line (``LabError``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

RELAY_SOURCE = Path(__file__).with_name("relay.c")
TF_PORT = 2222  # every host's TF server (each namespace has its own ports)
HEALTH_PORT = 2223
PREFIX = "psrtt"  # namespace names: psrtt<pid>[.<lab>]-<host>
_LABS = itertools.count()  # this process's labs: a second one (--tunnel-overhead) gets .1


class LabError(RuntimeError):
    """The lab cannot be built here (not root, no iproute2 or compiler, a command failed)."""


def add_transport_flag(parser: argparse.ArgumentParser) -> None:
    """``--transport``, for a bench whose hosts may run behind their tunnels."""
    parser.add_argument(
        "--transport",
        choices=("tls", "wireguard"),
        default="tls",
        help="--tunnel-overhead: what the tunnelled hosts run, as psctl deploy keys "
        "--transport makes it (default %(default)s)",
    )


def add_mtu_flag(parser: argparse.ArgumentParser) -> None:
    """``--mtu``, for a bench whose cluster may run on NetLab's hosts."""
    parser.add_argument(
        "--mtu",
        type=int,
        default=1500,
        help="network-namespace hosts (--rtt, --tunnel-overhead): their links' MTU (default "
        "1500; 9000: jumbo frames, the tunnels then 8920)",
    )


@dataclass
class Host:
    name: str  # "chief", "ps0", "worker1"
    number: int  # 1..
    ns: str
    job_ns: str = ""  # /run/netns/psctl-ADDRESS behind the host's tunnel, if it has one

    @property
    def ip(self) -> str:
        """The host's own address (eth0 in its namespace)."""
        return f"10.78.{self.number}.2"

    @property
    def service_ip(self) -> str:
        """The address peers dial when the relay is on: the router's, for this host."""
        return f"10.79.0.{self.number}"


def _ip(*args: str, ns: str | None = None) -> None:
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise LabError(f"{' '.join(argv)}: {done.stderr.strip()}")


def build_relay(work: Path) -> Path:
    """relay.c compiled into ``work`` (a fraction of a second)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise LabError(
            "--rtt needs a C compiler (cc) for bench/harness/relay.c: apt-get install gcc"
        )
    binary = work / "relay"
    argv = [compiler, "-O2", "-pthread", "-o", str(binary), str(RELAY_SOURCE)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise LabError(f"building bench/harness/relay.c failed: {done.stderr.strip()[-500:]}")
    return binary


@dataclass
class NetLab:
    """Namespaces ``names`` joined through a router; with ``rtt_ms`` set, a relay there that
    delays each direction by half of it, for each host's ``ports``."""

    names: Sequence[str]
    rtt_ms: float | None
    work: Path
    ports: Sequence[int] = (TF_PORT,)
    tunnel: bool = False
    transport: str = "wireguard"  # or "tls" (psctl deploy keys --transport)
    mtu: int = 1500  # each host's link (9000: a network with jumbo frames)
    hosts: dict[str, Host] = field(default_factory=dict)
    router: str = ""
    relay: subprocess.Popen[bytes] | None = None
    tunnels: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self) -> None:
        if os.geteuid() != 0:
            raise LabError("--rtt builds network namespaces: run it as root")
        if shutil.which("ip") is None:
            raise LabError("--rtt needs iproute2 (ip): apt-get install iproute2")
        self.work.mkdir(parents=True, exist_ok=True)
        number = next(_LABS)
        tag = f"{PREFIX}{os.getpid()}" + (f".{number}" if number else "")
        self.router = f"{tag}-r"
        _ip("netns", "add", self.router)
        _ip("link", "set", "lo", "up", ns=self.router)
        self._sysctl(self.router, "net.ipv4.ip_forward=1")
        for number, name in enumerate(self.names, start=1):
            host = Host(name=name, number=number, ns=f"{tag}-{number}")
            self.hosts[name] = host
            _ip("netns", "add", host.ns)
            _ip("link", "set", "lo", "up", ns=host.ns)
            _ip(
                "link", "add", f"h{number}", "netns", self.router, "type", "veth",
                "peer", "name", "eth0", "netns", host.ns,
            )  # fmt: skip
            _ip("addr", "add", f"10.78.{number}.1/24", "dev", f"h{number}", ns=self.router)
            _ip("link", "set", f"h{number}", "mtu", str(self.mtu), ns=self.router)
            _ip("link", "set", "eth0", "mtu", str(self.mtu), ns=host.ns)
            _ip("link", "set", f"h{number}", "up", ns=self.router)
            _ip("addr", "add", f"{host.ip}/24", "dev", "eth0", ns=host.ns)
            _ip("link", "set", "eth0", "up", ns=host.ns)
            _ip("route", "add", "default", "via", f"10.78.{number}.1", ns=host.ns)
            _ip("addr", "add", f"{host.service_ip}/32", "dev", "lo", ns=self.router)
        if self.rtt_ms is not None:
            self._start_relay()

    def start_tunnels(self, cluster_file: Path, names: Sequence[str] = ()) -> None:
        """Keys for every host (of ``names``, when given), and each one's tunnel up (its job
        namespace, the transport's way out of it) before anything runs there."""
        from psctl.coordinator.deploy.tls import make_psks, tls_conf
        from psctl.coordinator.deploy.tunnel import Keys, make_keys, netns_name, tunnel_conf

        keys = Keys(self.work / "keys")
        hosts = [h for h in self.hosts.values() if not names or h.name in names]
        addresses = [self.cluster_ip(h.name) for h in hosts]
        tls = self.transport == "tls"
        (make_psks if tls else make_keys)(addresses, keys.directory)
        psctl = str(Path(sys.executable).with_name("psctl"))
        for host, address in zip(hosts, addresses, strict=True):
            conf = self.work / f"tunnel-{host.name}.conf"
            peers = [a for a in addresses if a != address]
            conf.write_text(
                tls_conf(address, peers, keys.directory)
                if tls
                else tunnel_conf(address, peers, keys)
            )
            conf.chmod(0o600)
            log = (self.work / f"tunnel-{host.name}.log").open("wb")
            self.tunnels.append(
                subprocess.Popen(
                    ["nsenter", f"--net=/run/netns/{host.ns}", psctl, "deploy", "tunnel",
                     "--config", str(conf), "--address", address, "--cluster", str(cluster_file),
                     *(["--listen", host.ip] if tls else [])],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )  # fmt: skip
            log.close()
        for host, proc in zip(hosts, self.tunnels, strict=True):
            said = self.work / f"tunnel-{host.name}.log"
            deadline = time.monotonic() + 30
            while "psctl tunnel: " not in said.read_text(errors="replace"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise LabError(f"{host.name}'s tunnel: {said.read_text()[-500:]}")
                time.sleep(0.1)
            host.job_ns = f"/run/netns/{netns_name(self.cluster_ip(host.name))}"
        for host in hosts if tls else ():
            self._proxy(host, HEALTH_PORT)

    def _proxy(self, host: Host, port: int) -> None:
        """``port`` of host's job namespace on its own network, as psctl-proxy@ does."""
        from psctl.coordinator.deploy.units import PROXYD

        inside = f"{self.cluster_ip(host.name)}:{port}"
        self.tunnels.append(
            subprocess.Popen(
                ["ip", "netns", "exec", host.ns, "systemd-socket-activate", "-l",
                 f"{host.ip}:{port}", "nsenter", f"--net={host.job_ns}", PROXYD, inside],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        )  # fmt: skip

    def cluster_ip(self, name: str) -> str:
        """Host ``name``'s address in the cluster file: the service address with the relay."""
        host = self.hosts[name]
        return host.ip if self.rtt_ms is None else host.service_ip

    @staticmethod
    def _sysctl(ns: str, setting: str) -> None:
        argv = ["ip", "netns", "exec", ns, "sysctl", "-q", "-w", setting]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise LabError(f"{' '.join(argv)}: {done.stderr.strip()}")

    def _start_relay(self) -> None:
        assert self.rtt_ms is not None
        binary = build_relay(self.work)
        hosts = self.hosts.values()
        relayed = [*self.ports, HEALTH_PORT] if self.tunnel else self.ports
        pairs = [f"{h.service_ip}:{port}={h.ip}:{port}" for h in hosts for port in relayed]
        if self.tunnel and self.transport == "wireguard":  # TensorFlow's bytes are in its datagrams
            from psctl.coordinator.deploy.tunnel import LISTEN_PORT

            pairs = [f"udp:{h.service_ip}:{LISTEN_PORT}={h.ip}:{LISTEN_PORT}" for h in hosts]
        delay_us = str(round(self.rtt_ms * 1000 / 2))
        log = (self.work / "relay.log").open("wb")
        self.relay = subprocess.Popen(
            ["ip", "netns", "exec", self.router, str(binary), delay_us, *pairs],
            stdout=subprocess.PIPE,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        assert self.relay.stdout is not None
        line = self.relay.stdout.readline().decode().strip()
        if line != "relay: ready":
            raise LabError(f"the relay did not start: {(self.work / 'relay.log').read_text()}")

    def dial(self, name: str, port: int = TF_PORT) -> str:
        """The address peers use for ``name``'s port: through the relay when it is on."""
        host = self.hosts[name]
        return f"{host.service_ip if self.relay else host.ip}:{port}"

    def set_link(self, name: str, up: bool) -> None:
        """Cut (or plug back) host ``name``'s link: the router's end of its veth pair goes
        down, so its packets are dropped silently, as on a pulled cable (no reset, no ICMP);
        up again, the router's route to it comes back with its address."""
        _ip("link", "set", f"h{self.hosts[name].number}", "up" if up else "down", ns=self.router)

    def exec_argv(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run on host ``name`` (``ip netns exec`` execs it: the pid is argv's); in
        its job namespace when the host has a tunnel (as NetworkNamespacePath= does)."""
        host = self.hosts[name]
        inside = ["nsenter", f"--net={host.job_ns}"] if host.job_ns else []
        return ["ip", "netns", "exec", host.ns, *inside, *argv]

    def stop(self) -> None:
        for proc in [self.relay, *self.tunnels]:
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # its children too (stunnel4)
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        job = [h.job_ns.rsplit("/", 1)[1] for h in self.hosts.values() if h.job_ns]
        for ns in [*job, *(h.ns for h in self.hosts.values())] + (
            [self.router] if self.router else []
        ):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.hosts.clear()


@dataclass
class LabServer:
    task_type: str
    index: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def name(self) -> str:
        return f"{self.task_type}:{self.index}"


@dataclass
class LabCluster:
    """A ps + worker cluster on a NetLab: ``cluster_file`` for the coordinator, which runs
    on host "chief" (``child_argv``)."""

    lab: NetLab
    cluster_file: Path
    servers: list[LabServer]

    def child_argv(self, argv: Sequence[str]) -> list[str]:
        return self.lab.exec_argv("chief", argv)


def _wait_ready(sock: socket.socket, servers: Sequence[LabServer], timeout: float) -> None:
    """Until every server sent READY=1 on the notify socket (the sd_notify it sends under
    systemd), or one exits, or ``timeout``."""
    deadline = time.monotonic() + timeout
    ready = 0
    while ready < len(servers):
        for s in servers:
            if s.proc.poll() is not None:
                tail = s.log_path.read_text(errors="replace").splitlines()[-5:]
                raise LabError(f"{s.name} exited ({s.proc.returncode}): {' | '.join(tail)}")
        if time.monotonic() > deadline:
            raise LabError(f"{len(servers) - ready} server(s) not ready in {timeout:.0f}s")
        with contextlib.suppress(TimeoutError):
            if b"READY=1" in sock.recv(4096):
                ready += 1


@contextlib.contextmanager
def lab_cluster(
    num_ps: int,
    num_workers: int,
    *,
    rtt_ms: float | None,
    work: Path,
    timeout: float = 120.0,
    tunnel: bool = False,
    transport: str = "wireguard",
    mtu: int = 1500,
) -> Iterator[LabCluster]:
    """Start a cluster on a fresh NetLab; everything stopped and deleted on the way out."""
    from psctl.cluster.processes.procs import spawn, stop_processes
    from psctl.coordinator.argv import server_argv

    tasks = [("ps", i) for i in range(num_ps)] + [("worker", i) for i in range(num_workers)]
    names = ["chief", *(f"{t}{i}" for t, i in tasks)]
    lab = NetLab(names, rtt_ms, work, tunnel=tunnel, transport=transport, mtu=mtu)
    servers: list[LabServer] = []
    # A short path: AF_UNIX names stop at 107 bytes, a results folder can be deeper.
    sockets = Path(tempfile.mkdtemp(prefix="psrtt"))
    notify = sockets / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        lab.start()
        cluster = {
            "chief": [lab.dial("chief")],
            "ps": [lab.dial(f"ps{i}") for i in range(num_ps)],
            "worker": [lab.dial(f"worker{i}") for i in range(num_workers)],
        }
        cluster_file = work / "cluster.json"
        cluster_file.write_text(json.dumps({"cluster": cluster}, indent=1))
        if tunnel:
            lab.start_tunnels(cluster_file)
        sock.bind(str(notify))
        sock.settimeout(0.5)
        env = {**os.environ, "NOTIFY_SOCKET": str(notify), "GRPC_FAIL_FAST": "use_caller"}
        # The hosts share this machine's CPUs, as psctl local's tasks do; each has its own
        # address, so a server's defaults (its host's share of threads, idle threads
        # spinning on a host of its own) would take all of them: both are passed here.
        threads = max(1, (os.cpu_count() or 1) // (len(tasks) + 1))
        for task_type, index in tasks:
            host = lab.hosts[f"{task_type}{index}"]
            argv = server_argv(
                task_type,
                [
                    "--cluster", str(cluster_file), "--index", str(index),
                    "--bind-host", lab.cluster_ip(host.name) if tunnel else host.ip,
                    "--health-port", str(HEALTH_PORT),
                    "--metrics-port", "0", "--intra-op-threads", str(threads),
                    "--thread-spinning", "off",
                ],
            )  # fmt: skip
            log_path = work / f"{task_type}-{index}.log"
            proc = spawn(lab.exec_argv(host.name, argv), log_path=log_path, env=env)
            servers.append(LabServer(task_type, index, proc, log_path))
        _wait_ready(sock, servers, timeout)
        yield LabCluster(lab=lab, cluster_file=cluster_file, servers=servers)
    finally:
        sock.close()
        shutil.rmtree(sockets, ignore_errors=True)
        stop_processes([s.proc for s in servers], timeout=10)
        lab.stop()


class LabBench:
    """``lab_cluster`` behind ``LocalCluster``'s start / wait_serving / stop, for a benchmark
    that keeps one cluster for all its runs (throughput.py ``--rtt``)."""

    def __init__(
        self,
        num_ps: int,
        num_workers: int,
        *,
        rtt_ms: float | None,
        work: Path,
        tunnel: bool = False,
        transport: str = "wireguard",
        mtu: int = 1500,
    ):
        self._args = (num_ps, num_workers)
        self._rtt_ms, self._work, self._tunnel, self._mtu = rtt_ms, work, tunnel, mtu
        self._transport = transport
        self._stack = contextlib.ExitStack()
        self.cluster: LabCluster | None = None

    def start(self, timeout: float = 120.0) -> None:
        self.cluster = self._stack.enter_context(
            lab_cluster(
                *self._args,
                rtt_ms=self._rtt_ms,
                work=self._work,
                timeout=timeout,
                tunnel=self._tunnel,
                transport=self._transport,
                mtu=self._mtu,
            )
        )

    def wait_serving(self, timeout: float) -> None:
        """Nothing to wait for: ``start`` returns once every server is ready."""

    @property
    def servers(self) -> list[LabServer]:
        return self.cluster.servers if self.cluster else []

    @property
    def cluster_file(self) -> Path:
        assert self.cluster is not None, "start() first"
        return self.cluster.cluster_file

    def child_argv(self, argv: Sequence[str]) -> list[str]:
        assert self.cluster is not None, "start() first"
        return self.cluster.child_argv(argv)

    def stop(self) -> None:
        self._stack.close()


def parse_rtt(text: str) -> list[float | None]:
    """``--rtt``: comma-separated milliseconds (0: the relay with no delay) or ``direct``."""
    out: list[float | None] = []
    for word in text.split(","):
        word = word.strip()
        if word == "direct":
            out.append(None)
            continue
        try:
            value = float(word)
        except ValueError:
            raise ValueError(f"--rtt {text!r}: {word!r} is not milliseconds or 'direct'") from None
        if not 0 <= value <= 1000:
            raise ValueError(f"--rtt {text!r}: {word} ms is outside 0-1000")
        out.append(value)
    return out


def rtt_label(rtt: float | None) -> str:
    return "direct" if rtt is None else f"{rtt:g} ms"


if __name__ == "__main__":  # a quick look: python bench/harness/netlab.py RTT_MS
    with lab_cluster(1, 1, rtt_ms=float(sys.argv[1]), work=Path(sys.argv[2])) as c:
        print(c.cluster_file.read_text())
