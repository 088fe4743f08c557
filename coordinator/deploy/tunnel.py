"""Between hosts: TensorFlow's traffic only through an authenticated, encrypted tunnel.

TensorFlow serves its tasks on every interface with no authentication (docs/security.md),
so on hosts run from the units of `psctl deploy render` every psctl service lives in a
network namespace of the job's own (``/run/netns/psctl-ADDRESS``, systemd's
NetworkNamespacePath=). Its only interfaces are loopback and a WireGuard interface (run in
user space by Debian's ``wireguard-go``: a kernel may have no WireGuard module), which carries
the host's own cluster-file address, with a route to every other host of the cluster
through it. Cluster files, TF_CONFIG and every port stay as they are; a packet between two
tasks leaves the host only as WireGuard's UDP (ChaCha20-Poly1305, peers authenticated by
their Curve25519 keys), and a host without the cluster's keys reaches no task.

- ``psctl deploy keys``: one key pair per host of the cluster file (``wg genkey``), kept in a
  directory; hosts added later get theirs, existing keys stay (``--rotate`` makes new ones).
- ``psctl deploy render --keys DIR``: each host's ``tunnel.conf`` (``wg setconf``'s format:
  its private key, every peer's public key, endpoint and address).
- ``psctl deploy tunnel``: the psctl-tunnel unit's process (root): makes the namespace if
  missing, runs wireguard-go, moves its interface in, addresses and routes it, says READY=1,
  then logs each peer's handshakes (a host with other keys never completes one).

The side ports (health, /metrics, the control API) reach the host's own network through
systemd-socket-proxyd units (templates/proxy.*.in).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import ipaddress
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from psctl.cluster.errors import ConfigError
from psctl.cluster.processes import sdnotify
from psctl.cluster.tunnel_state import UP_WITHIN, TunnelState, state_path

NETNS_DIR = Path("/run/netns")
LISTEN_PORT = 51820  # WireGuard's UDP port on every host
CONFIG_FILE = "tunnel.conf"
# WireGuard's own bytes on each packet over IPv6 (wg-quick's figure): the tunnel's MTU is
# the path's less this, so that its datagrams are never fragmented.
OVERHEAD = 80
DEFAULT_MTU = 1420  # wireguard-go's own, for a 1500-byte path
KEEPALIVE = 25  # seconds: peers keep handshaking while idle, so a broken one shows
# A peer with no handshake this long after start (or since its last) is reported.
SILENT_AFTER = 60.0
_PACKAGES = {
    "wg": "wireguard-tools",
    "wireguard-go": "wireguard-go",
    "ip": "iproute2",
    "stunnel4": "stunnel4",  # the TLS transport (tls.py)
    "nft": "nftables",
    "nsenter": "util-linux",
}


def tool(name: str) -> str:
    """The path of ``name``, a program a transport runs; ConfigError naming its package."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin:/bin")
    if found is None:
        raise ConfigError(
            "tunnel",
            f"{name} is not installed",
            f"apt-get install {_PACKAGES[name]} (or pass --open-tf-ports: a trusted network only)",
        )
    return found


