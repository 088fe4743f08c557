"""The one outer training loop, for both strategies, and the end of a run (its ``Summary``).

As orbit's ``Controller`` drives any trainer, ``TrainingLoop`` drives a ``Runner``: the loop
owns the job's life while it trains (RUNNING, PAUSED: the only writer of those states),
pause/resume/stop, checkpoint requests, the cadenced actions after every call (status with
the NaN guard, checkpoint-every, eval-every), the loop's hooks and its timing; ``end_run``
reads the final metrics, saves the final checkpoint, evaluates and builds the ``Summary``.
The loop is the only writer of RUNNING, PAUSED and STOPPING; the training process's end
(launch/process.py, with ``complete`` in reporting/summary.py) writes DONE, RECOVERING
and FAILED. What differs between the strategies
is the runner's:

- ``ScheduledRunner`` (scheduled.py, ``--strategy async``): schedules packed calls of the
  step program on a ``ClusterCoordinator``, keeps a bounded number in flight, watches for
  stalls (calls stuck on a frozen worker) and joins the workers at the end;
- ``CollectiveRunner`` (sync.py, ``--strategy sync``): every worker calls the step function
  in place under ``MultiWorkerMirroredStrategy``; each turn opens with one small all-gather
  in which the workers agree on what to do. No calls in flight, so no stall watchdog: a
  lost or frozen peer fails the collectives (``PeerLost``).

A pause does not count as training time: ``train_seconds`` (and so ``steps_per_sec``) is
the time the loop ran minus the time it was paused, in both strategies.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from psctl.cluster.errors import ConfigError
from psctl.cluster.processes.signals import LAUNCHER_GONE, RESIZE_SIGNAL, EarlyStops, SignalRelay
from psctl.coordinator.failures import (
    Failure,
    ResizeRequested,
    classify,
    describe,
    restart_if_starting,
)
from psctl.coordinator.operations.job_state import table_counts
from psctl.coordinator.operations.state import State
from psctl.coordinator.training.actions import Action, PublishStatus, status_and_checkpoints
from psctl.coordinator.training.evaluation.final_eval import evaluate_final
from psctl.coordinator.training.reporting.publish import Publisher
from psctl.coordinator.training.reporting.summary import Summary, accuracy_of
from psctl.coordinator.training.saving.checkpoints import Checkpointer
from psctl.coordinator.training.steps.packing import Packer, packer_for
from psctl.coordinator.training.steps.programs import Runtime
from psctl.hooks import LoopHooks

if TYPE_CHECKING:
    from psctl.cluster.spec import ClusterConfig
    from psctl.coordinator.job import Job
    from psctl.coordinator.operations.job_state import JobControl
    from psctl.coordinator.operations.metrics import CoordinatorMetrics
    from psctl.coordinator.settings import TrainSettings
    from psctl.coordinator.training.job_model.model import TrainState

log = logging.getLogger(__name__)

PAUSE_POLL = 0.2  # seconds between looks (and, in sync mode, agreements) while paused
OPEN_TARGET = 2**62  # a program's target when the data decides (--epochs)


def install_stop_signals(control: JobControl, early: EarlyStops | None = None) -> None:
    """SIGTERM/SIGINT: finish in-flight steps, checkpoint, evaluate, exit 0. A second one
    aborts. One that ``early`` counted while the process started is a stop at once."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handle(signum: int) -> None:  # on the relay thread: the Event's lock is safe there
        log.warning(
            "%s: finishing in-flight steps, then checkpoint and exit", signal.Signals(signum).name
        )
        control.stop_on_signal()

    relay = SignalRelay(handle, abort_on_second=True)
    if early is not None and early.received:
        relay.received = early.received
        log.warning("stopped while starting: no step trained, then checkpoint and exit")
        control.stop_on_signal()

    gone = threading.Event()

    def launcher_gone(signum: int) -> None:  # sent once per reparenting: acted on once
        if not gone.is_set():
            gone.set()
            log.warning("the launcher is gone: finishing in-flight steps, then checkpoint and exit")
            control.stop_on_signal()

    SignalRelay(launcher_gone, (LAUNCHER_GONE,))

    def resize(signum: int) -> None:
        restart_if_starting(control.state is State.STARTING, "the launcher asked for a new cluster")
        log.warning("the launcher asked for a new cluster: checkpoint, then a fresh start")
        control.request_resize()

    SignalRelay(resize, (RESIZE_SIGNAL,))


