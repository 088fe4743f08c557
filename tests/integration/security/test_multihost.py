"""psctl across hosts: four network-namespace hosts run what `psctl deploy render --keys`
wrote, and a fifth outside the cluster tries to get in.

One ps host, two worker hosts and a coordinator host, each its own network namespace with
its own 10.x address, and each behind its rendered tunnel (psctl-tunnel.service: the job's
namespace on the host, TLS to the others, `psctl deploy keys`' default transport; the key
rotation and joining tests run WireGuard) with its side ports carried out of it by the
psctl-proxy@ units. Every server starts from the exact ExecStart= line and environment
of its rendered unit (instance substituted, as systemd would; NetworkNamespacePath= by
nsenter), with a NOTIFY_SOCKET that must receive READY=1, under the unit's sandbox as far
as bench/harness/sandbox.py applies it (a dynamic user, no capabilities, the system call
filter, a read-only file system, private /tmp, no /home: its docstring lists what is
applied and what is not). `psctl deploy check` on the coordinator host sees every server
SERVING through the tunnel; the fifth host, with no keys and then with keys of its own, and
another uid on a cluster host, reach no TF port; a capture on the ps host's cable holds no
tensor in the clear. The coordinator unit's `psctl train`, sandboxed too, trains the mlp
job across the hosts; a worker host's server is SIGKILLed mid-training and started again by
the test's Restart=on-failure loop (READY=1 again, at the same address). `psctl pause` holds
the job until it is back, so it has steps left: it takes its share of them. Then the ps
host's server is SIGKILLed and comes back, and the job recovers from its latest
checkpoint. Then `psctl stop`, typed as deploy.md shows it, ends the job (whose step target
it would not reach for minutes): stop exits 0 once the coordinator is gone, the coordinator
exits 0 on its own (a graceful stop, operations.md's exit statuses), with a final
checkpoint at its last step and eval accuracy >= 0.90.

Needs root (network namespaces), `ip`, stunnel4, nft, wireguard-go and wg
(tools/ensure-systemd-tools.sh installs them). The
/etc/psctl directory is created empty when missing: `ip netns exec` bind-mounts each host's
files over it. Every namespace, link and process is removed at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest

from bench.harness.netns_hosts import (
    SERVERS,
    TF_PORT,
    NetnsLab,
    NotifySocket,
    RestartPolicy,
    Service,
    Unit,
    exec_argv,
    parse_unit,
    sandboxed,
    service_env,
    unescape_instance,
    value,
    values,
    write_cluster,
)
from bench.harness.sandbox import NOBODY
from psctl.cluster import netns as cluster_netns
from psctl.cluster.processes.procs import die_with_parent
from psctl.coordinator.deploy.plan import CONTROL_TOKEN_FILE, STATE_DIR, SYNC_UNIT, TUNNEL_UNIT
from psctl.coordinator.deploy.tls import make_psks, tls_conf
from psctl.coordinator.deploy.tunnel import (
    LISTEN_PORT,
    NETNS_DIR,
    Keys,
    make_keys,
    netns_name,
    tunnel_conf,
)
from psctl.coordinator.deploy.units import PROXYD
from psctl.coordinator.operations.security import ENV as CONTROL_CREDENTIALS
from tests.conftest import cpu_seconds, kill_if_running, open_lab, require_tool

pytestmark = pytest.mark.integration

HOSTS = {"coord": "10.77.0.1", "ps0": "10.77.0.2", "w0": "10.77.0.3", "w1": "10.77.0.4"}
# A fifth namespace on the same bridge: not in the cluster, without its keys.
OUTSIDER, OUTSIDER_ADDRESS = "out", "10.77.0.5"
BIN_DIR = Path(sys.executable).parent
CONFIG_DIR = "/etc/psctl"  # the rendered default; each host sees its own through netns
# A target the job does not reach in this test (about 180 steps/s here): `psctl stop` ends it
# once it has trained STOP_AT_STEP steps.
STEPS = 100_000
STOP_AT_STEP = 1500
KILL_AT_STEP = 100
STEPS_BETWEEN = 300  # new steps after the worker is back, and after the ps is
# What systemd gives a service before the unit's own environment.
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}
# This checkout's venv points to a Python under /root, which ProtectHome= hides: the
# sandbox leaves that one directory readable (a real host installs psctl in /opt).
PYTHON_HOME = os.path.realpath(sys.base_prefix)
# The checkout and its .venv: under /tmp or /root in some CI clones, which the units hide.
CHECKOUT = os.path.realpath(Path(__file__).resolve().parents[3])


@pytest.fixture
def lab() -> Iterator[NetnsLab]:
    require_tool("wireguard-go", "tools/ensure-systemd-tools.sh (Debian package wireguard-go)")
    require_tool("wg", "tools/ensure-systemd-tools.sh (Debian package wireguard-tools)")
    require_tool("stunnel4", "tools/ensure-systemd-tools.sh (Debian package stunnel4)")
    require_tool("nft", "tools/ensure-systemd-tools.sh (Debian package nftables)")
    require_tool("systemd-socket-activate", "tools/ensure-systemd-tools.sh (package systemd)")
    assert Path(PROXYD).exists(), f"{PROXYD} is missing: tools/ensure-systemd-tools.sh"
    lab_hosts = {**HOSTS, OUTSIDER: OUTSIDER_ADDRESS}
    remove_job_namespaces(lab_hosts.values())  # a killed run's
    try:
        with open_lab(lab_hosts, scripts=("psctl", "ps-server", "worker-server")) as hosts:
            yield hosts
    finally:
        remove_job_namespaces(lab_hosts.values())


def run(argv: list[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
    """A command as root types it on a host: no psctl credential in its environment (the
    client finds the coordinator unit's job token under the unit's state directory)."""
    env = {**BASE_ENV, "HOME": os.environ.get("HOME", "/root")}
    env = {k: v for k, v in env.items() if k not in CONTROL_CREDENTIALS.values()}
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL
    )


def host_path(lab: NetnsLab, host: str) -> Callable[[str], Path]:
    """Map a path a unit names to where this process sees it for ``host``."""

    def path_map(path: str) -> Path:
        if path.startswith(CONFIG_DIR + "/"):
            return lab.etc(host) / "psctl" / path[len(CONFIG_DIR) + 1 :]
        return Path(path)

    return path_map


def global_step(lab: NetnsLab) -> int | None:
    proc = run(lab.exec("coord", [str(BIN_DIR / "psctl"), "status", "--json"]), timeout=20)
    if proc.returncode != 0:
        return None
    return int(json.loads(proc.stdout).get("global_step", 0))


def psctl(lab: NetnsLab, *args: str) -> str:
    """A psctl client command on the coordinator host; its output, or the test fails."""
    proc = run(lab.exec("coord", [str(BIN_DIR / "psctl"), *args]), timeout=30)
    assert proc.returncode == 0, f"psctl {' '.join(args)}: {proc.stdout}{proc.stderr}"
    return proc.stdout


def remove_job_namespaces(addresses: Iterable[str]) -> None:
    """The job namespaces (and whatever runs in them) of these hosts' tunnels."""
    for address in addresses:
        name = netns_name(address)
        if (NETNS_DIR / name).exists():
            pids = subprocess.run(
                ["ip", "netns", "pids", name], capture_output=True, text=True, timeout=20
            ).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


