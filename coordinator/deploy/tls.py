"""Between hosts over TLS: TensorFlow's traffic through stunnel4, in the kernel's TCP.

The other transport of ``psctl deploy tunnel`` (tunnel.py runs WireGuard): the same job
namespace, /run/netns/psctl-ADDRESS, where every psctl service of the host runs, and the
same cluster files, TF_CONFIG and ports. What differs is how a byte leaves the namespace:

- The namespace has loopback only, carrying the host's own cluster address too, and a
  ``local`` route for every other address; one nftables rule there redirects every TCP
  connection to another address to CLIENT_PORT on its loopback. That port is this process's,
  listening in the namespace: for each connection it starts a stunnel4 client on the host's
  network, which reads the connection's original destination (``transparent =
  destination``) and connects there over TLS 1.3.
- On the host's network this process listens at ADDRESS:PORT for the TF port of every task
  of this host in the cluster file (nothing else listens there: TensorFlow's own socket is
  in the namespace); each connection gets a stunnel4 server, in the namespace, connecting to
  127.0.0.1:PORT.
- Peers are authenticated by pre-shared keys, one per host (``psctl deploy keys --transport
  tls``): a client presents its host's identity (its address) and proves its key; a server
  accepts the cluster's hosts' keys only. TLS 1.3 with a PSK still makes an (EC)DHE key per
  connection: AES-GCM, forward secret.
- A connection to another host's side port (health, /metrics, the control API: plain on the
  host's network already, for Prometheus and probes) is copied as it is from the host's
  network, so the coordinator's health checks reach them as before.

Why: the same protection as WireGuard's at a ninth of its CPU per byte on links of MTU 1500
(docs/performance.md, bench/transport_cpu.sh): OpenSSL encrypts records of 16 KB and the
kernel's TCP does the packets, where wireguard-go encrypts and passes each packet through a
TUN device in user space.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import re
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from psctl.cluster import netns as job_netns
from psctl.cluster.address import split_host_port
from psctl.cluster.dataservice import dispatcher_address
from psctl.cluster.errors import ConfigError
from psctl.cluster.ports import DATA_PORT_OFFSET
from psctl.cluster.spec import load_cluster_file
from psctl.cluster.tunnel_state import TunnelState, state_path
from psctl.coordinator.deploy.tunnel import cmd_tunnel as wireguard_tunnel
from psctl.coordinator.deploy.tunnel import (
    ip_in,
    make_netns,
    netns_name,
    read_key,
    read_secret,
    tool,
    tunnel_address,
    write_private,
)

SECTION = "TLS"  # tunnel.conf's first section for this transport ("Interface": WireGuard)
CLIENT_PORT = 51820  # 127.0.0.1 in the job's namespace: every connection to another host
PSK_SUFFIX = ".psk"
_SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
REFUSAL_EVERY = 300.0  # seconds: one line per source (or destination) this often at most
# stunnel4 processes at once, both ways: a host that opens connection after connection gets
# the rest closed at once, not a process each (gRPC keeps a few per pair of tasks).
MAX_CONNECTIONS = 512
# stunnel's line once the TLS handshake is done (LOG6: client "TLS connected", server "TLS
# accepted"): a refused key ends the connection before it.
_HANDSHAKE_DONE = re.compile(r"TLS (connected|accepted): ")


def _ipv4(host: str, *, field: str) -> str:
    address = tunnel_address(host, field=field)
    if address.version != 4:
        raise ConfigError(
            field,
            f"{host} is an IPv6 address; the TLS transport redirects IPv4 only",
            "psctl deploy keys --transport wireguard (IPv6 works through WireGuard)",
        )
    return str(address)


# ---------------------------------------------------------------- keys


def make_psks(hosts: Iterable[str], directory: Path, *, rotate: bool = False) -> list[str]:
    """A pre-shared key for every host without one in ``directory`` (all of them with
    ``rotate``): HOST.psk, 32 random bytes in hex, mode 0600. Returns the hosts given one."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    made = []
    for host in hosts:
        name = _ipv4(host, field=f"cluster: host {host}")
        path = directory / f"{name}{PSK_SUFFIX}"
        if path.exists() and not rotate:
            continue
        write_private(path, secrets.token_hex(32) + "\n")
        made.append(name)
    return made