@dataclass(frozen=True)
class Turn:
    """What the loop does next, as the runner reads the requests (sync: as all agree)."""

    stop: bool
    pause: bool
    steps_per_call: int


class Runner(Protocol):
    """One strategy's way of running steps under ``TrainingLoop``."""

    program: Any  # the step program: target, progress_total, stopped_early(final_step)
    packer: Packer  # the steps per call
    completed: int  # steps finished: the global step
    scheduled: int  # steps handed out (== completed where calls return when done)

    @property
    def stalls(self) -> int:
        """Stalls reported (0 where nothing can stall without failing)."""
        ...

    def start(self) -> None:
        """Before the first step: the program's function and iterators, any watchers."""

    def next_turn(self) -> Turn:
        """Read the stop and pause requests and the steps per call (sync: agree on them
        with every worker: a collective, so every worker calls it every turn)."""
        ...

    def wants_more(self) -> bool:
        """Whether steps are owed (may wait for calls in flight to land first)."""
        ...

    def run_call(self, steps: int) -> None:
        """Run (or schedule) one call of ``steps`` packed steps."""

    def quiesce(self) -> None:
        """Every step handed out has finished (or was given up): for a pause, the end."""

    def abort(self) -> None:
        """The loop raised: stop any watcher."""

    def finish(self) -> None:
        """After the loop (STOPPING), before the final checkpoint and evaluation: what the
        strategy does at the end (async: every call lands, the workers are joined)."""


class RunnerBase:
    """What both runners keep: the program, the job's state (for the requests), the steps
    per call, the metrics, the hooks, the steps finished and handed out."""

    def __init__(
        self, owner: Any, program: Any, *, start_step: int, packer: Packer | None = None
    ) -> None:
        """``owner``: the trainer (its ``control``, ``metrics`` and ``hooks``; and, without
        a ``packer``, its settings and workers, for ``--steps-per-execution``)."""
        self.owner = owner
        self.program = program
        self.control: JobControl = owner.control
        self.packer = packer or packer_for(owner.settings, owner.num_workers)
        self.metrics: CoordinatorMetrics | None = owner.metrics
        self.hooks: LoopHooks = owner.hooks or LoopHooks()
        self.start_step = start_step
        self.completed = self.scheduled = start_step
        self._steps: dict[int, Any] = {}

    def request_stop(self) -> None:
        """End the loop as a stop request does (for tools: ``LoopHooks.on_poll``)."""
        self.control.stop_requested.set()

    def steps_tensor(self, steps: int) -> Any:
        """``steps`` as the int64 tensor a call takes, made once per value (a new Python
        int would trace the function again)."""
        found = self._steps.get(steps)
        if found is None:
            import tensorflow as tf

            found = self._steps[steps] = tf.constant(steps, tf.int64)
        return found


