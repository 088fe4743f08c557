"""A job's private network namespace: where its TensorFlow ports live.

TensorFlow's gRPC server binds ``0.0.0.0:<port>`` whatever it is told and serves anyone
who connects, with no authentication (docs/security.md). ``psctl local`` therefore runs
the job's TensorFlow servers in a network namespace of their own, made by util-linux's
``unshare`` for this job (with a user namespace when the job's user is not root, which
needs no privilege): its loopback is the job's alone, so no other user of the host and no
other host can open a connection to a TensorFlow port.

Only TensorFlow moves. Each task process starts in the host's namespace, opens its side
ports there (health, /metrics: operators, Prometheus and the launcher reach them as
before), then joins the job's namespace (``enter``) before it imports TensorFlow, so that
every thread TensorFlow starts, and every socket it opens, is the job's. A server also
serves health inside (cluster/health.py), for the training process's health checks.

The namespace is held by one process (``python -m psctl.cluster.netns``, run by
``unshare``), which brings the namespace's loopback up and waits until its launcher goes.
A process joins by its ``/proc/PID/ns/`` files, named in ``PSCTL_JOB_NETNS``: the user
namespace between fork and exec (``join_user``: it must be done single-threaded), the
network namespace when the process is ready (``enter``).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import TypeVar

from psctl.cluster.errors import ConfigError

T = TypeVar("T")

# /proc/PID/ns of the holder, or a named namespace's file (/run/netns/NAME, made by the
# psctl-tunnel unit on hosts); unset: no private namespace.
ENV = "PSCTL_JOB_NETNS"
_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
READY = b"ready\n"


def _setns(path: Path, kind: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, kind) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _same(path: Path, mine: str) -> bool:
    return os.stat(path).st_ino == os.stat(f"/proc/thread-self/ns/{mine}").st_ino


def join_user(environ: Mapping[str, str] = os.environ) -> None:
    """Between fork and exec (a ``preexec_fn``: single-threaded, as setns of a user
    namespace must be): join the job's user namespace, if it has one and this process is
    not in it yet. As its root, the process may later ``enter`` the job's network
    namespace; on the host it stays who it was (same uid for files, signals and ports)."""
    where = environ.get(ENV)
    if not where or not Path(where).is_dir():  # a named namespace has no user namespace
        return
    user = Path(where) / "user"
    if os.geteuid() != 0 and not _same(user, "user"):
        _setns(user, _CLONE_NEWUSER)


def enter(environ: Mapping[str, str] = os.environ) -> bool:
    """Join the job's network namespace (call it before importing TensorFlow, once the
    side ports are open); False when the job has none."""
    where = environ.get(ENV)
    if not where:
        return False
    net = Path(where) / "net" if Path(where).is_dir() else Path(where)
    if not _same(net, "net"):
        _setns(net, _CLONE_NEWNET)
    return True


def run_inside(fn: Callable[[], T], environ: Mapping[str, str] = os.environ) -> T:
    """``fn()`` in the job's network namespace (where TensorFlow's ports are), from a
    thread of its own that joins it: the rest of this process stays where it is. Without
    a private namespace, ``fn()`` as it is."""
    if not environ.get(ENV):
        return fn()
    result: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            enter(environ)
            result.append(fn())
        except BaseException as err:  # raised again in the caller's thread
            failed.append(err)

    thread = threading.Thread(target=run, name="psctl-in-job-netns", daemon=True)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return result[0]


class JobNamespace:
    """The job's network namespace, held by a child process for as long as this object
    lives: ``environ`` names it to the job's processes."""

    def __init__(self) -> None:
        command = ["unshare", "--net"]
        if os.geteuid() != 0:
            command.append("--map-root-user")
        command += [sys.executable, "-m", "psctl.cluster.netns"]
        try:
            self._proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,  # our end closing (we exited) ends the holder
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # the terminal's Ctrl-C is the launcher's
            )
        except FileNotFoundError:
            raise ConfigError(
                "network namespace",
                "unshare (util-linux) is not installed",
                "install util-linux, or pass --open-tf-ports (a trusted network only)",
            ) from None
        assert self._proc.stdout is not None and self._proc.stderr is not None
        line = self._proc.stdout.readline()
        if line != READY:
            self._proc.wait()
            why = self._proc.stderr.read().decode(errors="replace").strip().splitlines()
            raise ConfigError(
                "network namespace",
                f"cannot make the job's private network namespace: {why[-1] if why else '?'}",
                "allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1,"
                " user.max_user_namespaces > 0), run as root, or pass --open-tf-ports (a "
                "trusted network only)",
            )
        self.path = f"/proc/{self._proc.pid}/ns"

    @property
    def environ(self) -> dict[str, str]:
        return {ENV: self.path}

    @contextlib.contextmanager
    def named(self, environ: MutableMapping[str, str] = os.environ) -> Iterator[None]:
        """Meanwhile ``environ`` names this namespace: the processes psctl starts join it."""
        environ.update(self.environ)
        try:
            yield
        finally:
            environ.pop(ENV, None)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()


@contextlib.contextmanager
def job_namespace(environ: MutableMapping[str, str] = os.environ) -> Iterator[JobNamespace]:
    """A namespace for the job, named in ``environ`` while it lasts, gone after."""
    space = JobNamespace()
    try:
        with space.named(environ):
            yield space
    finally:
        space.close()


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


def hold() -> int:
    """The holder, run by ``unshare`` in the new namespace: loopback up, say ready, then
    wait for the launcher's end of stdin to close."""
    try:
        _loopback_up()
    except OSError as err:
        print(f"cannot bring the namespace's loopback up: {err}", file=sys.stderr)
        return 1
    sys.stdout.buffer.write(READY)
    sys.stdout.flush()
    sys.stdin.buffer.read()
    return 0


if __name__ == "__main__":
    sys.exit(hold())
