"""Run a command under the sandbox a systemd unit's [Service] settings describe, as far as
a test can without systemd: ``python sandbox.py SETTINGS_JSON -- ARGV...`` (as root).

The multi-host test starts every server and the coordinator through this, from their
rendered units, so that TensorFlow serves and trains under the units' sandbox. What is
applied here (each as systemd does it):

- DynamicUser=yes: a user and group of their own (nobody, 65534), no supplementary groups;
  the same for every unit, as User=psctl asks of systemd (one transient user per host)
- NoNewPrivileges=yes, CapabilityBoundingSet= (empty), UMask=
- SystemCallFilter= (an allow list, then ~ lists taken out; groups expanded by
  `systemd-analyze syscall-filter`), SystemCallErrorNumber=, RestrictAddressFamilies=
  (socket() of any other family fails with EAFNOSUPPORT): one seccomp filter
- ProtectSystem=strict (every mount read-only but /dev and /proc), StateDirectory= and
  ReadWritePaths= (passed in SETTINGS_JSON as "ReadWritePaths": the test's own paths),
  PrivateTmp=yes, ProtectHome=yes, ProtectKernelTunables=yes (/proc/sys, /sys read-only),
  ProtectControlGroups=yes, ProtectProc=invisible, PrivateMounts=yes: a mount namespace

Not applied (TensorFlow does nothing these would stop, or they need systemd itself):
PrivateDevices, ProtectKernelModules, ProtectKernelLogs, ProtectClock, ProtectHostname,
RestrictNamespaces, RestrictRealtime, RestrictSUIDSGID, LockPersonality,
SystemCallArchitectures, MemoryDenyWriteExecute (=false in the units).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

APPLIED = frozenset(
    {
        "DynamicUser",
        "NoNewPrivileges",
        "CapabilityBoundingSet",
        "UMask",
        "SystemCallFilter",
        "SystemCallErrorNumber",
        "RestrictAddressFamilies",
        "ProtectSystem",
        "StateDirectory",
        "ReadWritePaths",
        "PrivateTmp",
        "ProtectHome",
        "ProtectKernelTunables",
        "ProtectControlGroups",
        "ProtectProc",
        "PrivateMounts",
    }
)
# In the units, but not applied here (see the docstring).
NOT_APPLIED = frozenset(
    {
        "PrivateDevices",
        "ProtectKernelModules",
        "ProtectKernelLogs",
        "ProtectClock",
        "ProtectHostname",
        "RestrictNamespaces",
        "RestrictRealtime",
        "RestrictSUIDSGID",
        "LockPersonality",
        "SystemCallArchitectures",
        "MemoryDenyWriteExecute",
        # What they ask (every psctl unit of a host shares one transient user) holds here
        # anyway: DynamicUser= runs every sandboxed process as nobody.
        "User",
        "Group",
    }
)
NOBODY = 65534

_libc = ctypes.CDLL(None, use_errno=True)
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_CLONE_NEWNS = 0x00020000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MOUNT_FLAGS = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC}


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    _check(
        _libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def _mounts() -> list[tuple[str, int]]:
    """Every mount point and its per-mount flags (nosuid, nodev, noexec), outermost first."""
    found = []
    with open("/proc/self/mountinfo") as info:
        for line in info:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            flags = sum(_MOUNT_FLAGS.get(o, 0) for o in fields[5].split(","))
            found.append((point, flags))
    return sorted(set(found), key=lambda m: m[0].count("/"))


def _under(path: str, roots: Sequence[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _read_only(point: str, flags: int) -> None:
    _mount(None, point, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | flags)


def mount_namespace(
    settings: Mapping[str, str], writable: Sequence[str], exposed: Sequence[str] = ()
) -> None:
    """``exposed``: directories under /home or /root that stay visible, read-only, under
    ProtectHome= (here: the Python this checkout's venv points to, in /root/.pyenv; a
    real host installs psctl elsewhere, docs/deploy.md)."""
    _check(_libc.unshare(_CLONE_NEWNS), "unshare")
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    for path in writable:  # own mounts, so that the read-only pass can leave them be
        _mount(path, path, None, _MS_BIND | _MS_REC)
    if settings.get("ProtectProc", "default") != "default":
        _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC,
               f"hidepid={settings['ProtectProc']}")  # fmt: skip
    if settings.get("ProtectKernelTunables") == "yes":
        _mount("/proc/sys", "/proc/sys", None, _MS_BIND | _MS_REC)
    if settings.get("ProtectSystem") == "strict":
        for point, flags in _mounts():
            if _under(point, ["/dev", *writable]) or (
                _under(point, ["/proc"]) and point != "/proc/sys"
            ):
                continue
            try:
                _read_only(point, flags)
            except OSError as err:
                if err.errno not in (errno.EACCES, errno.ENOENT, errno.EINVAL):
                    raise
    else:
        for key, roots in (
            ("ProtectKernelTunables", ["/proc/sys", "/sys"]),
            ("ProtectControlGroups", ["/sys/fs/cgroup"]),
        ):
            if settings.get(key) == "yes":
                for point, flags in _mounts():
                    if _under(point, roots):
                        _read_only(point, flags)
    if settings.get("PrivateTmp") == "yes":
        for tmp in ("/tmp", "/var/tmp"):
            # A fresh /tmp; a checkout that lives under it (a CI clone) stays readable.
            _cover(tmp, exposed, "mode=1777", read_only=False)
    if settings.get("ProtectHome") == "yes":
        for home in ("/home", "/root", "/run/user"):
            if os.path.isdir(home):
                _cover(home, exposed, "mode=0711", read_only=True)


def _cover(root: str, exposed: Sequence[str], mode: str, *, read_only: bool) -> None:
    """An empty tmpfs over ``root``, with the ``exposed`` paths under it bound back in
    read-only (as systemd's BindReadOnlyPaths= would); with none, ProtectHome's root is
    closed (mode 000)."""
    keep = [(p, os.open(p, os.O_PATH | os.O_DIRECTORY)) for p in exposed if _under(p, [root])]
    if read_only and not keep:
        mode = "mode=000"
    _mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, mode)
    for path, fd in keep:
        os.makedirs(path, mode=0o711, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
        _read_only(path, 0)
        os.close(fd)
    if read_only:
        _read_only(root, _MS_NOSUID | _MS_NODEV)


@functools.cache
def syscall_group(name: str) -> frozenset[str]:
    """A system call name, or a group expanded as systemd does (@groups nest)."""
    if not name.startswith("@"):
        return frozenset({name})
    out = subprocess.run(
        ["systemd-analyze", "syscall-filter", name],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    calls: set[str] = set()
    for line in out.splitlines()[1:]:
        word = line.strip()
        if word and not word.startswith("#"):
            calls |= syscall_group(word)
    return frozenset(calls)


def allowed_syscalls(filters: Sequence[str]) -> frozenset[str]:
    """SystemCallFilter= lines: the first is the allow list, each ~line takes calls out."""
    allowed: set[str] = set()
    for i, line in enumerate(filters):
        deny = line.startswith("~")
        names = set().union(*(syscall_group(w) for w in line.removeprefix("~").split()))
        if i == 0 and deny:
            raise ValueError("a deny list first is not handled here")
        allowed = allowed - names if deny else allowed | names
    return frozenset(allowed)


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_CMP_EQ = 4


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


def seccomp(calls: frozenset[str], *, error: int, families: Sequence[int] | None) -> None:
    lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCmp),
    ]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(_errno_action(error))
    if not ctx:
        raise OSError("seccomp_init failed")

    def rule(action: int, name: str, args: Sequence[_ArgCmp] = ()) -> None:
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:
            return  # not a call of this architecture (systemd skips those too)
        array = (_ArgCmp * max(1, len(args)))(*args)
        result = lib.seccomp_rule_add_array(ctx, action, number, len(args), array)
        if result != 0:
            raise OSError(-result, f"seccomp rule {name}: {os.strerror(-result)}")

    for name in sorted(calls):
        if name == "socket" and families is not None:
            continue
        rule(_SCMP_ACT_ALLOW, name)
    if families is not None and "socket" in calls:
        for family in range(64):
            action = _SCMP_ACT_ALLOW if family in families else _errno_action(errno.EAFNOSUPPORT)
            rule(action, "socket", [_ArgCmp(0, _SCMP_CMP_EQ, family, 0)])
    result = lib.seccomp_load(ctx)
    if result != 0:
        raise OSError(-result, "seccomp_load")


def main(argv: Sequence[str]) -> None:
    settings_json, sep, *command = argv
    if sep != "--" or not command:
        raise SystemExit("usage: sandbox.py SETTINGS_JSON -- ARGV...")
    settings: dict[str, object] = json.loads(settings_json)
    flat = {k: v for k, v in settings.items() if isinstance(v, str)}
    writable = [str(p) for p in settings.get("ReadWritePaths", [])]  # type: ignore[union-attr]
    filters = [str(f) for f in settings.get("SystemCallFilter", [])]  # type: ignore[union-attr]
    calls = allowed_syscalls(filters) if filters else None  # before the mounts hide /usr/bin
    families = None
    if "RestrictAddressFamilies" in flat:
        families = [int(getattr(socket, n)) for n in flat["RestrictAddressFamilies"].split()]
    exposed = [str(p) for p in settings.get("ExposePaths", [])]  # type: ignore[union-attr]
    mount_namespace(flat, writable, exposed)
    if flat.get("CapabilityBoundingSet") == "":
        last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
        for cap in range(last + 1):
            _check(_libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")
    if flat.get("DynamicUser") == "yes":
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
    if "UMask" in flat:
        os.umask(int(flat["UMask"], 8))
    if flat.get("NoNewPrivileges") == "yes":
        _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    if calls is not None:
        error = getattr(errno, flat.get("SystemCallErrorNumber", "EPERM"))
        seccomp(calls, error=error, families=families)
    os.execv(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
