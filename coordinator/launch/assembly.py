"""A training process's launcher, assembled in one place: the job's control front
(operations/front.py), the supervisor that starts and restarts the training process
(supervisor.py) and, where the launcher resizes its cluster, the membership and resizer
(resize.py), each given its callbacks when it is built. `psctl train` (``supervise_train``,
also each sync worker's), `psctl local` (local.py) and the sync launcher (sync.py) use it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from psctl.cluster import ports
from psctl.cluster.address import Address
from psctl.cluster.errors import ConfigError
from psctl.cluster.processes.procs import TrainingProcess, die_with_parent
from psctl.cluster.processes.signals import LAUNCHER_GONE
from psctl.cluster.spec import ClusterConfig
from psctl.control.v1 import control_pb2
from psctl.coordinator.argv import psctl_argv
from psctl.coordinator.launch.resize import ClusterFile, Member, Rejoins, Resizer, elastic
from psctl.coordinator.launch.supervisor import (
    Counters,
    RestartPolicy,
    TrainingSupervisor,
    forward_stop_signals,
)
from psctl.coordinator.operations.front import ControlFront, Refused, launch_control
from psctl.coordinator.operations.security import ControlSecurity
from psctl.coordinator.settings import TrainSettings

log = logging.getLogger("psctl.train")


@dataclass(frozen=True)
class Resizing:
    """How a launcher resizes its cluster (``psctl scale``; see ``resize.elastic``):
    ``prepare`` makes a new cluster ready, ``cluster`` is the launcher's cluster now,
    ``without`` takes tasks that left out of it; ``checkpoints``: the job has them (a
    resize goes on from one). ``watch(resizer, supervisor)``: what else resizes the job
    while the supervisor runs (psctl train: SIGHUP, workers back in service)."""

    prepare: Callable[[Any, float | None], tuple[str, str]]
    cluster: Callable[[], ClusterConfig]
    without: Callable[[list[Member]], tuple[str, str]]
    checkpoints: bool
    watch: Callable[[Resizer, TrainingSupervisor], AbstractContextManager[object]] | None = None


class TrainingAssembly:
    """A launcher's front, supervisor, membership and resizer.

    As a context manager it serves the job's control front on ``control_address`` (not with
    ``serve_control`` off: sync mode's workers but the first); inside, ``address`` and
    ``security`` are what each training process is given (its --control-address, the
    front's private socket, and the job's token files), the same after every restart.
    ``on_stop``: who takes a Stop over the control API where no supervisor of this assembly
    does (the sync launcher's workers). ``run`` builds the supervisor and runs it.
    """

    def __init__(
        self,
        *,
        job: str,
        control_address: str,
        security: ControlSecurity,
        serve_control: bool = True,
        on_stop: Callable[[bool], None] | None = None,
    ) -> None:
        self.job = job
        self.control_address = control_address
        self.serve_control = serve_control
        self.on_stop = on_stop
        self.address = control_address
        self.security = security
        self.front: ControlFront | None = None
        self.supervisor: TrainingSupervisor | None = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> TrainingAssembly:
        if self.serve_control:
            self.front, self.security = self._stack.enter_context(
                launch_control(self.control_address, self.security, job=self.job)
            )
            self.address = self.front.backend_address
            if self.on_stop is not None:
                self.front.on_stop = self.on_stop
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def run(
        self,
        start: Callable[[Counters], subprocess.Popen[bytes]],
        *,
        policy: RestartPolicy,
        finish_after_stop: bool = False,
        tick: Callable[[], None] | None = None,
        counters: Counters | None = None,
        resizing: Resizing | None = None,
    ) -> int:
        """Supervise ``start``'s training processes (``TrainingSupervisor``) until the job
        ends, the front's Stop and the stop signals forwarded to it; with ``resizing``,
        the front also takes ``psctl scale`` and shows the cluster's membership."""
        supervisor = TrainingSupervisor(
            start,
            policy=policy,
            tick=tick,
            counters=counters,
            finish_after_stop=finish_after_stop,
        )
        self.supervisor = supervisor
        with contextlib.ExitStack() as stack:
            if self.front is not None:
                self.front.on_stop = supervisor.control_stop
                if resizing is not None:
                    resizer = elastic(
                        self.front,
                        supervisor,
                        prepare=resizing.prepare,
                        cluster=resizing.cluster,
                        without=resizing.without,
                        checkpoints=resizing.checkpoints,
                    )
                    if resizing.watch is not None:
                        stack.enter_context(resizing.watch(resizer, supervisor))
            stack.enter_context(forward_stop_signals(supervisor))
            return supervisor.run()


NO_CHECKPOINTS = (
    "no --checkpoint-dir: no checkpoint is written, so a lost ps task, a restart of the "
    "training process or of this command starts the job again from step 0; give "
    "--checkpoint-dir DIR (PSCTL_CHECKPOINT_DIR) to keep its progress"
)


def supervise_train(
    args: argparse.Namespace, settings: TrainSettings, *, serve_control: bool = True
) -> int:
    """`psctl train` without --once: run the training process under the restart policy,
    serving the job's control address (``serve_control``; not on sync mode's workers > 0)."""
    control = Address.parse(args.control_address, field="--control-address", allow_port_zero=True)
    if control.port == 0:  # one port for every training process, and for the token files
        control = control.with_port(ports.free_ports(1, control.host)[0])
    # The job's tokens, written once for this user and kept by every training process;
    # the control address is the launcher's, the training process listens behind it.
    with TrainingAssembly(
        job=settings.job,
        control_address=str(control),
        security=ControlSecurity.from_args(args, os.environ),
        serve_control=serve_control,
    ) as assembly:
        argv = psctl_argv(
            *args.raw_argv,
            *assembly.security.as_argv(),
            "--control-address",
            assembly.address,
            "--once",
        )
        # The parameter-server mode resizes (psctl scale --cluster, SIGHUP): each training
        # process starts on the cluster file of the latest generation.
        cluster_file = None
        if serve_control and settings.strategy == "async" and getattr(args, "cluster", None):
            cluster_file = ClusterFile(
                args.cluster,
                timeout=settings.supervision.connect_timeout,
                exactly_once=settings.exactly_once_flag,
            )

        def start(counters: Counters) -> subprocess.Popen[bytes]:
            current = with_cluster(argv, cluster_file.path) if cluster_file else argv
            # If the launcher dies (SIGKILL, OOM), the training process stops as at a stop,
            # with its final checkpoint, instead of training on unsupervised.
            return TrainingProcess(
                [*current, "--supervisor-counters", counters.handed()],
                verbose=args.verbose,
                preexec_fn=die_with_parent(LAUNCHER_GONE),
            )

        if serve_control and not settings.checkpoints.checkpoint_dir:  # once, not at every restart
            log.warning("%s", NO_CHECKPOINTS)
        return assembly.run(
            start,
            policy=RestartPolicy(max_restarts=settings.supervision.max_restarts),
            finish_after_stop=settings.strategy == "async",
            resizing=None if cluster_file is None else cluster_file_resizes(cluster_file, settings),
        )


def cluster_file_resizes(cluster_file: ClusterFile, settings: TrainSettings) -> Resizing:
    """psctl train's resizes: to a new cluster description (psctl scale --cluster, or the
    file again on SIGHUP), without workers that left, and with them again once back."""

    @contextlib.contextmanager
    def watch(resizer: Resizer, supervisor: TrainingSupervisor) -> Iterator[None]:
        with (
            reread_on_sighup(cluster_file.source, resizer),
            Rejoins(cluster_file, resizer, supervisor),
        ):
            yield

    return Resizing(
        prepare=cluster_file.prepare,
        cluster=lambda: cluster_file.cluster,
        without=cluster_file.without,
        checkpoints=bool(settings.checkpoints.checkpoint_dir),
        watch=watch,
    )


def with_cluster(argv: list[str], path: str) -> list[str]:
    """``argv`` with its ``--cluster`` value replaced by ``path``."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--cluster" and i + 1 < len(out):
            out[i + 1] = path
            return out
        if arg.startswith("--cluster="):
            out[i] = f"--cluster={path}"
            return out
    return out


@contextlib.contextmanager
def reread_on_sighup(path: str, resizer: Resizer) -> Iterator[None]:
    """SIGHUP: read ``path`` again and resize to it (on a thread of its own: the new
    servers' health checks take time); a bad file is one line and the job goes on."""

    def resize() -> None:
        try:
            text = Path(path).read_text()
            response = resizer(control_pb2.ScaleRequest(cluster_json=text))
            log.info("SIGHUP: %s", response.message)
        except (ConfigError, Refused, OSError) as err:
            log.error("SIGHUP: %s not applied: %s", path, err)

    def handle(signum: int, _frame: FrameType | None) -> None:
        threading.Thread(target=resize, name="psctl-sighup", daemon=True).start()

    old = signal.signal(signal.SIGHUP, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, old)
