"""What a host's tunnel process (``psctl deploy tunnel``, deploy/tunnel.py) last saw, in a
small file that any local process may read (it holds no secret): each peer's last
handshake, and the handshakes it refused. The tunnel process writes it every few seconds
and at each refusal; the coordinator puts its host's in ``psctl status``
(operations/service.py)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

STATE_DIR = Path("/run/psctl-tunnel")
STALE_AFTER = 30.0  # seconds without a write: the tunnel process is not running
# A peer is up while its last handshake is this recent: WireGuard renews one every 2 minutes
# of traffic, and keepalives (25 s) keep traffic flowing; 1 minute of slack.
UP_WITHIN = 180.0 + 60.0


def state_path(address: str) -> Path:
    return STATE_DIR / f"{address.strip('[]')}.json"


class TunnelState:
    """The tunnel process's view, written to ``path`` (atomically, mode 0644) as it
    changes."""

    def __init__(self, address: str, path: Path) -> None:
        self.address = address
        self.path = path
        self._lock = threading.Lock()
        self._peers: dict[str, float] = {}  # address -> last handshake (0: never)
        self._refused: dict[str, tuple[int, float]] = {}  # source -> (count, last)

    def handshakes(self, seen: dict[str, float]) -> None:
        """Each peer's last handshake (``seen``: address -> seconds since the epoch, 0)."""
        with self._lock:
            self._peers = dict(seen)
        self.write()

    def refused(self, source: str) -> None:
        """One more refused handshake from ``source`` ("" where WireGuard names none)."""
        with self._lock:
            count, _ = self._refused.get(source, (0, 0.0))
            self._refused[source] = (count + 1, time.time())
        self.write()

    def write(self) -> None:
        with self._lock:
            state = {
                "address": self.address,
                "updated": time.time(),
                "peers": [{"address": a, "handshake": t} for a, t in sorted(self._peers.items())],
                "refused": [
                    {"source": s, "count": c, "last": t}
                    for s, (c, t) in sorted(self._refused.items())
                ],
            }
            try:
                self.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
                aside = self.path.with_name(f".{self.path.name}.{os.getpid()}")
                aside.write_text(json.dumps(state))
                aside.chmod(0o644)
                os.replace(aside, self.path)
            except OSError:
                pass  # a status without the tunnel's view; the journal has every line


def read_state(address: str) -> dict[str, Any] | None:
    """What the tunnel process of ``address`` last wrote, or None (no tunnel here)."""
    try:
        found = json.loads(state_path(address).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None