def tunnel_address(host: str, *, field: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """A cluster host as the tunnel's address: an IP literal (a route needs one)."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        raise ConfigError(
            field,
            f"{host!r} is not an IP address; the tunnel routes the cluster's addresses",
            "name the hosts by IP address in the cluster file, or render with --open-tf-ports "
            "(a trusted network only)",
        ) from None


def netns_name(host: str) -> str:
    """The job's namespace on ``host``: /run/netns/psctl-ADDRESS, NetworkNamespacePath= of
    its units. Named by the host, so that hosts sharing one /run (namespace hosts on one
    machine, a lab) never share one."""
    return f"psctl-{tunnel_address(host, field='--address')}"


def interface_name(host: str) -> str:
    """The WireGuard interface on ``host`` (at most 15 characters, unique per address: the
    UAPI socket /run/wireguard/NAME.sock is shared by hosts that share /run)."""
    address = tunnel_address(host, field="--address")
    return "wgp" + hashlib.blake2s(address.packed, digest_size=6).hexdigest()


def _cidr(host: str, *, field: str) -> str:
    address = tunnel_address(host, field=field)
    return f"{address}/{address.max_prefixlen}"


def _endpoint(host: str, *, field: str) -> str:
    address = tunnel_address(host, field=field)
    return f"[{address}]:{LISTEN_PORT}" if address.version == 6 else f"{address}:{LISTEN_PORT}"


# ---------------------------------------------------------------- keys


def _key_name(host: str) -> str:
    return str(tunnel_address(host, field=f"cluster: host {host}"))


def _wg(*args: str, stdin: str | None = None) -> str:
    proc = subprocess.run(
        [tool("wg"), *args], input=stdin, capture_output=True, text=True, timeout=10
    )
    if proc.returncode != 0:
        raise ConfigError("tunnel", f"wg {' '.join(args)}: {proc.stderr.strip()}", "see wg(8)")
    return proc.stdout.strip()


def make_keys(hosts: Iterable[str], directory: Path, *, rotate: bool = False) -> list[str]:
    """A key pair for every host without one in ``directory`` (all of them with
    ``rotate``): HOST.key (0600) and HOST.pub. Returns the hosts given new keys."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    made = []
    for host in hosts:
        name = _key_name(host)
        private, public = directory / f"{name}.key", directory / f"{name}.pub"
        if private.exists() and public.exists() and not rotate:
            continue
        key = _wg("genkey")
        public.write_text(_wg("pubkey", stdin=key + "\n") + "\n")
        write_private(private, key + "\n")
        made.append(name)
    return made


def write_private(path: Path, text: str) -> None:
    """``text`` into ``path``, mode 0600 from the first byte, replacing it whole: a reader
    (stunnel4 starting meanwhile, a second run) sees the old file or the new one."""
    aside = path.with_name(f".{path.name}.new")
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    aside.replace(path)


def read_key(path: Path, host: str, transport: str) -> str:
    """The key of ``host`` in its file ``path`` of a key directory; ConfigError naming the
    command that makes it (``transport``: its --transport flag) when it is missing."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise ConfigError(
            "--keys",
            f"no key for host {host} ({path} is missing)",
            f"run psctl deploy keys {transport} --cluster FILE --out {path.parent} (it adds "
            "keys for new hosts and keeps the others)",
        ) from None


@dataclass(frozen=True)
class Keys:
    """The cluster's key directory, read for rendering."""

    directory: Path

    def private(self, host: str) -> str:
        return self._read(host, "key")

    def public(self, host: str) -> str:
        return self._read(host, "pub")

    def _read(self, host: str, kind: str) -> str:
        path = self.directory / f"{_key_name(host)}.{kind}"
        text = read_key(path, host, "--transport wireguard")
        if len(text) != 44 or not text.endswith("="):
            raise ConfigError("--keys", f"{path} is not a WireGuard key", "psctl deploy keys")
        return text


def tunnel_conf(host: str, peers: Sequence[str], keys: Keys) -> str:
    """HOST's tunnel.conf in ``wg setconf``'s format: its key, every other host a peer."""
    lines = [
        f"# The psctl tunnel of {host} (psctl deploy render --keys): secret, mode 0600.",
        "# psctl-tunnel.service gives it to `wg setconf`; addresses and routes are its own.",
        "[Interface]",
        f"PrivateKey = {keys.private(host)}",
        f"ListenPort = {LISTEN_PORT}",
    ]
    for peer in peers:
        field = f"cluster: host {peer}"
        lines += [
            "",
            "[Peer]",
            f"# {peer}",
            f"PublicKey = {keys.public(peer)}",
            f"Endpoint = {_endpoint(peer, field=field)}",
            f"AllowedIPs = {_cidr(peer, field=field)}",
            f"PersistentKeepalive = {KEEPALIVE}",
        ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the running tunnel


@dataclass(frozen=True)
class Peer:
    public_key: str
    allowed: tuple[str, ...]
    endpoint: str

    @property
    def name(self) -> str:
        return ", ".join(a.split("/")[0] for a in self.allowed) or self.endpoint


def read_secret(config: Path, holds: str) -> str:
    """A tunnel.conf's text; ConfigError when it is unreadable, or readable by others than
    its owner (it holds ``holds``)."""
    try:
        mode = config.stat().st_mode
        text = config.read_text()
    except OSError as err:
        raise ConfigError(
            "--config", f"cannot read {config}: {err.strerror}", "psctl deploy render --keys"
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            "--config", f"{config} is readable by others (it holds {holds})", "chmod 0600"
        )
    return text


def read_peers(config: Path) -> list[Peer]:
    """The [Peer] sections of a tunnel.conf; ConfigError when it is unreadable, readable by
    others than its owner, or has no private key."""
    text = read_secret(config, "a private key")
    peers: list[Peer] = []
    section, fields = "", dict[str, str]()
    has_key = False
    for raw in [*text.splitlines(), "[End]"]:
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("["):
            if section == "Peer":
                peers.append(
                    Peer(
                        fields.get("PublicKey", ""),
                        tuple(a.strip() for a in fields.get("AllowedIPs", "").split(",") if a),
                        fields.get("Endpoint", ""),
                    )
                )
            section, fields = line.strip("[]"), {}
            continue
        key, _, val = line.partition("=")
        fields[key.strip()] = val.strip()
        has_key = has_key or (section == "Interface" and key.strip() == "PrivateKey")
    if not has_key:
        raise ConfigError("--config", f"{config} has no PrivateKey", "psctl deploy render --keys")
    return peers


def ip_in(netns: str, *args: str) -> None:
    """``ip -n NETNS ARGS``; ConfigError when it fails."""
    _ip("-n", netns, *args)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([tool("ip"), *args], capture_output=True, text=True, timeout=20)
    if check and proc.returncode != 0:
        raise ConfigError("tunnel", f"ip {' '.join(args)}: {proc.stderr.strip()}", "see ip(8)")
    return proc


def _private_mounts() -> bool:
    """Whether /run/netns here is a slave of another mount namespace's (``ip netns exec``
    makes one): a namespace mounted there would be seen by no other process."""
    with open("/proc/self/mountinfo") as mounts:
        for line in mounts:
            fields = line.split(" - ")[0].split()
            if fields[4] == str(NETNS_DIR):
                return any(f.startswith("master:") for f in fields[6:])
    return False


# What wireguard-go says (LOG_LEVEL=verbose) of a handshake from a key that is not a peer's,
# and of one made for a key that is not this host's (it names no source then).
_REFUSED = re.compile(r"Received invalid initiation message from (\S+)|invalid mac1")
REFUSAL_EVERY = 300.0  # seconds: one line per source this often at most


def _relay_log(proc: subprocess.Popen[bytes], state: TunnelState | None = None) -> None:
    """wireguard-go's output, read until it exits: its errors as they are, each handshake it
    refused (a key that is not one of the cluster's) as one line per source every
    REFUSAL_EVERY seconds, and every one counted in ``state``; its banner and routine lines
    dropped."""
    assert proc.stdout is not None
    said: dict[str, float] = {}
    for raw in proc.stdout:
        line = raw.decode(errors="replace").rstrip()
        refused = _REFUSED.search(line)
        if refused:
            source, now = refused[1] or "", time.monotonic()
            if state is not None:
                state.refused(source)
            if now - said.get(source, -REFUSAL_EVERY) >= REFUSAL_EVERY:
                said[source] = now
                print(
                    f"psctl tunnel: refused a handshake from {source}: its key is not one of "
                    "this cluster's (a host outside it, or one whose new keys are not "
                    "reloaded here)"
                    if source
                    else "psctl tunnel: refused a handshake made for another key than this "
                    "host's (its sender has other keys of this cluster's hosts)",
                    flush=True,
                )
        elif line.startswith("ERROR"):
            print(f"psctl tunnel: wireguard-go: {line}", file=sys.stderr, flush=True)


def make_netns(netns: str) -> None:
    """/run/netns/NETNS, unless it is there already (a restarted tunnel: the services in it
    keep running); ConfigError where no other process would see the one made here."""
    if _ip("-n", netns, "link", "show", "lo", check=False).returncode == 0:
        return
    if _private_mounts():
        raise ConfigError(
            "tunnel",
            f"this process has a mount namespace of its own (ip netns exec?): {NETNS_DIR}/"
            f"{netns} made here would be seen by no other process",
            "run psctl deploy tunnel in the host's mount namespace (the psctl-tunnel unit "
            "does; in a lab of namespace hosts: nsenter --net=/run/netns/HOST psctl deploy "
            "tunnel ...)",
        )
    with contextlib.suppress(FileNotFoundError):
        (NETNS_DIR / netns).unlink()  # a file with no namespace mounted on it
    _ip("netns", "add", netns)


def _wait_for_link(interface: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _ip("link", "show", interface, check=False).returncode != 0:
        if proc.poll() is not None:
            raise ConfigError(
                "tunnel",
                f"wireguard-go exited with status {proc.returncode} before {interface} existed",
                "see its lines above (/dev/net/tun must exist)",
            )
        if time.monotonic() > deadline:
            raise ConfigError("tunnel", f"{interface} did not appear in {timeout:.0f}s", "-")
        time.sleep(0.05)


def bring_up(
    *, config: Path, address: str, netns: str, interface: str, state: TunnelState | None = None
) -> tuple[subprocess.Popen[bytes], list[Peer]]:
    """Namespace, wireguard-go, the interface moved in, keyed, addressed and routed."""
    if os.geteuid() != 0:
        raise ConfigError("tunnel", "psctl deploy tunnel needs root", "run it as the unit does")
    peers = read_peers(config)
    cidr = _cidr(address, field="--address")
    tool("wg")
    make_netns(netns)
    _ip("-n", netns, "link", "set", "lo", "up")
    _ip("-n", netns, "link", "del", interface, check=False)  # a dead run's leftover
    _ip("link", "del", interface, check=False)
    proc = subprocess.Popen(
        [tool("wireguard-go"), "-f", interface],
        env={**os.environ, "LOG_LEVEL": "verbose"},  # its refusals: _relay_log keeps those
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    threading.Thread(
        target=_relay_log, args=(proc, state), name="wireguard-go log", daemon=True
    ).start()
    try:
        _wait_for_link(interface, proc, 10.0)
        _wg("setconf", interface, str(config))
        _ip("link", "set", interface, "netns", netns)
        _ip("-n", netns, "address", "add", cidr, "dev", interface)
        _ip("-n", netns, "link", "set", interface, "mtu", str(tunnel_mtu(peers)))
        _ip("-n", netns, "link", "set", interface, "up")
        _route(peers, netns, interface)
    except BaseException:
        proc.terminate()
        proc.wait(5)
        raise
    return proc, peers


def tunnel_mtu(peers: Sequence[Peer]) -> int:
    """The tunnel's MTU as wg-quick sets it: the largest MTU of the links towards the peers'
    endpoints, less OVERHEAD (1500 -> 1420; jumbo frames, 9000 -> 8920: a sixth of the
    packets, each encrypted and passed through the TUN device one by one in user space);
    DEFAULT_MTU when no link says."""
    mtus = [_path_mtu(peer.endpoint.rsplit(":", 1)[0].strip("[]")) for peer in peers]
    known = [mtu for mtu in mtus if mtu]
    return max(known) - OVERHEAD if known else DEFAULT_MTU


def _path_mtu(host: str) -> int:
    """The MTU towards ``host`` in this network namespace: its route's, else its device's;
    0 when neither says (no route, a name rather than an address)."""
    found = _ip("route", "get", host, check=False).stdout
    route = re.search(r"\bmtu (\d+)", found)
    if route:
        return int(route.group(1))
    device = re.search(r"\bdev (\S+)", found)
    if device is None:
        return 0
    # ip, not /sys/class/net: sysfs shows the namespace it was mounted in (nsenter keeps it).
    link = re.search(r"\bmtu (\d+)", _ip("-o", "link", "show", device.group(1), check=False).stdout)
    return int(link.group(1)) if link else 0


def _route(peers: Sequence[Peer], netns: str, interface: str) -> None:
    for peer in peers:
        for allowed in peer.allowed:
            _ip("-n", netns, "route", "replace", allowed, "dev", interface)


def reload(config: Path, netns: str, interface: str) -> list[Peer]:
    """A new tunnel.conf (a host added, keys rotated) applied without taking the interface
    down: ``wg syncconf`` (peers added, changed and removed; established sessions of the
    unchanged ones kept), then a route to every peer."""
    peers = read_peers(config)
    _wg("syncconf", interface, str(config))
    _route(peers, netns, interface)
    return peers


@dataclass(frozen=True)
class PeerSeen:
    """One peer as `wg show IFACE dump` reports it."""

    public_key: str
    endpoint: str
    allowed: str
    handshake: int  # seconds since the epoch; 0: never


def seen(interface: str) -> list[PeerSeen]:
    """Every peer of ``interface`` as WireGuard sees it now (ConfigError when `wg` cannot
    say)."""
    peers = []
    for line in _wg("show", interface, "dump").splitlines()[1:]:  # 1st: the interface's own
        fields = line.split("\t")
        if len(fields) >= 5:
            peers.append(PeerSeen(fields[0], fields[2], fields[3], int(fields[4] or 0)))
    return peers


def peer_states(interface: str) -> list[tuple[str, str, str]]:
    """(allowed addresses, endpoint, last handshake) of every peer of ``interface``, as
    `wg show` sees them; one row saying why when it cannot."""
    try:
        peers = seen(interface)
    except ConfigError as err:
        return [("-", "-", err.problem)]
    now = time.time()
    return [
        (p.allowed, p.endpoint, f"{now - p.handshake:.0f}s ago" if p.handshake else "never")
        for p in peers
    ]


def _report(
    interface: str, peers: Sequence[Peer], stop: threading.Event, state: TunnelState
) -> None:
    """Log each peer going up, and each that stays silent (other keys, or no tunnel there);
    every handshake in ``state``."""
    started = time.time()
    up: dict[str, bool] = {}
    state.handshakes({peer.name: 0 for peer in peers})
    while not stop.wait(5.0):
        try:
            last_handshake = {p.public_key: p.handshake for p in seen(interface)}
        except (ConfigError, subprocess.TimeoutExpired):
            continue
        now = time.time()
        state.handshakes({p.name: last_handshake.get(p.public_key, 0) for p in peers})
        for peer in peers:
            last = last_handshake.get(peer.public_key, 0)
            fresh = last > 0 and now - last < UP_WITHIN
            silent_for = now - (last or started)
            if fresh and not up.get(peer.name):
                print(f"psctl tunnel: {peer.name}: handshake done, traffic flows", flush=True)
                up[peer.name] = True
            elif not fresh and silent_for > SILENT_AFTER and up.get(peer.name, True):
                print(
                    f"psctl tunnel: {peer.name}: no handshake for {silent_for:.0f}s: is "
                    "psctl-tunnel running there, with keys of this cluster's psctl deploy keys?",
                    flush=True,
                )
                up[peer.name] = False


def cmd_tunnel(args: argparse.Namespace) -> int:
    """`psctl deploy tunnel`: bring the tunnel up, say READY=1, run until SIGTERM."""
    netns = args.netns or netns_name(args.address)
    interface = args.interface or interface_name(args.address)
    state = TunnelState(args.address, state_path(args.address))
    proc, peers = bring_up(
        config=Path(args.config),
        address=args.address,
        netns=netns,
        interface=interface,
        state=state,
    )
    stop = threading.Event()
    reloads = threading.Event()

    def on_term(signum: int, frame: object) -> None:
        stop.set()
        proc.terminate()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGHUP, lambda signum, frame: reloads.set())
    print(
        f"psctl tunnel: {interface} in {NETNS_DIR}/{netns} as {args.address}, "
        f"{len(peers)} peers, UDP {LISTEN_PORT}",
        flush=True,
    )
    sdnotify.notify("READY=1")
    watched = list(peers)  # the reporter's view, replaced in place on reload
    reporter = threading.Thread(target=_report, args=(interface, watched, stop, state), daemon=True)
    reporter.start()
    while proc.poll() is None:
        if reloads.wait(0.5):  # systemctl reload: SIGHUP
            reloads.clear()
            sdnotify.notify("RELOADING=1")
            try:
                watched[:] = reload(Path(args.config), netns, interface)
                print(f"psctl tunnel: reloaded {args.config}: {len(watched)} peers", flush=True)
            except ConfigError as err:  # the old configuration stays in force
                print(f"psctl tunnel: reload refused: {err}", file=sys.stderr, flush=True)
            sdnotify.notify("READY=1")
    code = proc.wait()
    stop.set()
    state.path.unlink(missing_ok=True)  # gone with the tunnel (a crash leaves it, stale)
    if code != 0 and not (code == -signal.SIGTERM or stop.is_set()):
        print(f"psctl tunnel: wireguard-go exited with status {code}", file=sys.stderr)
        return 1
    return 0
