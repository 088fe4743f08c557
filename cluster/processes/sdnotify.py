"""systemd's sd_notify protocol: one datagram to $NOTIFY_SOCKET (no extra dependency)."""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Mapping

log = logging.getLogger(__name__)


def notify(state: str, *, environ: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``) to systemd. Returns False when not under systemd."""
    env = os.environ if environ is None else environ
    path = env.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):  # abstract namespace socket
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(path)
            sock.sendall(state.encode())
    except OSError as err:
        log.warning("could not notify systemd at %s: %s", env.get("NOTIFY_SOCKET"), err)
        return False
    return True


def watchdog_interval(*, environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings when systemd asks for them (``WatchdogSec=`` sets
    ``WATCHDOG_USEC``, and ``WATCHDOG_PID`` when given must be this process): half the
    timeout, as sd_watchdog_enabled(3) advises. None when there is no watchdog."""
    env = os.environ if environ is None else environ
    usec, pid = env.get("WATCHDOG_USEC", "").strip(), env.get("WATCHDOG_PID", "").strip()
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        timeout = int(usec) / 1e6
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not a number of microseconds", usec)
        return None
    return timeout / 2 if timeout > 0 else None


def keep_watchdog_fed(
    stop: threading.Event, *, environ: Mapping[str, str] | None = None
) -> threading.Thread | None:
    """Under ``WatchdogSec=``: a thread that sends ``WATCHDOG=1`` every half timeout until
    ``stop`` is set. A frozen process (SIGSTOP, a stalled host) sends nothing, and systemd
    kills and restarts it: its peers' calls then fail over instead of waiting on it. None
    when systemd set no watchdog."""
    interval = watchdog_interval(environ=environ)
    if interval is None:
        return None

    def feed() -> None:
        while not stop.wait(interval):
            notify("WATCHDOG=1", environ=environ)

    thread = threading.Thread(target=feed, name="sd-watchdog", daemon=True)
    thread.start()
    log.info("systemd watchdog: a ping every %.1fs", interval)
    return thread
