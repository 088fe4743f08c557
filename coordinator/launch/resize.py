"""Resizing a running job's cluster (``psctl scale``; ``psctl train`` also on SIGHUP).

TensorFlow's servers take the cluster a coordinator gives them (a server started for one
cluster serves a coordinator whose cluster has more or fewer tasks, or gives it another
index: measured, TF 2.21), but a ``ClusterCoordinator`` never changes its cluster. So a
resize is: the new servers answer health checks (psctl local starts them; on real hosts
the operator did), the cluster file is rewritten, the training process is told to
checkpoint at the current step and exit (``RESIZE_SIGNAL``), and the supervisor starts a
fresh one on the new cluster, which restores that checkpoint: no step lost, tables
re-split over the new number of ps tasks. No restart is counted.
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from psctl.cluster import health
from psctl.cluster.errors import ConfigError
from psctl.cluster.ports import HealthAddresses
from psctl.cluster.processes.files import write_json_atomic
from psctl.cluster.spec import ClusterConfig, parse_cluster_json
from psctl.control.v1 import control_pb2
from psctl.coordinator.launch.supervisor import TrainingSupervisor
from psctl.coordinator.operations.front import ControlFront, Refused

log = logging.getLogger(__name__)

LEFT_SHOWN = 16  # tasks that left in earlier generations, listed LEFT by psctl status
Member = tuple[str, int, str]  # (type, index, address) of a ps or worker task


def shape(cluster: ClusterConfig) -> str:
    return shape_of(cluster.num_ps, cluster.num_workers)


def shape_of(num_ps: int, num_workers: int) -> str:
    """How a resize's shapes read everywhere (summary, status, logs)."""
    return f"{num_ps} ps + {num_workers} workers"


def members(cluster: ClusterConfig) -> list[Member]:
    return [t for t in cluster.tasks() if t[0] in ("ps", "worker")]


class Membership:
    """What psctl status shows of the cluster beyond the running training process's own
    tasks, as the launcher knows it: the generation (the supervisor's resizes), during a
    resize the tasks JOINING (in the new cluster only) and DRAINING (in the old only), and
    the tasks that left (the newest ``LEFT_SHOWN``, matched by address). ``apply`` is the
    control front's hook on every status it answers."""

    def __init__(self, supervisor: TrainingSupervisor) -> None:
        self.supervisor = supervisor
        self._lock = threading.Lock()
        self._left: collections.deque[Member] = collections.deque(maxlen=LEFT_SHOWN)
        self._target: list[Member] | None = None  # where a resize under way goes
        self._going: list[Member] = []
        self._coming: set[str] = set()  # addresses in the target only

    def resize(self, old: ClusterConfig, new: ClusterConfig) -> None:
        """A resize from ``old`` to ``new`` was asked for."""
        target = members(new)
        addresses = {address for _, _, address in target}
        before = {address for _, _, address in members(old)}
        with self._lock:
            self._target = target
            self._going = [t for t in members(old) if t[2] not in addresses]
            self._coming = addresses - before

    def left(self, tasks: list[Member]) -> None:
        """Tasks that left the cluster (a worker stopped, or was lost for --drop-after)."""
        with self._lock:
            self._left.extend(tasks)

    def apply(self, status: control_pb2.Status) -> None:
        status.cluster_generation = len(self.supervisor.counters.resizes)
        with self._lock:
            if self._target is not None and not self.supervisor.resizing:
                self._left.extend(self._going)  # done: the new process runs without them
                self._target, self._going, self._coming = None, [], set()
            target, coming, left = self._target, set(self._coming), list(self._left)
        listed = {t.address for t in status.tasks if t.type in ("ps", "worker")}
        if target is not None:
            addresses = {address for _, _, address in target}
            for task in status.tasks:
                going = task.type in ("ps", "worker") and task.address not in addresses
                if going and task.state != control_pb2.TASK_STATE_LEFT:
                    task.state = control_pb2.TASK_STATE_DRAINING
                elif task.address in coming:  # psctl local lists its new servers at once
                    task.state = control_pb2.TASK_STATE_JOINING
            for task_type, index, address in target:
                if address not in listed:
                    status.tasks.append(
                        _row(task_type, index, address, control_pb2.TASK_STATE_JOINING)
                    )
                    listed.add(address)
        for task_type, index, address in reversed(left):
            if address not in listed:
                status.tasks.append(_row(task_type, index, address, control_pb2.TASK_STATE_LEFT))
                listed.add(address)


def _row(task_type: str, index: int, address: str, state: Any) -> control_pb2.Task:
    return control_pb2.Task(
        type=task_type,
        index=index,
        address=address,
        health=control_pb2.TASK_HEALTH_UNKNOWN,
        state=state,
    )