def holds_psks(directory: Path) -> bool:
    """Whether a key directory is the TLS transport's (``psctl deploy keys --transport tls``)."""
    return any(directory.glob(f"*{PSK_SUFFIX}"))


def psk(directory: Path, host: str) -> str:
    name = _ipv4(host, field=f"cluster: host {host}")
    path = directory / f"{name}{PSK_SUFFIX}"
    text = read_key(path, host, "--transport tls")
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        raise ConfigError("--keys", f"{path} is not a psctl TLS key", "psctl deploy keys")
    return text


def tls_conf(host: str, peers: Sequence[str], directory: Path) -> str:
    """HOST's tunnel.conf for the TLS transport: its key, and every other host's (a server
    accepts those)."""
    lines = [
        f"# The psctl tunnel of {host} over TLS (psctl deploy render --keys): secret, mode 0600.",
        "# psctl-tunnel.service runs stunnel4 with these pre-shared keys (identity: address).",
        f"[{SECTION}]",
        f"Address = {_ipv4(host, field='cluster: host')}",
        f"Key = {psk(directory, host)}",
    ]
    for peer in peers:
        lines += ["", "[Peer]", f"Address = {_ipv4(peer, field='cluster: host')}"]
        lines += [f"Key = {psk(directory, peer)}"]
    return "\n".join(lines) + "\n"


def is_tls_conf(text: str) -> bool:
    return any(line.strip() == f"[{SECTION}]" for line in text.splitlines())


@dataclass(frozen=True)
class TlsConfig:
    address: str
    key: str
    peers: dict[str, str]  # address -> key


def read_tls_conf(config: Path) -> TlsConfig:
    """A TLS tunnel.conf; ConfigError when it is unreadable, readable by others than its
    owner, or lacks this host's key."""
    text = read_secret(config, "keys")
    sections: list[tuple[str, dict[str, str]]] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith("["):
            sections.append((line.strip("[]"), {}))
        elif "=" in line and sections:
            key, _, value = line.partition("=")
            sections[-1][1][key.strip()] = value.strip()
    own = [fields for name, fields in sections if name == SECTION]
    if not own or not own[0].get("Key") or not own[0].get("Address"):
        raise ConfigError(
            "--config", f"{config} has no [{SECTION}] Address and Key", "psctl deploy render --keys"
        )
    peers = {f["Address"]: f["Key"] for name, f in sections if name == "Peer" and "Key" in f}
    return TlsConfig(own[0]["Address"], own[0]["Key"], peers)


# ---------------------------------------------------------------- the running transport


def tf_addresses(cluster_file: str) -> set[tuple[str, int]]:
    """(IPv4 address, port) of everything TensorFlow serves in the cluster file: every
    task, every worker's tf.data service worker (its TF port + DATA_PORT_OFFSET) and the
    data service's dispatcher, if the file names one. What goes over TLS."""
    cluster = load_cluster_file(cluster_file, required=())
    found: set[tuple[str, int]] = set()

    def add(host: str, port: int) -> None:
        with contextlib.suppress(ValueError):
            if 0 < port < 65536:
                found.add((str(ipaddress.ip_address(host.strip("[]"))), port))

    for task_type, _, address in cluster.task_addresses():
        add(address.host, address.port)
        if task_type == "worker":
            add(address.host, address.port + DATA_PORT_OFFSET)
    dispatcher = dispatcher_address(flag=None, cluster_file=cluster_file, environ={})
    if dispatcher:
        add(*split_host_port(dispatcher, field=f"{cluster_file}: data_service.dispatcher"))
    return found


def _original_destination(conn: socket.socket) -> tuple[str, int]:
    raw = conn.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
    port, packed = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(packed), port