def render_protected(cluster_file: Path, out: Path, *extra: str, transport: str = "") -> Path:
    """`psctl deploy keys`, then `psctl deploy render --keys` as docs/deploy.md types them
    (``transport``: --transport, else its default); returns the key directory."""
    keys = out.with_name("keys")
    common = ["--cluster", str(cluster_file)]
    with_keys = ["--bin-dir", str(BIN_DIR), "--keys", str(keys)]
    chosen = ["--transport", transport] if transport else []
    for args in (
        ["keys", *common, "--out", str(keys), *chosen],
        ["render", *extra, *common, "--out", str(out), *with_keys],
    ):
        done = run([str(BIN_DIR / "psctl"), "deploy", *args], timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
    return keys


def in_job_netns(lab: NetnsLab, host: str, unit: Unit, argv: list[str]) -> list[str]:
    """``argv`` as systemd runs a unit with NetworkNamespacePath=: in the host's job
    namespace (and, through lab.exec, with the host's own /etc/psctl)."""
    path = value(unit, "Service", "NetworkNamespacePath")
    assert path == f"{NETNS_DIR}/{netns_name(lab.hosts[host])}", path
    return lab.exec(host, ["nsenter", f"--net={path}", *argv])


def start_tunnel(lab: NetnsLab, host: str, out: Path, logs: Path, notify: Path) -> Service:
    """The host's psctl-tunnel.service from its rendered ExecStart= and environment, as root
    in the host's network namespace and this machine's mount namespace (the unit has no
    mount namespace of its own: the job namespace it makes must be seen by every other
    unit; `ip netns exec` would make one, and the tunnel refuses it); READY=1 awaited."""
    address = lab.hosts[host]
    unit = parse_unit((out / address / TUNNEL_UNIT).read_text())
    assert value(unit, "Service", "Type") == "notify"
    env = {**BASE_ENV, **service_env(unit, "", host_path(lab, host))}
    env["PSCTL_CLUSTER"] = str(host_path(lab, host)(env["PSCTL_CLUSTER"]))  # its /etc/psctl
    sock = NotifySocket(notify / f"tunnel-{host}.sock")
    env["NOTIFY_SOCKET"] = str(sock.path)
    argv = exec_argv(value(unit, "Service", "ExecStart"), "", env)
    assert argv[:3] == [str(BIN_DIR / "psctl"), "deploy", "tunnel"], argv
    argv = [str(host_path(lab, host)(a)) for a in argv]  # its /etc/psctl, without lab.exec
    service = Service(
        name=f"tunnel {host}",
        argv=["nsenter", f"--net=/run/netns/{lab.ns(host)}", *argv],
        env=env,
        policy=RestartPolicy.of(unit),
        log_path=logs / f"tunnel-{host}.log",
    )
    service.start()
    try:
        sock.wait_for("READY", "1", count=1, timeout=30, alive=service.alive)
    except AssertionError:
        service.stop()
        raise AssertionError(service.log_tail()) from None
    finally:
        sock.close()
    return service


def start_proxies(lab: NetnsLab, host: str, out: Path, logs: Path) -> list[Service]:
    """The psctl-proxy@ADDRESS.socket units the host's README enables: a socket on the
    host's network (systemd-socket-activate stands in for systemd) handed to the rendered
    service's systemd-socket-proxyd in the job namespace, under the unit's sandbox."""
    address = lab.hosts[host]
    readme = (out / address / "README.md").read_text()
    instances = re.findall(r"'psctl-proxy@(\S+)\.socket'", readme)
    assert instances, readme
    unit = parse_unit((out / address / "psctl-proxy@.service").read_text())
    services = []
    for instance in instances:
        listen = unescape_instance(instance)
        argv = exec_argv(value(unit, "Service", "ExecStart"), instance, {})
        assert argv == [PROXYD, listen], argv
        proxied = in_job_netns(lab, host, unit, sandboxed(unit, argv, exposed=[PYTHON_HOME]))
        service = Service(
            name=f"proxy {listen}",
            argv=[
                "nsenter",
                f"--net=/run/netns/{lab.ns(host)}",
                "systemd-socket-activate",
                "--listen",
                listen,
                *proxied,
            ],
            env=dict(BASE_ENV),
            policy=RestartPolicy("on-failure", 1.0, frozenset()),
            log_path=logs / f"proxy-{host}-{instance.replace(':', '_')}.log",
        )
        service.start()
        services.append(service)
    return services


TF_ADDRESSES = [f"{HOSTS[h]}:{TF_PORT}" for h in ("coord", "ps0", "w0", "w1")]
SYSTEM_PYTHON = "/usr/bin/python3"  # any uid can run it (this checkout's is under /root)
# Tries every TF address at once; prints {address: "open" | why not}.
CONNECT_ALL = """
import json, socket, sys, concurrent.futures as cf
def one(address):
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=float(sys.argv[1])).close()
        return "open"
    except OSError as err:
        return type(err).__name__
with cf.ThreadPoolExecutor(8) as pool:
    print(json.dumps(dict(zip(sys.argv[2:], pool.map(one, sys.argv[2:])))))
"""


# Asks every TF address for gRPC's answer (HTTP/2 SETTINGS, as psctl deploy check does):
# behind TLS a connection may be accepted by a tunnel and still reach no TensorFlow.
GRPC_ALL = """
import json, socket, sys, concurrent.futures as cf
PREFACE = b"PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
def one(address):
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=float(sys.argv[1])) as c:
            c.sendall(PREFACE)
            header = c.recv(9)
        return "open" if len(header) >= 4 and header[3] == 4 else "no gRPC answer"
    except OSError as err:
        return type(err).__name__
with cf.ThreadPoolExecutor(8) as pool:
    print(json.dumps(dict(zip(sys.argv[2:], pool.map(one, sys.argv[2:])))))
"""


def connect_all(
    argv_prefix: list[str], addresses: list[str], timeout: float, script: str = CONNECT_ALL
) -> dict[str, str]:
    proc = run(
        [*argv_prefix, SYSTEM_PYTHON, "-c", script, str(timeout), *addresses],
        timeout=timeout + 30,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


@contextlib.contextmanager
def outsider_tunnel(lab: NetnsLab, workdir: Path, conf_text: str, *extra: str) -> Iterator[None]:
    """The fifth host runs `psctl deploy tunnel` with ``conf_text`` (keys of its own) until
    the block ends; its job namespace is removed after."""
    conf = workdir / "outsider-tunnel.conf"
    conf.write_text(conf_text)
    conf.chmod(0o600)
    own = Service(
        name="outsider tunnel",
        argv=[
            "nsenter",
            f"--net=/run/netns/{lab.ns(OUTSIDER)}",
            str(BIN_DIR / "psctl"),
            "deploy",
            "tunnel",
            "--config",
            str(conf),
            "--address",
            OUTSIDER_ADDRESS,
            *extra,
        ],
        env=dict(BASE_ENV),
        policy=RestartPolicy("on-failure", 60.0, frozenset()),
        log_path=workdir / "outsider-tunnel.log",
    )
    own.start()
    try:
        deadline = time.monotonic() + 20
        while "psctl tunnel: " not in own.log_tail():
            assert own.alive() and time.monotonic() < deadline, own.log_tail()
            time.sleep(0.2)
        yield
    finally:
        own.stop()
        remove_job_namespaces([OUTSIDER_ADDRESS])


def outsider_job_ns() -> list[str]:
    return ["ip", "netns", "exec", netns_name(OUTSIDER_ADDRESS)]


def assert_outsiders_refused(lab: NetnsLab, workdir: Path) -> None:
    """Nobody outside the cluster's tunnels gets gRPC's answer from a TF port: the fifth
    host (no keys), the fifth host with a TLS tunnel of its own key, another uid on a
    cluster host (ps0's own network, and setns into the job's namespace)."""
    outside = connect_all(lab.exec(OUTSIDER, []), TF_ADDRESSES, 2, GRPC_ALL)
    assert "open" not in outside.values(), outside
    # A key of its own (and made-up ones for the cluster's hosts): every TLS handshake it
    # tries is refused.
    keys = workdir / "outsider-keys"
    make_psks([OUTSIDER_ADDRESS, *HOSTS.values()], keys)
    conf_text = tls_conf(OUTSIDER_ADDRESS, list(HOSTS.values()), keys)
    with outsider_tunnel(lab, workdir, conf_text, "--cluster", str(workdir / "cluster.json")):
        tunnelled = connect_all(outsider_job_ns(), TF_ADDRESSES, 5, GRPC_ALL)
        assert "open" not in tunnelled.values(), tunnelled
    # Each cluster host's tunnel said so, once (the outsider tried more than once).
    for host in HOSTS:
        log = (workdir / f"tunnel-{host}.log").read_text()
        refused = f"psctl tunnel: refused a TLS connection from {OUTSIDER_ADDRESS}:"
        assert log.count(refused) == 1, log[-2000:]
    assert_other_uid_refused(lab)


def assert_wireguard_outsider_refused(lab: NetnsLab, workdir: Path, hosts: list[str]) -> None:
    """The fifth host with a WireGuard tunnel of its own keys (it knows every host's public
    key: those are not secret): no handshake completes, each of ``hosts`` logs it once."""
    # A key of its own and every host's real public key (they are no secret), so a tunnel
    # that tries: no handshake completes.
    keys = Keys(workdir / "outsider-keys")
    keys.directory.mkdir()
    for public in (workdir / "keys").glob("*.pub"):
        shutil.copyfile(public, keys.directory / public.name)
    make_keys([OUTSIDER_ADDRESS], keys.directory)
    with outsider_tunnel(lab, workdir, tunnel_conf(OUTSIDER_ADDRESS, list(HOSTS.values()), keys)):
        tunnelled = connect_all(outsider_job_ns(), TF_ADDRESSES, 5)
        assert set(tunnelled.values()) == {"TimeoutError"}, tunnelled  # dropped, unanswered
    # Each cluster host's tunnel said so, once (the outsider tried again and again).
    for host in hosts:
        log = (workdir / f"tunnel-{host}.log").read_text()
        refused = f"psctl tunnel: refused a handshake from {OUTSIDER_ADDRESS}:{LISTEN_PORT}"
        assert log.count(refused) == 1, log[-2000:]


def assert_other_uid_refused(lab: NetnsLab) -> None:
    """Another user of a cluster host: no TF port answers on the host's network (with TLS,
    the tunnel's listener there wants a key), and the job's namespace cannot be joined."""
    probe = SETNS_PROBE.replace("@NETNS@", f"{NETNS_DIR}/{netns_name(HOSTS['ps0'])}")
    as_other = ["setpriv", "--reuid=65533", "--regid=65533", "--clear-groups"]
    local = connect_all(
        lab.exec("ps0", as_other),
        [f"{HOSTS['ps0']}:{TF_PORT}", f"127.0.0.1:{TF_PORT}"],
        2,
        GRPC_ALL,
    )
    assert "open" not in local.values(), local
    joined = run(lab.exec("ps0", [*as_other, SYSTEM_PYTHON, "-c", probe]), timeout=30)
    assert joined.stdout.strip() == "EPERM", joined.stdout + joined.stderr


SETNS_PROBE = """
import ctypes, errno, os
fd = os.open("@NETNS@", os.O_RDONLY)
libc = ctypes.CDLL(None, use_errno=True)
print("joined" if libc.setns(fd, 0x40000000) == 0 else errno.errorcode[ctypes.get_errno()])
"""


class Capture:
    """Every frame through ``interface`` (a host's cable: a bridge port, a router's end of a
    veth pair), read in the namespace ``netns`` that holds it with a packet socket, as a
    passive observer on the network would: which of ``markers`` appeared in any frame, and
    the ports of every IPv4 TCP and UDP frame. test_tls_transport.py's lab uses it too."""

    def __init__(self, netns: str, interface: str, markers: Iterable[bytes]) -> None:
        def open_socket() -> socket.socket:
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
            sock.bind((interface, 0))
            return sock

        where = {cluster_netns.ENV: f"/run/netns/{netns}"}
        self._sock = cluster_netns.run_inside(open_socket, where)
        self._sock.settimeout(0.2)
        self.markers = dict.fromkeys(markers, False)
        self.frames = 0
        self.ports: dict[int, list[tuple[int, int]]] = {6: [], 17: []}  # TCP, UDP
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                frame = self._sock.recv(65536)
            except TimeoutError:
                continue
            self.frames += 1
            for marker in self.markers:
                self.markers[marker] |= marker in frame
            if len(frame) >= 38 and frame[12:14] == b"\x08\x00" and frame[23] in self.ports:
                ihl = (frame[14] & 0x0F) * 4
                self.ports[frame[23]].append(struct.unpack("!HH", frame[14 + ihl : 18 + ihl]))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()


# Runs an op on ps 0 from the coordinator host's end of the tunnel, with a string the
# observer looks for (in the clear, TensorFlow's request carries it as it is).
MARKER_OP = """
import sys
import tensorflow as tf
tf.config.experimental_connect_to_host(sys.argv[1], job_name="probe")
with tf.device("/job:probe/replica:0/task:0/device:CPU:0"):
    print(int(tf.strings.length(tf.constant(sys.argv[2]))))
"""


def assert_observer_sees_no_tensor(lab: NetnsLab) -> tuple[int, int]:
    """A tensor carrying a marker goes from the coordinator host to ps 0 while the job
    trains; the frames on ps 0's cable hold TLS's TCP to the TF port, never the marker. A
    datagram the outsider sends with another marker is seen: the capture reads payloads.
    Returns (frames seen, TCP segments to or from the TF port)."""
    tf_marker = f"psctl-tensor-{os.getpid()}-{time.time_ns()}"
    plain_marker = f"psctl-plain-{os.getpid()}-{time.time_ns()}"
    cable = f"p{list(lab.hosts).index('ps0')}"  # ps0's port on the lab's bridge
    capture = Capture(lab.switch, cable, [tf_marker.encode(), plain_marker.encode()])
    try:
        op = run(
            [
                "ip",
                "netns",
                "exec",
                netns_name(HOSTS["coord"]),
                sys.executable,
                "-c",
                MARKER_OP,
                f"{HOSTS['ps0']}:{TF_PORT}",
                tf_marker,
            ],
            timeout=120,
        )
        assert op.returncode == 0 and op.stdout.split()[-1] == str(len(tf_marker)), op.stderr
        sender = (
            "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM)"
            f".sendto({plain_marker.encode()!r}, ({HOSTS['ps0']!r}, 9))"
        )
        sent = run(lab.exec(OUTSIDER, [SYSTEM_PYTHON, "-c", sender]), timeout=30)
        assert sent.returncode == 0, sent.stderr
        time.sleep(0.5)
    finally:
        capture.stop()
    assert capture.markers[plain_marker.encode()], f"{capture.frames} frames, no datagram"
    assert not capture.markers[tf_marker.encode()], "the tensor crossed the wire in the clear"
    tcp = [p for p in capture.ports[6] if TF_PORT in p]
    assert len(tcp) >= 10, f"{len(tcp)} TCP segments to or from the TF port: not the op's?"
    return capture.frames, len(tcp)


@pytest.mark.timeout(300)
def test_train_across_tunnelled_hosts_through_worker_and_ps_restarts(lab: NetnsLab, tmp_path: Path):
    started = time.monotonic()
    marks: list[str] = []

    def mark(what: str) -> None:
        marks.append(f"{time.monotonic() - started:6.1f}s {what}")
        print(marks[-1], flush=True)

    cluster_file = tmp_path / "cluster.json"
    write_cluster(cluster_file, HOSTS)
    out = tmp_path / "rendered"
    keys = render_protected(cluster_file, out)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(HOSTS.values())
    for host, address in HOSTS.items():  # "install": the host's files at its /etc/psctl
        shutil.copytree(out / address, lab.etc(host) / "psctl")

    # Not in /tmp, which is private to each sandboxed service; the dynamic user sends to it.
    notify_dir = Path(tempfile.mkdtemp(prefix="psctl-n", dir="/run"))  # short socket paths
    notify_dir.chmod(0o755)
    # The unit's own StateDirectory=psctl (its HOME: its job token lands there), so that the
    # client commands below are typed as deploy.md shows them, with no token flag.
    state_dir = Path(STATE_DIR)
    assert not state_dir.exists(), f"{state_dir} exists: remove it (this test makes its own)"
    state_dir.mkdir(mode=0o755)
    os.chown(state_dir, NOBODY, NOBODY)
    services: dict[str, Service] = {}
    sockets: dict[str, NotifySocket] = {}
    plumbing: list[Service] = []  # tunnels and side-port proxies
    coordinator: subprocess.Popen[bytes] | None = None
    try:
        for host in HOSTS:
            plumbing.append(start_tunnel(lab, host, out, tmp_path, notify_dir))
        mark("every host's tunnel sent READY=1")
        for host in HOSTS:
            plumbing += start_proxies(lab, host, out, tmp_path)
        for task_type, index, host in SERVERS:
            name = f"{task_type}:{index}"
            unit = parse_unit((out / HOSTS[host] / f"psctl-{task_type}@.service").read_text())
            assert value(unit, "Service", "Type") == "notify"
            instance = str(index)
            env = {**BASE_ENV, **service_env(unit, instance, host_path(lab, host))}
            sockets[name] = NotifySocket(notify_dir / f"{task_type}-{index}.sock")
            sockets[name].path.chmod(0o777)
            env["NOTIFY_SOCKET"] = str(sockets[name].path)
            argv = exec_argv(value(unit, "Service", "ExecStart"), instance, env)
            assert argv[0] == str(BIN_DIR / f"{task_type}-server")
            # A ps unit's StateDirectory=psctl: its shards of every checkpoint land there.
            state = values(unit, "Service", "StateDirectory")
            assert state == (["psctl"] if task_type == "ps" else []), state
            writable = [str(state_dir)] if state else []
            services[name] = Service(
                name=name,
                argv=in_job_netns(
                    lab,
                    host,
                    unit,
                    sandboxed(unit, argv, writable=writable, exposed=[PYTHON_HOME, CHECKOUT]),
                ),
                env=env,
                policy=RestartPolicy.of(unit),
                log_path=tmp_path / f"{task_type}-{index}.log",
            )
            services[name].start()
        for name, service in services.items():
            sockets[name].wait_for("READY", "1", count=1, timeout=150, alive=service.alive)
        mark("every server sent READY=1")

        check = psctl(lab, "deploy", "check", "--cluster", f"{CONFIG_DIR}/cluster.json")
        serving = re.findall(r"^(ps|worker) +\d+ +\S+ +\S+ +SERVING$", check, re.M)
        assert len(serving) == len(SERVERS), check
        assert "TF PORT (through the tunnel)" in check, check
        mark("psctl deploy check: all SERVING, every TF port open through the tunnel")
        assert_outsiders_refused(lab, keys.parent)
        mark("refused: the outsider (no keys, then its own key), another uid on ps0")

        unit = parse_unit((out / HOSTS["coord"] / "psctl-coordinator.service").read_text())
        env = {**BASE_ENV, **service_env(unit, "", host_path(lab, "coord"))}
        # What a drop-in would set: this run's state directory and length.
        env.update(
            PSCTL_CHECKPOINT_DIR=str(state_dir / "checkpoints"),
            PSCTL_SUMMARY_JSON=str(state_dir / "summary.json"),
            PSCTL_STEPS=str(STEPS),
            PSCTL_LOG_EVERY="2",
            HOME=str(state_dir),
        )
        argv = exec_argv(value(unit, "Service", "ExecStart"), "", env)
        assert argv[:2] == [str(BIN_DIR / "psctl"), "train"]
        argv = sandboxed(unit, argv, writable=[str(state_dir)], exposed=[PYTHON_HOME, CHECKOUT])
        coordinator_log = tmp_path / "coordinator.log"
        with coordinator_log.open("wb") as log:
            coordinator = subprocess.Popen(
                in_job_netns(lab, "coord", unit, argv),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent(signal.SIGKILL),
            )

        def coordinator_tail() -> str:
            return "\n".join(coordinator_log.read_text(errors="replace").splitlines()[-30:])

        deadline = time.monotonic() + 150
        step = None
        while (step or 0) < KILL_AT_STEP:
            assert coordinator.poll() is None, f"coordinator exited early:\n{coordinator_tail()}"
            assert time.monotonic() < deadline, f"no step {KILL_AT_STEP}:\n{coordinator_tail()}"
            time.sleep(0.5)
            step = global_step(lab)
        mark(f"training at step {step}")
        # The coordinator host's tunnel in psctl status: its peers, and the outsider's
        # handshakes it refused (assert_outsiders_refused).
        status = psctl(lab, "status")
        assert f"tunnel {HOSTS['coord']}: 3 of 3 peers up\n" in status, status
        refused = rf"^tunnel refused \d+ handshake\(s\) from {OUTSIDER_ADDRESS}, "
        assert re.search(refused, status, re.M), status
        mark("psctl status: the tunnel's 3 peers up, the outsider's handshakes refused")
        frames, tls = assert_observer_sees_no_tensor(lab)
        mark(f"ps0's cable: {frames} frames, {tls} TLS segments, no tensor in the clear")

        victim = services["worker:1"]
        killed_pid = victim.kill(signal.SIGKILL)
        mark(f"SIGKILL worker:1 (pid {killed_pid})")
        # Hold the job (in-flight steps finish on worker:0) until worker:1 is back, so that
        # the restarted server has work left to do: else 1500 steps may all be done first.
        psctl(lab, "pause")
        # A checkpoint on request while paused, as an operator takes one (docs/deploy.md).
        saved = psctl(lab, "checkpoint")
        assert CONTROL_TOKEN_FILE.startswith(STATE_DIR) and str(state_dir) in saved, saved
        sockets["worker:1"].wait_for("READY", "1", count=2, timeout=150, alive=victim.alive)
        assert victim.starts == 2 and victim.exits[0] == -signal.SIGKILL, victim.exits
        assert victim.proc is not None and victim.running
        restarted_pid = victim.proc.pid
        step_at_ready = global_step(lab)
        assert step_at_ready is not None and step_at_ready < STEPS, step_at_ready
        mark(f"worker:1 restarted (pid {restarted_pid}): READY=1 again at step {step_at_ready}")
        other = services["worker:0"].proc
        assert other is not None
        cpu_at_ready = cpu_seconds(restarted_pid), cpu_seconds(other.pid)
        psctl(lab, "resume")

        # A ps host's server SIGKILLed: its unit's restart loop brings it back (READY=1
        # again, in the same job namespace, behind the same tunnel) and psctl train's
        # next training process restores the latest checkpoint onto it.
        # Steps first, since the checkpoint taken while paused.
        ps_target = step_at_ready + STEPS_BETWEEN
        deadline = time.monotonic() + 120
        while (step or 0) < ps_target:
            assert coordinator.poll() is None, f"coordinator exited early:\n{coordinator_tail()}"
            assert time.monotonic() < deadline, f"no step {ps_target}:\n{coordinator_tail()}"
            time.sleep(0.5)
            step = global_step(lab)
        ps = services["ps:0"]
        killed_at = step or 0
        mark(f"SIGKILL ps:0 (pid {ps.kill(signal.SIGKILL)}) at step {killed_at}")
        sockets["ps:0"].wait_for("READY", "1", count=2, timeout=150, alive=ps.alive)
        mark("ps:0 restarted: READY=1 again")

        # Back from the latest checkpoint, and on past the step the ps was lost at.
        stop_target = max(STOP_AT_STEP, killed_at + STEPS_BETWEEN)
        deadline = time.monotonic() + 150
        while (step or 0) < stop_target:
            assert coordinator.poll() is None, f"coordinator exited early:\n{coordinator_tail()}"
            assert time.monotonic() < deadline, f"no step {stop_target}:\n{coordinator_tail()}"
            time.sleep(0.5)
            step = global_step(lab)
        mark(f"training at step {step}: psctl stop")
        # As deploy.md types it; it waits (up to its default --timeout, 120 s) until the
        # coordinator's control API is gone.
        stop = run(lab.exec("coord", [str(BIN_DIR / "psctl"), "stop"]), timeout=150)
        assert stop.returncode == 0, f"psctl stop: {stop.stdout}{stop.stderr}"
        assert "coordinator stopped" in stop.stdout, stop.stdout
        mark(f"psctl stop: {' / '.join(stop.stdout.splitlines())}")
        try:
            code = coordinator.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the coordinator did not exit after psctl stop:\n{coordinator_tail()}")
        assert code == 0, coordinator_tail()  # a graceful stop (operations.md: exit 0)
        for name, service in services.items():
            assert service.running, f"{name} is down:\n{service.log_tail()}"
        cpu_used = cpu_seconds(restarted_pid) - cpu_at_ready[0]
        cpu_other = cpu_seconds(other.pid) - cpu_at_ready[1]
        summary = json.loads((state_dir / "summary.json").read_text())
        mark(f"job stopped: {summary}")
        mark(f"CPU since worker:1 came back: worker:1 {cpu_used:.1f}s, worker:0 {cpu_other:.1f}s")
        final_step = summary["global_step"]
        assert STOP_AT_STEP <= final_step < STEPS and summary["stopped_early"], summary
        assert summary["ps_failures"] >= 1 and summary["worker_failures"] >= 1, summary
        assert summary["eval_accuracy"] >= 0.90, summary
        # The final checkpoint stop promises: at the last step, the newest in the directory,
        # after the one requested while paused.
        checkpoints = state_dir / "checkpoints"
        assert summary["checkpoint"] == str(checkpoints / f"ckpt-{final_step}"), summary
        assert (checkpoints / f"ckpt-{final_step}.index").is_file(), sorted(checkpoints.iterdir())
        steps_saved = [int(p.name[5:-6]) for p in checkpoints.glob("ckpt-*.index")]
        assert max(steps_saved) == final_step, steps_saved
        requested = re.search(r" at step (\d+)$", saved.strip())
        assert requested is not None and int(requested[1]) < final_step, saved
        # The restarted server took its share of the steps once back (an idle TF server
        # uses next to no CPU).
        assert cpu_used >= 0.25 * cpu_other, (cpu_used, cpu_other)
        check = psctl(lab, "deploy", "check", "--cluster", f"{CONFIG_DIR}/cluster.json")
        assert check.rstrip().endswith("every TF port open"), check
    finally:
        kill_if_running(coordinator, 10)
        for service in services.values():
            service.stop()
        for service in plumbing:
            service.stop()
        for sock in sockets.values():
            sock.close()
        shutil.rmtree(notify_dir, ignore_errors=True)
        shutil.rmtree(state_dir, ignore_errors=True)
        print("\n".join(marks))
        for service in plumbing:
            if set(service.exits) - {0, -signal.SIGTERM}:
                print(f"--- {service.name} (exits {service.exits})\n{service.log_tail(10)}")
        for name, service in services.items():
            print(f"--- {name} log (starts {service.starts}, exits {service.exits})")
            print(service.log_tail(15))
        with contextlib.suppress(OSError):
            print("--- coordinator log\n" + (tmp_path / "coordinator.log").read_text()[-4000:])


SYNC_STEPS = 600


@pytest.mark.timeout(300)
def test_sync_training_across_namespace_hosts(lab: NetnsLab, tmp_path: Path):
    """`psctl deploy render --strategy sync --keys`: a training unit on each worker host
    (nothing on the ps or coordinator hosts), each started from its rendered ExecStart= and
    environment under the unit's sandbox, in its host's job namespace behind the host's
    tunnel; the two workers all-reduce through the tunnel and the chief (worker 0) writes
    the checkpoints and the summary."""
    cluster_file = tmp_path / "cluster.json"
    write_cluster(cluster_file, HOSTS)  # its chief and ps are ignored in sync mode
    out = tmp_path / "rendered"
    render_protected(cluster_file, out, "--strategy", "sync")
    workers = {"w0": 0, "w1": 1}
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(HOSTS[h] for h in workers)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    states: dict[str, Path] = {}
    tunnels: list[Service] = []
    notify_dir = Path(tempfile.mkdtemp(prefix="psctl-n", dir="/run"))
    try:
        for host in workers:
            shutil.copytree(out / HOSTS[host], lab.etc(host) / "psctl")
            tunnels.append(start_tunnel(lab, host, out, tmp_path, notify_dir))
        for host, index in workers.items():
            unit = parse_unit((out / HOSTS[host] / SYNC_UNIT).read_text())
            states[host] = Path(tempfile.mkdtemp(prefix=f"psctl-sync-{host}", dir="/var/lib"))
            os.chown(states[host], NOBODY, NOBODY)
            env = {**BASE_ENV, **service_env(unit, str(index), host_path(lab, host))}
            env.update(
                PSCTL_CHECKPOINT_DIR=str(states[host] / "checkpoints"),
                PSCTL_SUMMARY_JSON=str(states[host] / "summary.json"),
                PSCTL_STEPS=str(SYNC_STEPS),
                PSCTL_LOG_EVERY="2",
                HOME=str(states[host]),
            )
            argv = exec_argv(value(unit, "Service", "ExecStart"), str(index), env)
            assert argv[:4] == [str(BIN_DIR / "psctl"), "train", "--strategy", "sync"]
            argv = sandboxed(
                unit, argv, writable=[str(states[host])], exposed=[PYTHON_HOME, CHECKOUT]
            )
            with (tmp_path / f"{host}.log").open("wb") as log:
                procs[host] = subprocess.Popen(
                    in_job_netns(lab, host, unit, argv),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=die_with_parent(signal.SIGKILL),
                )
        for host, proc in procs.items():
            tail = lambda h=host: (tmp_path / f"{h}.log").read_text(errors="replace")[-3000:]  # noqa: E731
            try:
                assert proc.wait(timeout=240) == 0, tail()
            except subprocess.TimeoutExpired:
                pytest.fail(f"{host} did not finish:\n{tail()}")
        summary = json.loads((states["w0"] / "summary.json").read_text())
        assert summary["global_step"] == SYNC_STEPS
        assert summary["num_workers"] == 2 and summary["num_ps"] == 0
        assert summary["eval_accuracy"] >= 0.90, summary
        assert not (states["w1"] / "checkpoints").exists()  # only the chief writes
        assert "worker 1 done at global step 600" in (tmp_path / "w1.log").read_text()
    finally:
        for proc in procs.values():
            kill_if_running(proc, 10)
        for tunnel in tunnels:
            tunnel.stop()
        shutil.rmtree(notify_dir, ignore_errors=True)
        for state in states.values():
            shutil.rmtree(state, ignore_errors=True)


TARGET = [f"{HOSTS['ps0']}:{TF_PORT}"]  # a listener on ps0, in its job namespace


def from_job_netns(host: str) -> list[str]:
    return ["ip", "netns", "exec", netns_name(HOSTS[host])]


def wait_open(host: str, why: Callable[[], str]) -> None:
    """Until ``host``'s job namespace connects to TARGET through the tunnels (20 s)."""
    deadline = time.monotonic() + 20
    while connect_all(from_job_netns(host), TARGET, 2) != dict.fromkeys(TARGET, "open"):
        assert time.monotonic() < deadline, why()


@contextlib.contextmanager
def coord_and_ps0(
    lab: NetnsLab, out: Path, tmp_path: Path
) -> Iterator[tuple[dict[str, Service], Path]]:
    """coord's and ps0's tunnels from ``out`` (rendered), a listener at TARGET, and coord
    connected to it: the tunnels by host (a test may add more) and their notify directory,
    all stopped and removed after."""
    notify_dir = Path(tempfile.mkdtemp(prefix="psctl-n", dir="/run"))
    tunnels: dict[str, Service] = {}
    listener: subprocess.Popen[bytes] | None = None
    try:
        for host in ("coord", "ps0"):
            shutil.copytree(out / HOSTS[host], lab.etc(host) / "psctl")
            tunnels[host] = start_tunnel(lab, host, out, tmp_path, notify_dir)
        listener = subprocess.Popen(
            [*from_job_netns("ps0"), SYSTEM_PYTHON, "-m", "http.server", "--bind", HOSTS["ps0"],
             str(TF_PORT)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent(signal.SIGKILL),
        )  # fmt: skip
        wait_open("coord", lambda: "no connection from coord to ps0 through the tunnels")
        yield tunnels, notify_dir
    finally:
        kill_if_running(listener, 5)
        for tunnel in tunnels.values():
            tunnel.stop()
        shutil.rmtree(notify_dir, ignore_errors=True)


def install_and_reload(lab: NetnsLab, host: str, out: Path, tunnel: Service) -> str:
    """``systemctl reload psctl-tunnel`` after installing the host's new tunnel.conf: SIGHUP,
    then its log's "reloaded" line; the log's tail."""
    conf = lab.etc(host) / "psctl" / "tunnel.conf"
    old = conf.read_text()
    shutil.copyfile(out / HOSTS[host] / "tunnel.conf", conf)
    assert conf.read_text() != old
    assert tunnel.proc is not None
    os.kill(tunnel.proc.pid, signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "reloaded" not in tunnel.log_tail(3):
        assert time.monotonic() < deadline, tunnel.log_tail()
        time.sleep(0.1)
    return tunnel.log_tail(3)


@pytest.mark.timeout(120)
def test_keys_rotated_and_reloaded_host_by_host(lab: NetnsLab, tmp_path: Path):
    """docs/deploy.md's rotation: `psctl deploy keys --rotate`, render, install each host's
    new tunnel.conf and `systemctl reload psctl-tunnel.service` (SIGHUP). A host with the
    new keys and a host with the old ones do not reach each other; once both have reloaded,
    they do, with no restart of the tunnel or of what runs in the namespaces."""
    cluster_file = tmp_path / "cluster.json"
    write_cluster(cluster_file, HOSTS)
    out = tmp_path / "rendered"
    render_protected(cluster_file, out, transport="wireguard")
    with coord_and_ps0(lab, out, tmp_path) as (tunnels, _):
        assert_wireguard_outsider_refused(lab, tmp_path, ["coord", "ps0"])
        rotate = [str(BIN_DIR / "psctl"), "deploy", "keys", "--cluster", str(cluster_file)]
        rotate += ["--transport", "wireguard"]
        done = run([*rotate, "--out", str(out.with_name("keys")), "--rotate"], timeout=60)
        assert done.returncode == 0, done.stderr
        render_protected(cluster_file, out, "--force", transport="wireguard")
        states = []
        for host in ("coord", "ps0"):
            install_and_reload(lab, host, out, tunnels[host])
            # A fresh connection each time: only the handshake tells old keys from new (a
            # retried handshake may wait WireGuard's 5 s rekey timeout: 15 s to connect).
            timeout = 6 if host == "coord" else 15
            states.append(connect_all(from_job_netns("coord"), TARGET, timeout)[TARGET[0]])
            assert tunnels[host].starts == 1
        assert states == ["TimeoutError", "open"], states


@pytest.mark.timeout(120)
def test_a_host_joins_behind_the_tunnels_without_restarting_them(lab: NetnsLab, tmp_path: Path):
    """docs/deploy.md's new host: the cluster file gains it, `psctl deploy keys` gives it a
    key (the others' kept), render, install each running host's new tunnel.conf and reload
    (SIGHUP), start the new host's tunnel: it reaches a TF port through the tunnels, and the
    hosts already there keep theirs up, never restarted."""
    cluster_file = tmp_path / "cluster.json"
    first = {"chief": [f"{HOSTS['coord']}:{TF_PORT}"], "ps": [f"{HOSTS['ps0']}:{TF_PORT}"],
             "worker": [f"{HOSTS['ps0']}:{TF_PORT + 1}"]}  # fmt: skip
    cluster_file.write_text(json.dumps({"cluster": first}))
    out = tmp_path / "rendered"
    keys = render_protected(cluster_file, out, transport="wireguard")
    assert sorted(p.name for p in keys.glob("*.key")) == sorted(
        f"{HOSTS[h]}.key" for h in ("coord", "ps0"))  # fmt: skip
    with coord_and_ps0(lab, out, tmp_path) as (tunnels, notify):
        # w1 joins as a second worker.
        before = {p.name: p.read_text() for p in keys.glob("*.key")}
        joined = {**first, "worker": [*first["worker"], f"{HOSTS['w1']}:{TF_PORT}"]}
        cluster_file.write_text(json.dumps({"cluster": joined}))
        render_protected(cluster_file, out, "--force", transport="wireguard")
        assert {p.name: p.read_text() for p in keys.glob("*.key")} == {
            **before, f"{HOSTS['w1']}.key": (keys / f"{HOSTS['w1']}.key").read_text()}  # fmt: skip
        for host in ("coord", "ps0"):
            said = install_and_reload(lab, host, out, tunnels[host])
            assert "2 peers" in said, said
        shutil.copytree(out / HOSTS["w1"], lab.etc("w1") / "psctl")
        tunnels["w1"] = start_tunnel(lab, "w1", out, tmp_path, notify)
        wait_open("w1", tunnels["w1"].log_tail)
        wait_open("coord", tunnels["coord"].log_tail)
        assert tunnels["coord"].starts == tunnels["ps0"].starts == 1