UNDER_WAY = (
    "another resize is under way (its new servers are awaited, or the training process "
    "restarts on them): try again when it is done (psctl status shows the new cluster)"
)


def server_wait(limit: float, time_left: float | None) -> float:
    """Seconds to wait for a new cluster's servers: ``limit``, or less where the caller gives
    up sooner (``time_left``), with 2 s to spare for the refusal to reach it."""
    return limit if time_left is None else max(1.0, min(limit, time_left - 2.0))


class Resizer:
    """What a launcher's front calls for a Scale request (one at a time): ``prepare(request)``
    makes the new cluster ready and returns (old shape, new shape); then the supervisor asks
    the training process for a fresh start on it."""

    def __init__(
        self,
        supervisor: TrainingSupervisor,
        prepare: Callable[[Any, float | None], tuple[str, str]],
        *,
        checkpoints: bool,
        cluster: Callable[[], ClusterConfig],
        membership: Membership | None = None,
    ) -> None:
        self.supervisor = supervisor
        self.prepare = prepare
        self.checkpoints = checkpoints
        self.cluster = cluster  # the launcher's, before and after ``prepare``
        self.membership = membership
        self._lock = threading.Lock()

    def __call__(
        self, request: Any, time_left: float | None = None, *, reason: str = "psctl scale"
    ) -> control_pb2.ScaleResponse:
        """``time_left``: seconds until the caller gives up (the Scale RPC's deadline): the
        wait for new servers ends a little before, so that its refusal reaches the caller.
        ``reason``: the summary's for this resize."""
        if not self.checkpoints:
            raise ConfigError(
                "--checkpoint-dir",
                "a resize goes on from a checkpoint at the current step, and this job has none",
                "run the job with --checkpoint-dir to resize it",
            )
        if not self._lock.acquire(blocking=False):
            raise Refused(UNDER_WAY)
        try:
            if self.supervisor.resizing:
                raise Refused(UNDER_WAY)
            before = self.cluster()
            try:
                old, new = self.prepare(request, time_left)
            except (ConfigError, Refused) as err:
                log.warning("resize refused: %s", err)
                raise
            if self.membership is not None:
                self.membership.resize(before, self.cluster())
            if not self.supervisor.request_resize(old=old, new=new, reason=reason):
                raise Refused("the job is stopping")
            # The resize under way, or one recorded already for the next training process.
            resizes = len(self.supervisor.counters.resizes)
            generation = resizes + 1 if self.supervisor.resizing else resizes
            return control_pb2.ScaleResponse(
                cluster_generation=generation,
                message=f"{old} -> {new}: checkpointing, then training goes on on the new "
                f"cluster (generation {generation})",
            )
        finally:
            self._lock.release()


def elastic(
    front: ControlFront,
    supervisor: TrainingSupervisor,
    *,
    prepare: Callable[[Any, float | None], tuple[str, str]],
    cluster: Callable[[], ClusterConfig],
    without: Callable[[list[Member]], tuple[str, str]],
    checkpoints: bool,
) -> Resizer:
    """A launcher's resizing, wired in one place for ``psctl local`` and ``psctl train``:
    the front shows the membership in every status and takes ``psctl scale`` (``prepare``:
    the launcher's way to a new cluster; ``cluster``: its cluster now), and tasks that leave
    are taken out (``without(tasks)``: the launcher's cluster without them, as (old shape,
    new shape)). Returns the resizer (SIGHUP and rejoins call it too)."""
    membership = Membership(supervisor)
    front.membership = membership.apply
    resizer = Resizer(
        supervisor, prepare, checkpoints=checkpoints, cluster=cluster, membership=membership
    )
    front.on_scale = resizer

    def take_out(tasks: list[Member]) -> tuple[str, str]:
        membership.left(tasks)
        return without(tasks)

    supervisor.on_left = take_out
    return resizer


def check_data_service_resize(
    exactly_once: str, workers: Sequence[str], new_workers: Sequence[str]
) -> None:
    """Refuse a resize that a job trained through the tf.data service cannot take, in one
    line naming its flag (``exactly_once``: --epochs, --follow, or "" for neither).

    --epochs: refused (its passes would start again in the fresh training process).
    --follow: the workers may grow and the ps change (the fresh process restores the last
    recorded round's checkpoint and goes on from the first file not recorded, as after a
    failure); a worker taken out is refused: TensorFlow never drops the tasks of a data
    worker that stopped, and the next round would wait on it for good (seen: no step for
    180 s after 3 -> 1 workers).
    """
    if exactly_once == "--epochs":
        raise ConfigError(
            exactly_once,
            "a resize cannot yet keep its exactly-once guarantee",
            "resize a job trained by --steps, or restart this one on the new cluster "
            "with the same --checkpoint-dir",
        )
    gone = [address for address in workers if address not in new_workers]
    if exactly_once == "--follow" and gone:
        raise ConfigError(
            exactly_once,
            f"a resize cannot take out workers ({', '.join(gone)}): their tf.data service "
            "data workers would hold up every later round",
            "add workers or change the ps; for fewer workers, stop the job and start it on "
            "the smaller cluster with the same --checkpoint-dir",
        )