def _pump(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(1 << 16):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


def _stunnel_conf(psks: Path, *lines: str) -> str:
    return (
        "\n".join(
            [
                "foreground = yes",  # its log on stderr, read by _run
                "syslog = no",
                "debug = 6",  # info: its handshake line tells a refused connection apart
                f"PSKsecrets = {psks}",
                "sslVersionMin = TLSv1.3",
                "socket = l:TCP_NODELAY=1",
                "socket = r:TCP_NODELAY=1",
                "TIMEOUTbusy = 30",  # a handshake that stalls (a port scan) ends in 30 s
                *lines,
            ]
        )
        + "\n"
    )


class Transport:
    """The host's end: namespace, redirect, listeners, a stunnel4 per connection."""

    def __init__(
        self,
        *,
        config: Path,
        cluster: str,
        netns: str,
        state: TunnelState | None = None,
        listen: str | None = None,
    ) -> None:
        self._config_path, self._cluster, self.netns = config, cluster, netns
        self.config = read_tls_conf(config)
        self._state = state
        self._stop = threading.Event()
        self._lock = threading.Lock()
        # 0700, root's: the keys stunnel4 reads (/run: memory, gone at reboot).
        run_dir = "/run" if os.access("/run", os.W_OK) else None
        self._dir = Path(tempfile.mkdtemp(prefix="psctl-tls-", dir=run_dir))
        self._listeners: dict[int, socket.socket] = {}  # TF port on the host -> listener
        self._client: socket.socket | None = None
        self._children: set[subprocess.Popen[bytes]] = set()
        self._live: dict[str, int] = {}  # peer address -> connections open now
        self._seen: dict[str, float] = {}  # peer address -> last connection up
        self._said: dict[str, float] = {}
        self.tf: set[tuple[str, int]] = set()
        # Where this host's TF ports take TLS on its network: its cluster address, unless
        # its cluster address is another machine's that forwards to it (a lab's relay).
        self.listen = listen or self.config.address
        # Found once (a missing package is one line at start), used for every connection.
        self._stunnel, self._nft, self._nsenter = tool("stunnel4"), tool("nft"), tool("nsenter")

    @property
    def address(self) -> str:
        return self.config.address

    # -- set-up

    def start(self) -> None:
        make_netns(self.netns)
        ip_in(self.netns, "link", "set", "lo", "up")
        ip_in(self.netns, "address", "replace", f"{self.address}/32", "dev", "lo")
        ip_in(self.netns, "route", "replace", "local", "0.0.0.0/0", "dev", "lo")
        rules = (
            "table ip psctl\ndelete table ip psctl\ntable ip psctl {\n chain out {\n"
            "  type nat hook output priority -100; policy accept;\n"
            f"  ip daddr != {{ 127.0.0.0/8, {self.address} }} meta l4proto tcp "
            f"redirect to :{CLIENT_PORT}\n }}\n}}\n"
        )
        done = subprocess.run(
            [self._nsenter, f"--net=/run/netns/{self.netns}", self._nft, "-f", "-"],
            input=rules,
            capture_output=True,
            text=True,
            timeout=20,
        )
        if done.returncode != 0:
            raise ConfigError("tunnel", f"nft in {self.netns}: {done.stderr.strip()}", "see nft(8)")
        self._write_keys()
        path = f"/run/netns/{self.netns}"
        self._client = job_netns.run_inside(
            lambda: socket.create_server(("127.0.0.1", CLIENT_PORT), backlog=128),
            {job_netns.ENV: path},
        )
        threading.Thread(target=self._accept, args=(self._client, None), daemon=True).start()
        self.reload_ports()

    def _write_keys(self) -> None:
        own = f"{self.address}:{self.config.key}\n"
        write_private(self._dir / "client.psk", own)
        peers = "".join(f"{a}:{k}\n" for a, k in self.config.peers.items())
        write_private(self._dir / "server.psk", peers)
        client = ("client = yes", "transparent = destination")
        write_private(self._dir / "client.conf", _stunnel_conf(self._dir / "client.psk", *client))

    def reload_ports(self) -> None:
        """Listeners for this host's TF ports as the cluster file has them now."""
        self.tf = tf_addresses(self._cluster)
        mine = {port for host, port in self.tf if host == self.address}
        with self._lock:
            for port in set(self._listeners) - mine:
                self._listeners.pop(port).close()
            for port in sorted(mine - set(self._listeners)):
                conf = self._dir / f"server-{port}.conf"
                conf.write_text(
                    _stunnel_conf(self._dir / "server.psk", f"connect = 127.0.0.1:{port}")
                )
                try:
                    listener = socket.create_server((self.listen, port), backlog=128)
                except OSError as err:
                    raise ConfigError(
                        "tunnel",
                        f"cannot listen at {self.listen}:{port} for its TF port's TLS: "
                        f"{err.strerror}",
                        "is another process on that port of this host, or the address not "
                        "this host's (--listen)?",
                    ) from None
                self._listeners[port] = listener
                threading.Thread(target=self._accept, args=(listener, port), daemon=True).start()

    def reload(self) -> int:
        """A new tunnel.conf and cluster file: keys, then listeners; returns the peers."""
        self.config = read_tls_conf(self._config_path)
        self._write_keys()
        self.reload_ports()
        return len(self.config.peers)

    # -- connections

    def _accept(self, listener: socket.socket, port: int | None) -> None:
        while not self._stop.is_set():
            try:
                conn, source = listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                full = len(self._children) >= MAX_CONNECTIONS
            if full:
                conn.close()
                self._refused(source[0], f"from {source[0]}:{source[1]}", "too many at once")
                continue
            handle = self._outgoing if port is None else self._incoming
            threading.Thread(target=handle, args=(conn, source, port), daemon=True).start()

    def _outgoing(self, conn: socket.socket, source: tuple[str, int], port: int | None) -> None:
        """A connection from the job's namespace to another host."""
        with conn:
            try:
                target = _original_destination(conn)
            except OSError:
                return
            if target not in self.tf:  # a side port (health, /metrics): plain, as on the host
                self._copy(conn, target)
                return
            argv = [self._stunnel, str(self._dir / "client.conf")]
            self._run(argv, conn, peer=target[0], what=f"to {target[0]}:{target[1]}")

    def _incoming(self, conn: socket.socket, source: tuple[str, int], port: int | None) -> None:
        """A connection from another host to this host's TF port ``port``."""
        with conn:
            argv = [
                self._nsenter, f"--net=/run/netns/{self.netns}",
                self._stunnel, str(self._dir / f"server-{port}.conf"),
            ]  # fmt: skip
            self._run(argv, conn, peer=source[0], what=f"from {source[0]}:{source[1]}")

    def _copy(self, conn: socket.socket, target: tuple[str, int]) -> None:
        try:
            out = socket.create_connection(target, timeout=10)
        except OSError:
            return  # the caller sees its connection closed, as a refusal
        with out:
            out.settimeout(None)
            back = threading.Thread(target=_pump, args=(out, conn), daemon=True)
            back.start()
            _pump(conn, out)
            back.join()

    def _run(self, argv: list[str], conn: socket.socket, *, peer: str, what: str) -> None:
        fd = conn.fileno()
        proc = subprocess.Popen(argv, stdin=fd, stdout=fd, stderr=subprocess.PIPE)
        with self._lock:
            self._children.add(proc)
        assert proc.stderr is not None
        connected, errors = False, []
        try:
            for raw in proc.stderr:
                line = raw.decode(errors="replace").rstrip()
                if not connected and _HANDSHAKE_DONE.search(line):
                    connected = True
                    self._up(peer, +1)
                elif " LOG3[" in line:
                    errors.append(line.split("]: ", 1)[-1])
        finally:
            proc.wait()
            with self._lock:
                self._children.discard(proc)
            if connected:
                self._up(peer, -1)
        if not connected and not self._stop.is_set():
            self._refused(peer, what, errors[-1] if errors else f"stunnel4 exit {proc.returncode}")

    def _up(self, peer: str, change: int) -> None:
        with self._lock:
            first = peer not in self._seen
            self._live[peer] = self._live.get(peer, 0) + change
            self._seen[peer] = time.time()
        if first and change > 0:
            print(f"psctl tunnel: {peer}: TLS connection up, traffic flows", flush=True)
        self._report()

    def _refused(self, peer: str, what: str, why: str) -> None:
        incoming = what.startswith("from")
        if incoming and self._state is not None:
            self._state.refused(peer)  # by address: each connection has a port of its own
        now = time.monotonic()
        if now - self._said.get(peer, -REFUSAL_EVERY) < REFUSAL_EVERY:
            return
        self._said[peer] = now
        if incoming:
            print(
                f"psctl tunnel: refused a TLS connection {what}: {why} (a host outside this "
                "cluster, or one whose new keys are not reloaded here)",
                flush=True,
            )
        else:
            print(
                f"psctl tunnel: no TLS connection {what}: {why}: is psctl-tunnel running there, "
                "with keys of this cluster's psctl deploy keys?",
                flush=True,
            )

    def _report(self) -> None:
        """Every peer's last connection in the state file: now for one with a live one."""
        if self._state is None:
            return
        now = time.time()
        with self._lock:
            seen = {
                peer: (now if self._live.get(peer, 0) > 0 else self._seen.get(peer, 0.0))
                for peer in self.config.peers
            }
        self._state.handshakes(seen)

    def watch(self) -> None:
        """Until close(): the state file kept fresh (connections stay open for hours)."""
        while not self._stop.wait(5.0):
            self._report()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            listeners = [*self._listeners.values(), *([self._client] if self._client else [])]
            self._listeners.clear()
            children = list(self._children)
        for listener in listeners:
            listener.close()
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM)
        shutil.rmtree(self._dir, ignore_errors=True)


