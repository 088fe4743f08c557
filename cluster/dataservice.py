"""Where the tf.data service lives (``--epochs``): the dispatcher's address, shared by the
coordinator (which runs the dispatcher) and the worker servers (which host its data workers).

The address comes from a flag, else ``$PSCTL_DATA_DISPATCHER``, else the cluster file's
``"data_service": {"dispatcher": "host:port"}``. No TensorFlow import here.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from psctl.cluster.address import Address, split_host_port
from psctl.cluster.errors import ConfigError

log = logging.getLogger(__name__)

ENV_DISPATCHER = "PSCTL_DATA_DISPATCHER"
FILE_KEY = "data_service"
_FILE_HINT = 'add "data_service": {"dispatcher": "HOST:PORT"} to the cluster file'


def dispatcher_address(
    *, flag: str | None, cluster_file: str | None, environ: Mapping[str, str]
) -> str | None:
    """The dispatcher's ``host:port``, or None when none is configured."""
    if flag:
        address, field = flag, "--data-dispatcher"
    elif environ.get(ENV_DISPATCHER):
        address, field = environ[ENV_DISPATCHER], ENV_DISPATCHER
    elif cluster_file:
        found = _from_file(cluster_file)
        if found is None:
            return None
        address, field = found, f"{cluster_file}: {FILE_KEY}.dispatcher"
    else:
        return None
    split_host_port(address, field=field)  # one clear line for a bad address
    return address


def _from_file(path: str) -> str | None:
    try:
        top = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None  # the cluster file's own parser reports these
    section = top.get(FILE_KEY) if isinstance(top, dict) else None
    if section is None:
        return None
    address = section.get("dispatcher") if isinstance(section, dict) else None
    if not isinstance(address, str):
        raise ConfigError(f"{path}: {FILE_KEY}", "has no dispatcher address string", _FILE_HINT)
    return address


def require_dispatcher(address: str | None) -> str:
    if address is None:
        raise ConfigError(
            "--epochs",
            "needs the tf.data service, and no dispatcher address is configured",
            f"{_FILE_HINT}, or set {ENV_DISPATCHER} (psctl local does it for you)",
        )
    return address


UP, REFUSED, UNKNOWN = "up", "refused", "unknown"
PROBE_EVERY = 0.5  # seconds between probes of the dispatcher's port
GONE_AFTER = 2  # refused connections in a row: no dispatcher listens any more


def probe(host: str, port: int, timeout: float = 1.0) -> str:
    """UP: something listens on the dispatcher's port; REFUSED: nothing does (its process
    is gone); UNKNOWN: no answer in time, or another error (it may be only slow, or frozen:
    a stopped process's socket still completes connections)."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except ConnectionRefusedError:
        return REFUSED
    except OSError:
        return UNKNOWN
    return UP


class DispatcherWatch:
    """When the data worker must start (a dispatcher listens and none is served) or stop
    (the one it served is gone: refused ``GONE_AFTER`` times in a row), from probes."""

    def __init__(self) -> None:
        self.serving = False
        self.refused = 0

    def observe(self, result: str) -> str | None:
        """ "start", "stop" or None, for one probe's result."""
        self.refused = self.refused + 1 if result == REFUSED else 0
        if self.serving and self.refused >= GONE_AFTER:
            self.serving = False
            return "stop"
        if result == UP and not self.serving:
            self.serving = True
            return "start"
        return None


def start_data_worker(*, dispatcher: str, worker: Address) -> threading.Thread:
    """Host a tf.data service worker on ``worker`` (this task's host, the data port) in this
    process, registered with ``dispatcher``; afresh for each dispatcher that comes.

    In a thread that probes the dispatcher's port: the dispatcher starts with the
    coordinator, usually later, and TensorFlow's worker start blocks until it registers,
    holding the GIL (seen: the server's health never came up). When the dispatcher's process
    is gone (the coordinator exited or died), the data worker stops, and a new one starts
    when a dispatcher listens again. TensorFlow's data worker would register again by itself,
    but with the old dispatcher's tasks, and a new dispatcher (a new job's coordinator) numbers
    its tasks from the start again: the data worker then served the old tasks under the new
    numbers, and the new job's passes ended at once with nothing trained (seen: 0 examples
    in a second ``psctl train --epochs`` on the same servers; tests/integration/
    test_epochs.py). A coordinator restarted within one run recovers its dispatcher's state
    from a journal instead (coordinator/training/epochs.py), so a data worker frozen across
    that restart is still right.
    """
    import tensorflow as tf

    host, port = split_host_port(dispatcher, field="data_service.dispatcher")
    config = tf.data.experimental.service.WorkerConfig(
        dispatcher_address=dispatcher, worker_address=str(worker), port=worker.port
    )

    def run() -> None:
        watch = DispatcherWatch()
        while True:
            action = watch.observe(probe(host, port))
            if action == "stop" and _DATA_WORKERS:
                _DATA_WORKERS.pop().stop()
                log.warning(
                    "dispatcher %s is gone: data worker %s stopped; a new one starts, without "
                    "the old dispatcher's tasks, when a dispatcher listens again",
                    dispatcher,
                    worker,
                )
            elif action == "start":
                try:
                    server: Any = tf.data.experimental.service.WorkerServer(config)
                except Exception as err:  # up but not serving yet (UNIMPLEMENTED)
                    log.debug("data worker waits for dispatcher %s: %s", dispatcher, err)
                    watch.serving = False
                else:
                    _DATA_WORKERS.append(server)  # serves until stopped or the process exits
                    log.info("data worker %s registered with dispatcher %s", worker, dispatcher)
            time.sleep(PROBE_EVERY)

    thread = threading.Thread(target=run, name="data-worker", daemon=True)
    thread.start()
    return thread


_DATA_WORKERS: list[Any] = []
