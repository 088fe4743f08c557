"""Hosts as network namespaces, and the part of systemd the multi-host test stands in for.

`NetnsLab` builds one namespace per host, each with its own 10.x address on eth0, joined by
a bridge that lives in a namespace of its own (so the root namespace's network is never
touched, and deleting the namespaces deletes every link). `ip netns exec NS` bind-mounts
/etc/netns/NS/psctl over /etc/psctl, so each host sees its own rendered files at the path
the units name.

The systemd side: parse a unit, build a service's environment from its Environment= and
EnvironmentFile= lines, expand ExecStart= like systemd ($VAR, ${VAR}, %i), receive sd_notify
datagrams on a NOTIFY_SOCKET, and restart a service the way Restart=on-failure does.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from psctl.cluster.processes.procs import die_with_parent

PREFIX = "psctl-mh"  # namespace names: psctl-mh<pid>-<host>
ETC_NETNS = Path("/etc/netns")

# ---------------------------------------------------------------- systemd units

Unit = list[tuple[str, str, str]]  # (section, key, value), in file order


def parse_unit(text: str) -> Unit:
    """A unit file's settings; comments dropped, continuation lines joined."""
    entries: Unit = []
    section = ""
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ValueError(f"not a unit setting: {raw!r}")
        entries.append((section, key.strip(), value.strip()))
    return entries


def values(unit: Unit, section: str, key: str) -> list[str]:
    return [v for s, k, v in unit if s == section and k == key]


def value(unit: Unit, section: str, key: str) -> str:
    found = values(unit, section, key)
    if len(found) != 1:
        raise AssertionError(f"[{section}] {key}= appears {len(found)} times, not once")
    return found[0]


def unescape_instance(text: str) -> str:
    """systemd's %I: an instance name with `systemd-escape`'s escaping undone."""
    text = text.replace("-", "/")
    return re.sub(r"\\x([0-9a-f]{2})", lambda m: chr(int(m[1], 16)), text)


def specifiers(text: str, instance: str) -> str:
    """%i, %I and %%; any other specifier is a test failure (the helper does not know it)."""

    def sub(match: re.Match[str]) -> str:
        spec = match.group(1)
        if spec == "i":
            return instance
        if spec == "I":
            return unescape_instance(instance)
        if spec == "%":
            return "%"
        raise AssertionError(f"specifier %{spec} in {text!r} is not handled here")

    return re.sub(r"%(.)", sub, text)


def read_env_file(path: Path) -> dict[str, str]:
    """systemd's EnvironmentFile= syntax: KEY=VALUE lines, # or ; comments, quotes."""
    env: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, val = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key.strip()):
            raise AssertionError(f"{path}: not KEY=VALUE: {raw!r}")
        val = val.strip()
        if len(val) >= 2 and val[0] == val[-1] and val[0] in "\"'":
            val = val[1:-1]
        env[key.strip()] = val
    return env


def service_env(unit: Unit, instance: str, path_map: Callable[[str], Path]) -> dict[str, str]:
    """Environment= then every EnvironmentFile= in order (files win, later files win);
    ``path_map`` says where a path the unit names is seen from here."""
    env: dict[str, str] = {}
    for assignment in values(unit, "Service", "Environment"):
        for word in shlex.split(specifiers(assignment, instance)):
            key, _, val = word.partition("=")
            env[key] = val
    for entry in values(unit, "Service", "EnvironmentFile"):
        optional = entry.startswith("-")
        path = path_map(specifiers(entry.removeprefix("-"), instance))
        if not path.exists():
            if optional:
                continue
            raise AssertionError(f"EnvironmentFile {entry} ({path}) does not exist")
        env.update(read_env_file(path))
    return env