def local_prepare(
    local: Any, *, timeout: float, exactly_once: str = ""
) -> Callable[[Any, float | None], tuple[str, str]]:
    """psctl local's: start (or retire) servers for the requested counts; refused for a job
    trained by ``--epochs`` (``exactly_once``: the job's exactly-once flag, if any)."""

    def prepare(request: Any, time_left: float | None = None) -> tuple[str, str]:
        local.drop_left()  # workers that left: a resize re-forms the cluster without them
        if request.cluster_json:
            raise ConfigError(
                "--cluster",
                "psctl local runs its own servers",
                "give --workers N and/or --ps M (a cluster file is for psctl train)",
            )
        old = local.cluster
        workers = request.workers or old.num_workers
        num_ps = request.ps or old.num_ps
        check_data_service_resize(exactly_once, old.workers, old.workers[:workers])
        if workers < 1 or num_ps < 1:
            raise ConfigError("--workers", "a cluster needs a ps and a worker", "give 1 or more")
        if (workers, num_ps) == (old.num_workers, old.num_ps):
            raise ConfigError(
                "--workers", f"the job already runs on {shape(old)}", "give another count"
            )
        started = time.monotonic()
        local.resize(num_ps=num_ps, num_workers=workers, timeout=server_wait(timeout, time_left))
        log.info("new servers SERVING in %.1fs", time.monotonic() - started)
        return shape(old), shape(local.cluster)

    return prepare


class ClusterFile:
    """psctl train's cluster, as a file the launcher rewrites for each generation: the
    operator's ``--cluster`` FILE first, then a copy of each new description."""

    def __init__(self, path: str, *, timeout: float, exactly_once: str = "") -> None:
        """``exactly_once``: the job's --epochs or --follow, if any (check_data_service_resize)."""
        self.source = path
        self.exactly_once = exactly_once
        self.path = path
        self.timeout = timeout
        self.cluster = load(Path(path).read_text(), source=path)
        self._dir: str | None = None
        # Workers that left by themselves (a SIGTERM: a preemption, or `systemctl restart`),
        # by address, with their health addresses: ``Rejoins`` takes each back once it
        # serves again. The operator's own resize settles the cluster: they are forgotten.
        self.departed: dict[str, str] = {}
        self.rejoining = False  # the resize under way is ``Rejoins``'s

    def prepare(self, request: Any, time_left: float | None = None) -> tuple[str, str]:
        text = request.cluster_json
        if not text:
            raise ConfigError(
                "--cluster",
                "psctl train resizes to a cluster description",
                "give psctl scale --cluster NEW.json (the servers of its new hosts started)",
            )
        new = load(text, source="the new cluster")
        old = self.cluster
        if new.chief != old.chief:
            raise ConfigError(
                "chief",
                f"the new cluster's chief is {new.chief}, this coordinator is {old.chief}",
                "keep the chief's address",
            )
        if new == old:  # a SIGHUP (systemctl reload) of an unchanged file: no fresh start
            raise ConfigError(
                "--cluster", f"the job already runs on this cluster ({shape(old)})", "change it"
            )
        check_data_service_resize(self.exactly_once, old.workers, new.workers)
        wait_serving(new, json.loads(text), timeout=server_wait(self.timeout, time_left))
        self._write(json.loads(text))
        self.cluster = new
        if self.rejoining:
            back = set(new.workers)
            self.departed = {a: h for a, h in self.departed.items() if a not in back}
        else:
            self.departed = {}
        return shape(old), shape(new)

    def without(self, tasks: list[tuple[str, int, str]]) -> tuple[str, str]:
        """The cluster less ``tasks`` ((type, index, address) of workers that left, found
        by address: the running training process may number them otherwise; the others
        renumbered in order), as the next generation's file; (old shape, new shape)."""
        old = self.cluster
        addresses_gone = {address for _, _, address in tasks}
        gone = {
            (kind, i)
            for kind, addresses in old.jobs.items()
            for i, a in enumerate(addresses)
            if a in addresses_gone
        }
        jobs = {
            kind: tuple(a for i, a in enumerate(addresses) if (kind, i) not in gone)
            for kind, addresses in old.jobs.items()
        }
        body = json.loads(Path(self.path).read_text())
        health_of = HealthAddresses.of_json(body, source=self.path)
        for kind, i, address in old.task_addresses():
            found = health_of.get(kind, i, address) if kind == "worker" else None
            if (kind, i) in gone and found is not None:
                self.departed[old.jobs[kind][i]] = str(found)
        cluster = body.get("cluster", body)
        for kind, addresses in jobs.items():
            cluster[kind] = list(addresses)
        if "health" in body:  # the same tasks' health addresses, in the same order
            for kind in list(body["health"]):
                body["health"][kind] = [
                    a for i, a in enumerate(body["health"][kind]) if (kind, i) not in gone
                ]
        self._write(body)
        self.cluster = load(json.dumps(body), source=self.path)
        return shape(old), shape(self.cluster)

    def rejoined(self, addresses: list[str]) -> str:
        """The cluster with these departed workers back, after the others (a running
        server may take another index: TensorFlow lets it), as JSON for a resize."""
        body = json.loads(Path(self.path).read_text())
        cluster = body.get("cluster", body)
        workers = list(cluster.get("worker", []))
        named = (
            body.get("health", {}).get("worker") if isinstance(body.get("health"), dict) else None
        )
        if isinstance(named, list) and len(named) == len(workers):  # else: the default ports
            body["health"]["worker"] = [*named, *(self.departed[a] for a in addresses)]
        cluster["worker"] = [*workers, *addresses]
        return json.dumps(body)

    def _write(self, body: Any) -> None:
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="psctl-cluster-")
            atexit.register(shutil.rmtree, self._dir, ignore_errors=True)
        path = Path(self._dir) / f"cluster-{int(time.time() * 1000)}.json"
        write_json_atomic(path, body)
        self.path = str(path)