class TrainingLoop:
    """The outer loop over a ``Runner``; ``completed`` is the runner's (the actions read it)."""

    def __init__(
        self,
        *,
        runner: Runner,
        control: JobControl,
        publisher: Publisher,
        status: PublishStatus | None,  # None: a sync worker other than the chief
        checkpointer: Checkpointer,
        actions: Sequence[Action],
        hooks: LoopHooks | None = None,
        metrics: CoordinatorMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runner = runner
        self.control = control
        self.publisher = publisher
        self.status = status
        self.checkpointer = checkpointer
        self.actions = list(actions)
        self.hooks = hooks or LoopHooks()
        self.metrics = metrics
        self.clock = clock
        self.started = clock()
        self.ended: float | None = None
        self.paused_seconds = 0.0
        self._paused_at: float | None = None

    @property
    def completed(self) -> int:
        return self.runner.completed

    @property
    def program(self) -> Any:
        return self.runner.program

    def train_seconds(self) -> float:
        """Seconds the loop ran, pauses left out."""
        end = self.ended if self.ended is not None else self.clock()
        paused = self.paused_seconds
        if self._paused_at is not None:
            paused += end - self._paused_at
        return max(0.0, end - self.started - paused)

    def train(self, start_step: int, *, steps_per_execution: int) -> None:
        """The whole loop from ``start_step``: say where the run starts, train if steps are
        owed and no stop came first, then the runner's end."""
        target = self.runner.program.target
        # The status's target: the program's (0 where the data decides: --epochs).
        self.control.target_steps = self.runner.program.progress_total
        self.control.update(global_step=start_step)
        if self.control.on_start is not None:
            self.control.on_start(start_step)
        if self.metrics is not None:
            self.metrics.set_global_step(start_step)
            self.metrics.set_target_steps(self.runner.program.progress_total)
            self.metrics.set_steps_per_execution(steps_per_execution)
        if start_step >= target:
            log.info(
                "global step %d already reaches the target %d: nothing to train", start_step, target
            )
        elif not self.control.stop_requested.is_set():
            self.run()
        self.control.set_state(
            State.STOPPING, "finishing in-flight steps, final checkpoint and eval"
        )
        self.runner.finish()

    def run(self) -> None:
        """Train until the runner owes no more steps (the program's target) or a stop is
        requested."""
        self.control.set_state(State.RUNNING)
        self.started = self.clock()
        self.hooks.before_dataset()
        self.runner.start()
        self.hooks.after_dataset()
        try:
            self._loop(self.runner.program.target)
        except BaseException:
            self.runner.abort()
            raise
        finally:
            self.ended = self.clock()
            self._resumed()

    def _loop(self, target: int) -> None:
        runner, control = self.runner, self.control
        while runner.wants_more():
            turn = runner.next_turn()
            if turn.stop:
                break
            if turn.pause:
                self._pause()
                continue
            if self._paused_at is not None:
                self._resumed()
                control.set_state(State.RUNNING)
                log.info("resumed at global step %d", runner.completed)
                if self.status is not None:
                    self.status.restart_window(runner.completed)  # no rate over the pause
            self.checkpointer.serve_requests()
            runner.run_call(min(turn.steps_per_call, target - runner.scheduled))
            for action in self.actions:
                action(self)
        runner.quiesce()  # the loop ends when all is run or a stop was requested

    def _pause(self) -> None:
        self.runner.quiesce()  # in-flight steps finish; nothing new runs
        if self._paused_at is None:
            self._paused_at = self.clock()
            self.control.set_state(State.PAUSED, "paused by request")
            values = self.status.last_values if self.status is not None else {}
            self.publisher.progress(self.runner.completed, 0.0, values)
            log.info("paused at global step %d", self.runner.completed)
        self.checkpointer.serve_requests()
        self.control.stop_requested.wait(PAUSE_POLL)

    def _resumed(self) -> None:
        if self._paused_at is not None:
            self.paused_seconds += self.clock() - self._paused_at
            self._paused_at = None


class TrainerBase:
    """What both strategies' trainers are (trainer.py, sync.py) for ``run_training``: the
    job, its settings and state, where they report, and what differs in the summary."""

    job: Job
    settings: TrainSettings
    control: JobControl
    publisher: Publisher
    hooks: LoopHooks | None
    metrics: CoordinatorMetrics | None
    num_workers: int
    num_ps: int  # in the summary (0 in sync mode)
    examples_per_step: int  # a step's examples over all workers (sync: every worker's batch)
    is_chief: bool  # the process that reports, checkpoints and evaluates
    state: TrainState
    checkpointer: Checkpointer
    rt: Runtime

    def __init__(
        self,
        job: Job,
        cluster: ClusterConfig,
        settings: TrainSettings,
        control: JobControl,
        metrics: CoordinatorMetrics | None,
        hooks: LoopHooks | None,
        *,
        is_chief: bool,
        examples_per_step: int,
        num_ps: int,
    ) -> None:
        self.job, self.cluster, self.control = job, cluster, control
        self.metrics, self.hooks = metrics, hooks
        self.is_chief, self.examples_per_step, self.num_ps = is_chief, examples_per_step, num_ps
        self.num_workers = cluster.num_workers
        # Only the chief writes: checkpoints, TensorBoard and the summary.
        self.settings = (
            settings
            if is_chief
            else settings.replace(checkpoint_dir="", logdir="", summary_json="")
        )

    def attach_state(
        self,
        state: TrainState,
        *,
        x_spec: Any,
        y_spec: Any,
        strategy: Any,
        coordinator: Any,  # None in sync mode: the step function is called in place
        run_settings: TrainSettings,
    ) -> None:
        """The training state, its checkpointer, the step programs' runtime, and where the
        run reports (status, Prometheus, TensorBoard: its writer made here, after the
        strategy connected, which resets TensorFlow's context)."""
        self.publisher = Publisher(
            control=self.control,
            metrics=self.metrics,
            logdir=self.settings.reporting.logdir,
            batch_size=self.examples_per_step,
        )
        self.state = state
        self.checkpointer = Checkpointer(
            state=state,
            job=self.job,
            settings=self.settings,
            x_spec=x_spec,
            y_spec=y_spec,
            control=self.control,
            metrics=self.metrics,
        )
        self.rt = Runtime(
            job=self.job,
            settings=run_settings,
            strategy=strategy,
            coordinator=coordinator,
            num_workers=self.num_workers,
            state=state,
        )


def run_training(
    trainer: TrainerBase,
    runner: Runner,
    *,
    start_step: int,
    wall_started: float,
    actions: Sequence[Action] = (),
    evaluate: Callable[[int, str | None], dict[str, float]] | None = None,
) -> Summary:
    """A run of ``trainer`` with ``runner``, the same in both strategies: the loop (with
    the status action and checkpoint-every before the strategy's own ``actions``, on the
    chief), then the end of the run to its ``Summary`` (``evaluate(step, checkpoint)`` on
    the chief; by default every eval example once on this process,
    training/evaluation/final_eval.py)."""
    if evaluate is None:

        def evaluate(step: int, checkpoint: str | None) -> dict[str, float]:
            state = trainer.state
            return evaluate_final(
                trainer.job, trainer.settings, state.model, state.metric_factories, step
            )

    status, cadenced = None, list[Action]()
    if trainer.is_chief:
        status, cadenced = status_and_checkpoints(
            trainer.settings,
            state=trainer.state,
            publisher=trainer.publisher,
            checkpointer=trainer.checkpointer,
            progress_total=runner.program.progress_total,
            batch_size=trainer.examples_per_step,
            start_step=start_step,
        )
    loop = TrainingLoop(
        runner=runner,
        control=trainer.control,
        publisher=trainer.publisher,
        status=status,
        checkpointer=trainer.checkpointer,
        actions=[*cadenced, *actions] if trainer.is_chief else [],
        hooks=trainer.hooks,
        metrics=trainer.metrics,
    )
    try:
        loop.train(start_step, steps_per_execution=runner.packer.k)
    except Exception as err:
        if trainer.settings.data_service or not _is_end_of_data(err):
            _keep_steps_trained(trainer, err, start_step)
            raise
        raise _data_ended(trainer) from None
    if trainer.control.resize_requested.is_set() and trainer.is_chief:
        # Every step so far in a checkpoint, then a fresh process on the new cluster
        # restores it: no final evaluation, no summary (the run goes on).
        path = trainer.checkpointer.save()
        raise ResizeRequested(f"checkpoint {path} at global step {trainer.state.step()}")
    return end_run(
        loop,
        trainer,
        start_step=start_step,
        wall_started=wall_started,
        steps_per_execution=runner.packer.k,
        evaluate=evaluate if trainer.is_chief else None,
    )


def _is_end_of_data(err: BaseException) -> bool:
    import tensorflow as tf

    return isinstance(err, tf.errors.OutOfRangeError)


def _save_trained(trainer: TrainerBase) -> str | None:
    """A checkpoint of the steps trained, before a run that cannot be restarted ends (the
    parameter-server mode's chief, where there is a directory; a sync worker's peers may be
    gone from the group's collectives); None: none written. Its error is logged: the run's
    own is the one to report."""
    if trainer.settings.strategy == "sync" or not trainer.is_chief:
        return None
    try:
        return trainer.checkpointer.save()
    except Exception as err:
        log.warning("no checkpoint of the steps trained: %s", describe(err))
        return None


def _keep_steps_trained(trainer: TrainerBase, err: BaseException, start_step: int) -> None:
    """A configuration error or the job's own found mid-run (an eval set too small for its
    workers at the first --eval-every, a metric that raises): no restart can help, so the
    run ends, with the steps trained since the last checkpoint saved first."""
    if classify(err) not in (Failure.CONFIG_ERROR, Failure.JOB_ERROR):
        return  # restarted, or a ps gone: the latest checkpoint is the one to go on from
    if trainer.state.step() <= start_step:
        return
    path = _save_trained(trainer)
    if path:
        log.warning("the run ends on an error: the steps trained are in %s", path)


def _data_ended(trainer: TrainerBase) -> ConfigError:
    """A worker's dataset ran out before --steps (a dataset_fn without repeat(), or files
    emptier than thought): the steps trained so far in a checkpoint (the parameter-server
    mode's, where there is a directory), and one line, exit 78: a restart would only run
    out again."""
    step = trainer.state.step()
    kept = "no --checkpoint-dir: the steps trained are not kept"
    if trainer.settings.strategy == "sync":
        kept = "sync mode: the steps since the last checkpoint are not kept"
    path = _save_trained(trainer)
    if path:
        # The step saved (ckpt-<step>): calls in flight may have finished since the read.
        step = int(path.rsplit("-", 1)[1])
        kept = f"the {step} steps trained are in {path}"
    return ConfigError(
        f"--job {trainer.job.name}",
        f"dataset_fn's dataset ran out at global step {step} of "
        f"{trainer.settings.loop.steps} ({kept})",
        "repeat() the training data in dataset_fn (psctl trains --steps steps), or give "
        "--epochs N to train whole passes over it",
    )


def end_run(
    loop: TrainingLoop,
    trainer: TrainerBase,
    *,
    start_step: int,
    wall_started: float,
    steps_per_execution: int,
    evaluate: Callable[[int, str | None], dict[str, float]] | None,
) -> Summary:
    """After the loop (and the runner's own end): the final metrics and table counts
    (``TrainState.table_stats()``, published and in the summary), progress line,
    checkpoint and evaluation (``evaluate(step, checkpoint)``; None: not this process's to
    do, as on a sync worker other than the chief) and the run's ``Summary``."""
    train_seconds = loop.train_seconds()
    state, settings = trainer.state, trainer.settings
    examples_per_step = trainer.examples_per_step
    final_step = state.step()
    trained = final_step - start_step
    status = loop.status
    values = state.read_train_metrics() if trained > 0 else {}
    values = values or (status.last_values if status is not None else {})
    rate = trained / train_seconds if trained > 0 and train_seconds > 0 else 0.0
    tables = table_counts(state.table_stats())
    checkpoint = None
    eval_values: dict[str, float] = {}
    if status is not None:
        status.progress.finish(final_step, rate * examples_per_step, values)
        loop.publisher.progress(final_step, rate, values)
        loop.publisher.tables(final_step, tables)
    if evaluate is not None:
        checkpointer = loop.checkpointer
        if checkpointer.enabled:
            checkpoint = checkpointer.save() if trained > 0 else checkpointer.latest
        eval_values = evaluate(final_step, checkpoint)
        if eval_values:
            loop.publisher.evaluation(eval_values, step=final_step)
    program = loop.program
    return Summary(
        job=trainer.job.name,
        global_step=final_step,
        start_step=start_step,
        target_steps=final_step if program.target >= OPEN_TARGET else program.target,
        loss=values.get("loss"),
        accuracy=accuracy_of(values),
        eval_accuracy=accuracy_of(eval_values),
        eval_loss=eval_values.get("loss"),
        eval_auc=eval_values.get("auc"),
        examples_per_sec=rate * examples_per_step,
        steps_per_sec=rate,
        wall_seconds=time.monotonic() - wall_started,
        train_seconds=train_seconds,
        num_workers=trainer.num_workers,
        num_ps=trainer.num_ps,
        batch_size=settings.loop.batch_size,
        steps_per_execution=steps_per_execution,
        checkpoint=checkpoint,
        stopped_early=program.stopped_early(final_step),
        stalls=loop.runner.stalls,
        metrics=dict(values),  # every training metric, as eval_metrics holds every eval one
        eval_metrics=eval_values,
        tables=tables,
    )