def exec_argv(line: str, instance: str, env: Mapping[str, str]) -> list[str]:
    """ExecStart= as systemd runs it: %i, then ${VAR} (one word) and $VAR (split)."""
    line = specifiers(line, instance)
    if line[:1] in "-@:+!":
        raise AssertionError(f"ExecStart prefix {line[0]!r} is not handled here")
    argv: list[str] = []
    for word in shlex.split(line):
        whole = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if whole:  # $VAR alone: split on whitespace, dropped when unset or empty
            argv += env.get(whole.group(1), "").split()
            continue
        argv.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env.get(m[1], ""), word))
    return argv


SANDBOX = Path(__file__).with_name("sandbox.py")


def sandboxed(
    unit: Unit, argv: Sequence[str], *, writable: Sequence[str] = (), exposed: Sequence[str] = ()
) -> list[str]:
    """``argv`` under the unit's sandbox settings, as far as sandbox.py applies them
    (``writable``: this run's stand-ins for StateDirectory=; ``exposed``: directories under
    /root that must stay readable, as this checkout's Python lives there)."""
    from bench.harness.sandbox import APPLIED

    settings: dict[str, object] = {}
    for section, key, val in unit:
        if section != "Service" or key not in APPLIED:
            continue
        if key == "SystemCallFilter":
            filters = settings.setdefault(key, [])
            assert isinstance(filters, list)
            filters.append(val)
        else:
            settings[key] = val
    settings["ReadWritePaths"] = list(writable)
    settings["ExposePaths"] = list(exposed)
    return [sys.executable, str(SANDBOX), json.dumps(settings), "--", *argv]


_CLEAN_SIGNALS = {signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE}


@dataclass(frozen=True)
class RestartPolicy:
    """Restart=, RestartSec= and RestartPreventExitStatus= of a unit."""

    restart: str
    delay: float
    prevent: frozenset[int]

    @classmethod
    def of(cls, unit: Unit) -> RestartPolicy:
        prevent = {
            int(v) for e in values(unit, "Service", "RestartPreventExitStatus") for v in e.split()
        }
        return cls(
            restart=value(unit, "Service", "Restart"),
            delay=float(value(unit, "Service", "RestartSec")),
            prevent=frozenset(prevent),
        )

    def wants_restart(self, returncode: int) -> bool:
        """Restart=on-failure: an unclean exit status or signal, unless prevented."""
        if self.restart != "on-failure":
            raise AssertionError(f"Restart={self.restart} is not handled here")
        if returncode >= 0:
            return returncode != 0 and returncode not in self.prevent
        return signal.Signals(-returncode) not in _CLEAN_SIGNALS


# ---------------------------------------------------------------- sd_notify


class NotifySocket:
    """A NOTIFY_SOCKET datagram listener: every message, with the time it came."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._cond = threading.Condition()  # an RLock: count() works inside wait_for()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self._sock.settimeout(0.2)
        self._closed = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._closed:
            try:
                data = self._sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self._cond:
                self.messages.append((time.monotonic(), fields))
                self._cond.notify_all()

    def count(self, key: str, val: str) -> int:
        with self._cond:
            return sum(1 for _, f in self.messages if f.get(key) == val)

    def wait_for(
        self, key: str, val: str, *, count: int, timeout: float, alive: Callable[[], bool]
    ) -> None:
        """Until ``count`` messages carried KEY=VAL; fails when ``alive()`` turns false or
        ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.count(key, val) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"{self.path.name}: {key}={val} #{count} not received in {timeout:.0f}s; "
                        f"got {[f for _, f in self.messages]}"
                    )
                if not alive():
                    raise AssertionError(f"{self.path.name}: the service exited before {key}={val}")
                self._cond.wait(min(left, 0.5))

    def close(self) -> None:
        self._closed = True
        self._sock.close()
        self._thread.join(timeout=2)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


# ---------------------------------------------------------------- services


