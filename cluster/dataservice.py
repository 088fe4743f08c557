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


def require_dispatcher(address: str | None, flag: str = "--epochs") -> str:
    """``address``, or a ConfigError naming ``flag`` (--epochs, --follow), which needs it."""
    if address is None:
        raise ConfigError(
            flag,
            "needs the tf.data service, and no dispatcher address is configured",
            f"{_FILE_HINT}, or set {ENV_DISPATCHER} (psctl local does it for you)",
        )
    return address


def start_data_worker(*, dispatcher: str, worker: Address) -> threading.Thread:
    """Host a tf.data service worker on ``worker`` (this task's host, the data port) in this
    process, registered with ``dispatcher``.

    In a thread that first waits for the dispatcher's port to accept connections: the
    dispatcher starts with the coordinator, usually later, and TensorFlow's worker start
    blocks until it registers, holding the GIL (seen: the server's health never came up).
    Once registered, the worker heartbeats from its own threads and registers again with a
    new dispatcher on the same address (a restarted coordinator).
    """
    from psctl.cluster.tf_runtime import data_worker_api

    api = data_worker_api()
    host, port = split_host_port(dispatcher, field="data_service.dispatcher")

    def run() -> None:
        config = api.WorkerConfig(
            dispatcher_address=dispatcher, worker_address=str(worker), port=worker.port
        )
        while True:
            try:
                socket.create_connection((host, port), timeout=1.0).close()
                server: Any = api.WorkerServer(config)
                break
            except Exception as err:  # not up yet, or up but not serving yet (UNIMPLEMENTED)
                log.debug("data worker waits for dispatcher %s: %s", dispatcher, err)
                time.sleep(1.0)
        _DATA_WORKERS.append(server)  # never collected: it serves until the process exits
        log.info("data worker %s registered with dispatcher %s", worker, dispatcher)

    thread = threading.Thread(target=run, name="data-worker", daemon=True)
    thread.start()
    return thread


_DATA_WORKERS: list[Any] = []
