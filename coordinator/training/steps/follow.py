"""``--follow``: train each new file of ``--train-data`` once, as its partition completes,
without restarting the training process.

Training goes in rounds, one complete partition each (coordinator/data/follow.py says
which, in path order). A round is one pass over its files through the tf.data service,
as ``--epochs 1`` would train them (steps/epochs.py: every worker takes pieces until the
service has handed out the last one). When every worker has reported the end of the
round's data, ``on_round`` writes a checkpoint and records the round in the journal
(training/saving/follow_journal.py); then the program looks for the next partition,
waiting for one while none is complete. No new partition for ``--idle-timeout`` ends the
loop, and the run ends as any other: final checkpoint, evaluation, summary.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from psctl.cluster.errors import ConfigError
from psctl.coordinator.data.files import file_list, has_scheme
from psctl.coordinator.data.follow import Listing, Partition, PartitionWatcher
from psctl.coordinator.settings import TrainSettings
from psctl.coordinator.training.saving.follow_journal import FollowJournal
from psctl.coordinator.training.steps.epochs import EpochProgram, make_epoch_train_fn
from psctl.coordinator.training.steps.programs import Runtime

if TYPE_CHECKING:
    from psctl.coordinator.operations.job_state import JobControl
    from psctl.coordinator.operations.metrics import CoordinatorMetrics

log = logging.getLogger(__name__)

# Between looks at the glob while no partition is ready: a local directory is cheap to
# list; an object store's listing costs a request (and money) each time.
POLL_SECONDS = 0.5
REMOTE_POLL_SECONDS = 5.0


def wait_for_partition(
    watcher: PartitionWatcher,
    trained: Collection[str],
    *,
    stop: threading.Event,
    idle_timeout: float,
    on_look: Callable[[Listing], None] = lambda listing: None,
    on_idle: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.monotonic,
) -> Partition | None:
    """The next partition to train; None after a stop or ``idle_timeout`` seconds (0:
    never) with none ready."""
    started = clock()
    said = False
    while True:
        listing = watcher.look(trained)
        on_look(listing)
        if listing.ready:
            return listing.ready[0]
        if stop.is_set():
            return None
        if idle_timeout and clock() - started >= idle_timeout:
            log.info("follow mode: no new input for %gs (--idle-timeout): ending", idle_timeout)
            return None
        if not said:
            waiting = f", {listing.waiting} file(s) in partitions not complete yet"
            log.info(
                "follow mode: waiting for new input in %s%s",
                watcher.pattern,
                waiting if listing.waiting else "",
            )
            said = True
        on_idle()
        stop.wait(REMOTE_POLL_SECONDS if has_scheme(watcher.pattern) else POLL_SECONDS)


class FollowProgram(EpochProgram):
    """The step program of ``--follow``: rounds of one partition, for as long as input
    comes (see the module's docstring)."""

    def __init__(
        self,
        rt: Runtime,
        *,
        dispatcher: str | None,
        worker_failures: Callable[[], int],
        watcher: PartitionWatcher,
        first: Partition,
        trained: Collection[str],
        stop: threading.Event,
        on_round: Callable[[Partition], None],  # records the round: ``trained`` grows
        on_look: Callable[[Listing], None],
        on_idle: Callable[[], None],
    ) -> None:
        # The first partition found (trained or not) only checks the job's dataset.
        super().__init__(
            rt,
            dispatcher=dispatcher,
            worker_failures=worker_failures,
            train_data=file_list(list(first.files)),
        )
        self.watcher = watcher
        self.trained = trained  # the files recorded, kept up by ``on_round``
        self.stop = stop
        self.on_round = on_round
        self.on_look = on_look
        self.on_idle = on_idle
        self.current: Partition | None = None
        self.ended = False  # idle for --idle-timeout: asked again, still the end

    def start(self, settle: Callable[[], None]) -> None:
        self._settle = settle
        self.function = make_epoch_train_fn(self.rt)

    def wants_more(self, scheduled: int) -> bool:
        if self.ended:
            return False
        if self.current is not None:
            if super().wants_more(scheduled):  # the round's workers, or its make-up passes
                return True
            self._settle()
            self.on_round(self.current)
            self.current = None
        partition = wait_for_partition(
            self.watcher,
            self.trained,
            stop=self.stop,
            idle_timeout=self.rt.settings.data.idle_timeout,
            on_look=self.on_look,
            on_idle=self.on_idle,
        )
        if partition is None:
            self.ended = not self.stop.is_set()
            return not self.ended  # a stop: the loop sees it next and ends there
        self._begin(partition)
        return True

    def _begin(self, partition: Partition) -> None:
        log.info(
            "follow mode: training %d file(s) of %s (complete %.0fs ago)",
            len(partition.files),
            partition.directory,
            max(0.0, time.time() - partition.completed_at),
        )
        self.current = partition
        self.context = dataclasses.replace(
            self.context, train_data=file_list(list(partition.files))
        )
        self.failures_seen = self.worker_failures()
        self._new_passes(1)

    def stopped_early(self, final_step: int) -> bool:
        return self.current is not None  # stopped in the middle of a round


class FollowInput:
    """Follow mode in the training process: the watcher, the journal and the files
    trained, and what status and /metrics show of them. Built before the model: it waits
    for the first complete partition, whose files tell the job's input shapes."""

    def __init__(
        self, settings: TrainSettings, control: JobControl, metrics: CoordinatorMetrics | None
    ) -> None:
        self.settings = settings
        self.control = control
        self.metrics = metrics
        self.watcher = PartitionWatcher(
            settings.data.train_data,
            marker=settings.data.follow_marker,
            settle_seconds=settings.data.settle_seconds,
        )
        self.journal = FollowJournal(settings.checkpoints.checkpoint_dir)
        self.trained: set[str] = set()  # the journal's files, for the watcher's lookups
        self.on_round_recorded: Callable[[], None] = lambda: None  # a round's checkpoint is there
        control.update(fresh=True, following=True)
        first = wait_for_partition(
            self.watcher,
            (),
            stop=control.stop_requested,
            idle_timeout=settings.data.idle_timeout,
            on_look=self.show_waiting,
        )
        if first is None:
            if control.stop_requested.is_set():
                log.warning("follow mode: stopped before any input was complete: nothing trained")
                raise SystemExit(0)
            raise ConfigError(
                "--train-data",
                f"no partition of {settings.data.train_data!r} was complete within --idle-timeout "
                f"({settings.data.idle_timeout:g}s)",
                f"check the glob, and that the partitions get their marker "
                f"({settings.data.follow_marker}, --follow-marker) or stop changing "
                "(--settle-seconds)",
            )
        self.first = first

    def resume(self, start_step: int) -> None:
        """After the restore: the rounds the restored checkpoint holds."""
        self.journal.begin(start_step)
        trained = self.trained_files()
        self.trained.update(trained)
        if trained:
            log.info(
                "follow mode: %d file(s) trained before (newest %s); going on with the next",
                len(trained),
                trained[-1],
            )
        self._show()

    def trained_files(self) -> list[str]:
        return [path for r in self.journal.rounds for path in r.files]

    def newest_files(self) -> str:
        """The last round's files (all complete), as a --train-data value."""
        rounds = self.journal.rounds
        files = rounds[-1].files if rounds else self.first.files
        return file_list(list(files))

    def show_waiting(self, listing: Listing) -> None:
        waiting = listing.waiting + sum(len(p.files) for p in listing.ready)
        self.control.update(files_waiting=waiting)
        if self.metrics is not None:
            self.metrics.set_files_waiting(waiting)

    def round_done(
        self, partition: Partition, *, save: Callable[[], Any], step: Callable[[], int]
    ) -> None:
        """Checkpoint, then record: a round is trained once its checkpoint is written."""
        save()
        entry = self.journal.record(step(), partition.files, partition.completed_at)
        self.trained.update(partition.files)
        self.on_round_recorded()
        if self.metrics is not None:
            self.metrics.files_trained(len(partition.files), partition.completed_at)
        log.info(
            "follow mode: trained %s (%d file(s)) to global step %d; %d file(s) so far",
            partition.directory,
            len(partition.files),
            entry.step,
            len(self.trained),
        )
        self._show()

    def _show(self) -> None:
        rounds = self.journal.rounds
        self.control.update(
            files_trained=len(self.trained),
            newest_file=rounds[-1].files[-1] if rounds else "",
            newest_completed=max((r.completed_at for r in rounds), default=0.0),
        )

    def program(
        self,
        rt: Runtime,
        *,
        dispatcher: str | None,
        worker_failures: Callable[[], int],
        save: Callable[[], Any],
        step: Callable[[], int],
        serve_requests: Callable[[], None],
    ) -> FollowProgram:
        return FollowProgram(
            rt,
            dispatcher=dispatcher,
            worker_failures=worker_failures,
            watcher=self.watcher,
            first=self.first,
            trained=self.trained,
            stop=self.control.stop_requested,
            on_round=lambda partition: self.round_done(partition, save=save, step=step),
            on_look=self.show_waiting,
            on_idle=serve_requests,
        )


def freshness_summary(control: JobControl, follow: FollowInput | None) -> dict[str, object]:
    """The summary's "freshness": {} without --follow or --export-every."""
    board = control.view().board
    if not board.fresh:
        return {}
    lag = max(0.0, time.time() - board.newest_completed) if board.newest_completed else 0.0
    return {
        "files_trained": board.files_trained,
        "files": follow.trained_files() if follow is not None else [],
        "files_waiting": board.files_waiting,
        "input_lag_seconds": round(lag, 3),
        "published_version": board.published_version,
        "export_dir": board.export_dir,
    }