@dataclass
class Service:
    """One unit's process with the test's own Restart=on-failure loop (systemd's part)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    policy: RestartPolicy
    log_path: Path
    exits: list[int] = field(default_factory=list)
    starts: int = 0
    proc: subprocess.Popen[bytes] | None = None
    _stopping: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            with self._lock, self.log_path.open("ab") as log:
                if self._stopping.is_set():
                    return
                log.write(f"--- start #{self.starts + 1}: {shlex.join(self.argv)}\n".encode())
                log.flush()
                self.proc = subprocess.Popen(
                    self.argv,
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=die_with_parent(signal.SIGKILL),
                )
                self.starts += 1
            code = self.proc.wait()
            self.exits.append(code)
            if self._stopping.is_set() or not self.policy.wants_restart(code):
                return
            self._stopping.wait(self.policy.delay)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def alive(self) -> bool:
        """Running, or about to be started again by the restart loop."""
        return self._thread is not None and self._thread.is_alive()

    def kill(self, sig: int = signal.SIGKILL) -> int:
        assert self.proc is not None and self.proc.poll() is None, f"{self.name} not running"
        pid = self.proc.pid
        os.kill(pid, sig)
        return pid

    def stop(self, timeout: float = 10.0) -> None:
        """systemctl stop: SIGTERM, then SIGKILL after ``timeout``; no restart."""
        self._stopping.set()
        with self._lock:
            proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


# ---------------------------------------------------------------- namespaces


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def _namespaces() -> list[str]:
    out = ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespace(name: str) -> None:
    """Kill what runs in it, delete it (and so its links), drop its /etc/netns files."""
    pids = ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    ip("netns", "del", name, check=False)
    shutil.rmtree(ETC_NETNS / name, ignore_errors=True)


def remove_stale_labs() -> list[str]:
    """Namespaces left by a test run that was killed (its pid is gone)."""
    removed = []
    for name in _namespaces():
        match = re.fullmatch(rf"{PREFIX}(\d+)-\w+", name)
        if match and not _pid_alive(int(match.group(1))):
            _delete_namespace(name)
            removed.append(name)
    return removed


class NetnsLab:
    """Hosts (name -> IPv4 address on one /24) as network namespaces on one bridge."""

    def __init__(self, hosts: Mapping[str, str], *, prefix_len: int = 24) -> None:
        self.tag = f"{PREFIX}{os.getpid()}"
        self.hosts = dict(hosts)
        self.prefix_len = prefix_len
        self.switch = f"{self.tag}-sw"
        self.created: list[str] = []

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def create(self) -> None:
        for name in [self.switch] + [self.ns(h) for h in self.hosts]:
            ip("netns", "add", name)
            self.created.append(name)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (host, address) in enumerate(self.hosts.items()):
            ns, port = self.ns(host), f"p{i}"
            ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port,
               "netns", self.switch)  # fmt: skip
            ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{address}/{self.prefix_len}", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def etc(self, host: str) -> Path:
        """What `ip netns exec` shows at /etc inside this host (bind-mounted entries)."""
        return ETC_NETNS / self.ns(host)

    def exec(self, host: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def destroy(self) -> None:
        for name in reversed(self.created):
            _delete_namespace(name)
        self.created.clear()

    def set_link(self, host: str, up: bool) -> None:
        """Pull (or plug back) the host's cable: its bridge port goes down, so its packets
        are dropped silently, as on a dead link (no reset, no ICMP)."""
        port = f"p{list(self.hosts).index(host)}"
        ip("-n", self.switch, "link", "set", port, "up" if up else "down")


# ---------------------------------------------------------------- the tests' cluster

TF_PORT = 2222
# (task type, index, lab host) of every server; the chief (the coordinator) is on "coord".
SERVERS = [("ps", 0, "ps0"), ("worker", 0, "w0"), ("worker", 1, "w1")]


def write_cluster(path: Path, hosts: Mapping[str, str]) -> None:
    """The cluster file of a lab with ``hosts`` (name -> address): the chief on "coord",
    SERVERS on theirs, every task at TF_PORT."""
    cluster: dict[str, list[str]] = {"chief": [f"{hosts['coord']}:{TF_PORT}"]}
    for task_type, _, host in SERVERS:
        cluster.setdefault(task_type, []).append(f"{hosts[host]}:{TF_PORT}")
    path.write_text(json.dumps({"cluster": cluster}))