class Rejoins:
    """psctl train's workers that left by themselves come back by themselves: once one is
    SERVING again at its address (``systemctl restart psctl-worker@N``: a SIGTERM, then a
    start), the cluster grows back to include it, as ``psctl scale`` would (a checkpoint,
    then a fresh training process). Looked at every ``every`` seconds, beside the loop."""

    def __init__(
        self,
        cluster_file: ClusterFile,
        resizer: Resizer,
        supervisor: TrainingSupervisor,
        *,
        every: float = 2.0,
    ) -> None:
        self.cluster_file = cluster_file
        self.resizer = resizer
        self.supervisor = supervisor
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="psctl-rejoins", daemon=True)

    def __enter__(self) -> Rejoins:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.poll()
            except Exception:  # a bad look must not end the watch (nor the job)
                log.exception("looking for workers back in service failed")

    def poll(self) -> None:
        departed = dict(self.cluster_file.departed)
        if not departed or self.supervisor.stopping or self.supervisor.resizing:
            return
        back = [a for a, at in departed.items() if health.check(at, timeout=1.0).serving]
        if not back:
            return
        names = ", ".join(f"worker {a}" for a in back)
        log.warning("%s SERVING again: taking it back into the job", names)
        self.cluster_file.rejoining = True
        try:
            request = control_pb2.ScaleRequest(cluster_json=self.cluster_file.rejoined(back))
            self.resizer(request, reason=f"{names} back")
        except (ConfigError, Refused) as err:
            log.warning(
                "%s not back in the job yet (tried again in %.0fs): %s", names, self.every, err
            )
        finally:
            self.cluster_file.rejoining = False


def load(text: str, *, source: str) -> ClusterConfig:
    return parse_cluster_json(text, source=source)


def wait_serving(cluster: ClusterConfig, body: Any, *, timeout: float) -> None:
    """Every ps and worker of ``cluster`` SERVING within ``timeout`` (the file's "health"
    addresses, else TF port + HEALTH_PORT_OFFSET, as ``psctl health`` reads them), else a
    ConfigError naming the first that is not."""
    addresses = HealthAddresses.of_json(body, source="the new cluster")
    targets = [
        (
            f"{task_type}:{index}",
            str(
                addresses.require(
                    task_type, index, address, field=f"{task_type}:{index} health port"
                )
            ),
        )
        for task_type, index, address in cluster.task_addresses()
        if task_type in ("ps", "worker")
    ]
    deadline = time.monotonic() + timeout
    pending = list(targets)
    while pending:
        pending = [(name, t) for name, t in pending if not health.check(t, timeout=1.0).serving]
        if not pending:
            return
        if time.monotonic() >= deadline:
            name, target = pending[0]
            raise ConfigError(
                name,
                f"not SERVING at {target} after {timeout:.0f}s; the job goes on on the old cluster",
                "start its server (psctl deploy render gives its unit), then scale again",
            )
        time.sleep(0.5)
