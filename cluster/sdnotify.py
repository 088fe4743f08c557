"""systemd's sd_notify protocol: one datagram to $NOTIFY_SOCKET (no extra dependency)."""

from __future__ import annotations

import logging
import os
import socket
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