def run(
    *,
    config: Path,
    cluster: str | None,
    address: str,
    netns: str,
    state: TunnelState,
    listen: str | None = None,
) -> int:
    """`psctl deploy tunnel` with a TLS tunnel.conf: up, READY=1, until SIGTERM."""
    from psctl.cluster.processes import sdnotify

    if os.geteuid() != 0:
        raise ConfigError("tunnel", "psctl deploy tunnel needs root", "run it as the unit does")
    cluster = cluster or os.environ.get("PSCTL_CLUSTER")
    if not cluster:
        raise ConfigError(
            "--cluster",
            "the TLS transport needs the cluster file",
            "pass --cluster or set PSCTL_CLUSTER (psctl.env does)",
        )
    transport = Transport(config=config, cluster=cluster, netns=netns, state=state, listen=listen)
    if transport.address != _ipv4(address, field="--address"):
        raise ConfigError(
            "--address",
            f"{address} is not the address of {config} ({transport.address})",
            "render again, or pass this host's address",
        )
    stop, reloads = threading.Event(), threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    signal.signal(signal.SIGHUP, lambda signum, frame: reloads.set())
    transport.start()
    threading.Thread(target=transport.watch, daemon=True).start()
    print(
        f"psctl tunnel: TLS in /run/netns/{netns} as {address}, {len(transport.config.peers)} "
        f"peers, {len(transport.tf)} TF ports in the cluster",
        flush=True,
    )
    sdnotify.notify("READY=1")
    try:
        while not stop.wait(0.5):
            if reloads.is_set():
                reloads.clear()
                sdnotify.notify("RELOADING=1")
                try:
                    peers = transport.reload()
                    print(f"psctl tunnel: reloaded {config}: {peers} peers", flush=True)
                except ConfigError as err:
                    print(f"psctl tunnel: reload refused: {err}", file=sys.stderr, flush=True)
                sdnotify.notify("READY=1")
    finally:
        transport.close()
        state.path.unlink(missing_ok=True)
    return 0


def cmd_tunnel(args: argparse.Namespace) -> int:
    """`psctl deploy tunnel`: this host's end of the transport its tunnel.conf names, TLS
    (a [TLS] section) or WireGuard."""
    config = Path(args.config)
    try:
        text = config.read_text()
    except OSError:
        text = ""  # WireGuard's reader says what is wrong with it
    if not is_tls_conf(text):
        return wireguard_tunnel(args)
    return run(
        config=config,
        cluster=args.cluster,
        address=args.address,
        netns=args.netns or netns_name(args.address),
        state=TunnelState(args.address, state_path(args.address)),
        listen=args.listen,
    )
