"""Synchronous training (``--strategy sync``): every worker process runs this loop under
``MultiWorkerMirroredStrategy``; gradients are all-reduced every step.

The pieces are the asynchronous trainer's: ``TrainState`` (model, optimizer, training
metrics), ``DefaultProgram``'s packed step function (called here, not scheduled), the
cadenced actions (status, checkpoints), the ``Checkpointer`` and the final evaluation. What
differs is the loop: no ClusterCoordinator, every worker steps together, so each call opens
with one small all-reduce in which the workers agree on what to do (the chief's steps per
call and pause, anyone's stop). Worker 0 is the chief: it alone checkpoints (same layout as
the parameter-server mode), publishes status and metrics, and evaluates. A restart restores
on the chief and broadcasts the state to the others, so only the chief needs the checkpoint
directory.

A collective that fails or times out (a worker died, froze or restarted) cannot be retried
in this process: ``PeerLost`` ends it with EXIT_RESTART on every worker, and the
supervisors start the group again; the new processes meet in the strategy's start-up
barrier and go on from the chief's latest checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import signal
import time
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from psctl.cluster.errors import ConfigError
from psctl.cluster.spec import ClusterConfig
from psctl.coordinator.data.context import DataContext
from psctl.coordinator.failures import (
    JOIN_DEADLINE,
    PeerLost,
    RestartFromCheckpoint,
    Unreachable,
    describe,
)
from psctl.coordinator.job import Job
from psctl.coordinator.settings import TrainSettings
from psctl.coordinator.training.actions import Action
from psctl.coordinator.training.evaluation.final_eval import evaluate_final
from psctl.coordinator.training.job_model.model import TrainState, scalar
from psctl.coordinator.training.loop import RunnerBase, TrainerBase, Turn, run_training
from psctl.coordinator.training.reporting.publish import Publisher
from psctl.coordinator.training.reporting.summary import Summary
from psctl.coordinator.training.saving.checkpoint_files import finite_there
from psctl.coordinator.training.steps.programs import DefaultProgram, Runtime, shard_for
from psctl.hooks import LoopHooks

if TYPE_CHECKING:
    from psctl.coordinator.operations.job_state import JobControl
    from psctl.coordinator.operations.metrics import CoordinatorMetrics

log = logging.getLogger(__name__)

# A dead or frozen peer is found by MultiWorkerMirroredStrategy's peer health checks: every
# HEALTH_INTERVAL seconds each peer must answer within HEALTH_TIMEOUT (3 tries), or every
# collective in flight is aborted. No per-collective timeout (CommunicationOptions'
# timeout_seconds): TensorFlow keeps a sleeping thread per collective for that long
# (SchedClosureAfter), thousands at 100 steps/s (seen: the process aborted, unable to
# start a thread).
HEALTH_INTERVAL = 5
HEALTH_TIMEOUT = 5
# gRPC codes (OpError.error_code) of a collective that lost a peer: CANCELLED,
# DEADLINE_EXCEEDED, FAILED_PRECONDITION (a peer restarted), ABORTED, UNAVAILABLE.
_PEER_CODES = frozenset({1, 4, 9, 10, 14})


def sync_strategy(cluster: ClusterConfig, index: int, *, connect_timeout: float) -> Any:
    """MultiWorkerMirroredStrategy over the cluster's workers, as worker ``index``. Blocks
    until every worker has started (at most ``connect_timeout`` seconds: ``Unreachable``)."""
    from tensorflow.python.distribute import collective_all_reduce_strategy as mwms

    extended = mwms.CollectiveAllReduceExtended
    # Read when the strategy starts (class attributes: TensorFlow has no other way in).
    extended._check_health_initial_timeout = max(1, int(connect_timeout))
    extended._check_health_interval = HEALTH_INTERVAL
    extended._check_health_timeout = HEALTH_TIMEOUT
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": list(cluster.workers)}),
        task_type="worker",
        task_id=index,
        rpc_layer="grpc",
    )
    # TensorFlow 2.21's coordination service waits for every worker with no deadline (it
    # turns the health check that timeout drove off) and holds the GIL meanwhile: the
    # deadline is a signal whose default action ends this process; its supervisor reads it
    # as unreachable (failures.classify_exit: exit 69).
    log.info(
        "waiting up to %.0fs (--connect-timeout) for every worker to join: %s",
        connect_timeout,
        ", ".join(cluster.workers),
    )
    signal.signal(JOIN_DEADLINE, signal.SIG_DFL)
    signal.alarm(max(1, math.ceil(connect_timeout)))
    try:
        return tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    except RuntimeError as err:
        if "Timeout waiting for the cluster" in str(err):
            raise Unreachable(
                f"not every worker joined within {connect_timeout:.0f}s (--connect-timeout): "
                f"{', '.join(cluster.workers)}"
            ) from err
        raise
    finally:
        signal.alarm(0)


def peer_lost(err: BaseException) -> bool:
    """Whether ``err`` is a collective that lost a peer (so: restart the group)."""
    code = getattr(err, "error_code", None)
    if code not in _PEER_CODES:
        return False
    if code == 9:  # FAILED_PRECONDITION is also a job's own mistake, unless a peer restarted
        text = str(err).lower()
        return "collective" in text or "incarnation" in text or "restarted" in text
    return True


class Agreement:
    """One small all-gather over the workers: what they do next, and a barrier."""

    def __init__(self, strategy: Any) -> None:
        def replica(values: Any) -> Any:
            context = tf.distribute.get_replica_context()
            return context.all_gather(values[tf.newaxis], axis=0)

        def gather(values: Any) -> Any:
            result = strategy.run(replica, args=(values,))
            return strategy.experimental_local_results(result)[0]

        self._gather = tf.function(gather)

    def gather(self, values: list[float]) -> Any:
        """Every worker's ``values``: an array of one row per worker."""
        return self._gather(tf.constant(values, tf.float64)).numpy()

    def max(self, values: list[float]) -> list[float]:
        return [float(v) for v in self.gather(values).max(axis=0)]

    def min(self, values: list[float]) -> list[float]:
        return [float(v) for v in self.gather(values).min(axis=0)]


def broadcast_from_chief(strategy: Any, variables: list[Any], *, is_chief: bool) -> None:
    """Every worker takes the chief's values of ``variables`` (after the chief restored a
    checkpoint): one all-reduce of the chief's values and the others' zeros."""
    if not variables:
        return
    weight = 1.0 if is_chief else 0.0

    def replica() -> Any:
        context = tf.distribute.get_replica_context()
        values = [tf.cast(tf.convert_to_tensor(v), tf.float64) * weight for v in variables]
        return context.all_reduce(tf.distribute.ReduceOp.SUM, values)

    def run() -> Any:
        return [strategy.experimental_local_results(v)[0] for v in strategy.run(replica)]

    for variable, value in zip(variables, tf.function(run)(), strict=True):
        variable.assign(tf.cast(value, variable.dtype))


def count_batches(dataset: Any) -> int:
    """Batches in one pass: the cardinality when tf.data knows it, else counted."""
    known = int(dataset.cardinality())
    if known >= 0:
        return known
    return int(dataset.reduce(tf.constant(0, tf.int64), lambda count, _: count + 1))


class SyncTrainState(TrainState):
    """``TrainState`` on every worker. Metrics that are not means (AUC, ...) keep Keras's
    on-read variables: read across replicas they are all-reduced, a collective only the
    chief (which publishes them) would make, so they are read here from this worker's own
    replica: the chief's batches. Means (loss, accuracy) are the whole job's."""

    def __init__(
        self, job: Job, x_spec: Any, y_spec: Any, *, settings: TrainSettings, strategy: Any
    ) -> None:
        super().__init__(job, x_spec, y_spec, settings=settings, strategy=strategy)
        self.strategy = strategy

    def read_train_metrics(self) -> dict[str, float]:
        others, self.other_metrics = self.other_metrics, []
        try:
            values = super().read_train_metrics()
        finally:
            self.other_metrics = others
        strategy = self.strategy
        for metric in others:
            local = strategy.experimental_local_results(strategy.run(metric.result))[0]
            values[metric.name] = scalar(local)
        return values


class SyncProgram(DefaultProgram):
    """``DefaultProgram``'s packed step function over this worker's dataset, called in
    place (no ClusterCoordinator). With ``--epochs`` the target is the data's: epochs x the
    steps of one pass (the fewest any worker has, so that all step together)."""

    def __init__(self, rt: Runtime, *, index: int, dataset: Any, steps_per_epoch: int) -> None:
        super().__init__(rt)
        self.index = index
        self.dataset = dataset
        self.steps_per_epoch = steps_per_epoch
        if rt.settings.data.epochs:
            self.target = self.progress_total = rt.settings.data.epochs * steps_per_epoch

    def make_iterator(self) -> Any:
        return iter(self.rt.strategy.distribute_datasets_from_function(lambda _: self.dataset))


class CollectiveRunner(RunnerBase):
    """Collective steps under ``MultiWorkerMirroredStrategy``: a ``Runner`` (loop.py) that
    every worker runs in step with the others; ``completed`` is the global step (the same
    on every worker). Each turn opens with one all-gather in which the workers agree on
    anyone's stop, the chief's pause and the chief's steps per call. Nothing is in flight
    between turns, so there is nothing to drain or give up, and no stall watchdog: a lost
    or frozen peer fails the collectives instead (``PeerLost``). Its owner (``SyncTrainer``)
    gives the agreement and whether this worker is the chief."""

    stalls = 0

    @property
    def agreement(self) -> Agreement:
        return self.owner.agreement  # type: ignore[no-any-return]

    @property
    def is_chief(self) -> bool:
        return bool(self.owner.is_chief)

    def start(self) -> None:
        self.program.start(lambda: None)

    def next_turn(self) -> Turn:
        """(stop, pause, steps per call): anyone's stop, the chief's pause and K."""
        control = self.control
        stop = 1.0 if control.stop_requested.is_set() else 0.0
        pause = 1.0 if self.is_chief and control.pause_requested else 0.0
        k = float(self.packer.k) if self.is_chief else 0.0
        started = time.monotonic()
        stop, pause, k = self.agreement.max([stop, pause, k])
        if self.metrics is not None:
            self.metrics.observe_allreduce(time.monotonic() - started)
        if stop > 0 and not control.stop_requested.is_set():
            log.warning("another worker stops: stopping at global step %d", self.completed)
            control.stop_requested.set()
        return Turn(stop=stop > 0, pause=pause > 0, steps_per_call=max(1, int(k)))

    def wants_more(self) -> bool:
        return bool(self.completed < self.program.target)

    def run_call(self, steps: int) -> None:
        num = self.steps_tensor(steps)
        self.hooks.before_schedule(steps)
        seconds = float(self.program.function(self.program.iterator, num))
        self.hooks.after_schedule(steps)
        self.completed = self.scheduled = self.completed + steps
        if self.is_chief:
            k = self.packer.observe(steps=steps, worker_seconds=seconds)
            if k is not None:
                log.info("steps per call: %d", k)
                self.control.steps_per_execution = k
                if self.metrics is not None:
                    self.metrics.set_steps_per_execution(k)
        if self.metrics is not None:
            self.metrics.observe_call(steps=steps, seconds=seconds)
        self.hooks.after_call(steps, seconds)

    def quiesce(self) -> None:
        """Nothing is in flight between turns."""

    def abort(self) -> None:
        """No watcher to stop."""

    def finish(self) -> None:
        """Nothing in flight to land, nothing to join; but no worker ends before every
        worker agrees on the outcome of the last step, in one all-gather. A model that is
        not finite on any worker (the same on every worker after each all-reduce) restarts
        them all from the latest checkpoint, and a worker that already left (the chief's
        NaN guard raised after the last call) fails the all-gather here (``PeerLost``) as
        it would a step. Seen without it: the last step's NaN was found only by the chief's
        final checkpoint; worker 1 ended done, the chief restarted alone and waited for it
        for good."""
        step = self.completed
        finite = 1.0 if self.owner.model_finite() else 0.0
        (agreed,) = self.agreement.min([finite])
        if agreed < 1.0:
            raise RestartFromCheckpoint(
                f"the model is not finite at global step {step}: every worker restarts"
            )


class ChiefEvalEvery:
    """``--eval-every N`` in sync mode: every N global steps the chief evaluates its copy of
    the model (the same on every worker) over every eval example once, between calls, and
    publishes it as the final evaluation is; the other workers wait for it at the next
    agreement (a collective: no timeout, docs/sync.md)."""

    def __init__(
        self,
        job: Job,
        settings: TrainSettings,
        state: TrainState,
        publisher: Publisher,
        *,
        start_step: int,
    ) -> None:
        if job.eval_dataset_fn is None:
            raise ConfigError(
                "--eval-every",
                f"the job {job.name} has no eval_dataset_fn",
                "define eval_dataset_fn(ctx) in the job, or drop --eval-every",
            )
        self.job, self.settings, self.state, self.publisher = job, settings, state, publisher
        self.every = settings.evaluation.eval_every
        self.next_step = (start_step // self.every + 1) * self.every

    def __call__(self, loop: Any) -> None:
        step = int(loop.completed)
        if step < self.next_step or step >= loop.program.target:  # the final one follows
            return
        self.next_step = (step // self.every + 1) * self.every
        state = self.state
        values = evaluate_final(self.job, self.settings, state.model, state.metric_factories, step)
        if values:
            self.publisher.evaluation(values, step=step)


class SyncTrainer(TrainerBase):
    """One worker's part of a synchronous job, on a strategy from ``sync_strategy`` (made
    before the job is loaded): builds the state and the data, and runs ``TrainingLoop``
    over a ``CollectiveRunner`` to a ``Summary``."""

    def __init__(
        self,
        *,
        job: Job,
        cluster: ClusterConfig,
        index: int,
        settings: TrainSettings,
        control: JobControl,
        strategy: Any,  # sync_strategy(cluster, index, ...)
        metrics: CoordinatorMetrics | None = None,
        hooks: LoopHooks | None = None,
    ) -> None:
        # Worker 0 is the chief; a step reads a batch on every worker; no ps.
        super().__init__(
            job, cluster, settings, control, metrics, hooks,
            is_chief=index == 0, examples_per_step=settings.loop.batch_size * cluster.num_workers,
            num_ps=0,
        )  # fmt: skip
        self.index = index
        self.global_batch = self.examples_per_step
        self.strategy = strategy
        self.agreement = Agreement(self.strategy)
        self.dataset, self.steps_per_epoch = self._dataset()
        x_spec, y_spec = self.dataset.element_spec[:2]
        with self.strategy.scope():
            self.state = SyncTrainState(
                job, x_spec, y_spec, settings=settings, strategy=self.strategy
            )
            # Replicas add their rows into one total (all-reduced), so the windows are the
            # whole job's: every worker's examples, once.
            self.state.mean_sums = tf.Variable(
                tf.zeros(self.state.mean_sums.shape, tf.float64),
                trainable=False,
                name="train_mean_sums",
                aggregation=tf.VariableAggregation.SUM,
            )
        self.attach_state(
            self.state,
            x_spec=x_spec,
            y_spec=y_spec,
            strategy=self.strategy,
            coordinator=None,
            run_settings=settings,
        )

    def _dataset(self) -> tuple[Any, int]:
        """This worker's training data, and with ``--epochs`` the steps of one pass."""
        s, n, i = self.settings, self.num_workers, self.index
        if not s.data.epochs:
            ctx = DataContext.from_settings(
                s,
                worker_index=tf.constant(i, tf.int64),
                num_workers=n,
                batch_size=s.loop.batch_size,
            )
            return shard_for(self.job.dataset_fn(ctx), i, n), 0
        # One pass over all the data, its batches dealt out over the workers: every
        # example once per epoch, but the last few batches of a pass that do not fill a
        # step for every worker.
        whole = DataContext.from_settings(
            s, worker_index=0, num_workers=1, batch_size=s.loop.batch_size
        )
        dataset = self.job.dataset_fn(dataclasses.replace(whole, one_pass=True))
        if int(dataset.cardinality()) == int(tf.data.INFINITE_CARDINALITY):
            raise ConfigError(
                "--epochs",
                f"the job's dataset_fn ({self.job.name}) returns an endless dataset",
                "when ctx.one_pass is true, return one pass over the data (no repeat())",
            )
        mine = dataset.shard(n, i) if n > 1 else dataset
        batches = count_batches(mine)
        fewest = int(self.agreement.min([float(batches)])[0])  # the fewest any worker has
        if fewest < 1:
            raise ConfigError(
                "--epochs",
                f"one pass has fewer batches than the {n} workers",
                "use a smaller --batch-size or fewer workers",
            )
        log.info("one epoch: %d steps (%d batches here)", fewest, batches)
        return mine.repeat(), fewest

    def restore(self) -> int:
        """The chief restores its latest checkpoint; then every worker takes its state."""
        self.checkpointer.restore()
        state = self.state
        variables = [*state.model.variables, *state.optimizer.variables, state.global_step]
        broadcast_from_chief(self.strategy, variables, is_chief=self.is_chief)
        return state.step()

    def model_finite(self) -> bool:
        """Whether this worker's model and optimizer hold only finite floats (what the
        chief's checkpoint would refuse otherwise); read on the device, no collective."""
        state = self.state
        return all(
            finite_there(tf.convert_to_tensor(variable))
            for variable in [*state.model.variables, *state.optimizer.variables]
        )

    def run(self) -> Summary:
        try:
            return self._run()
        except tf.errors.OpError as err:
            if peer_lost(err):
                step = self.state.step()  # a local read: no collective
                raise PeerLost(
                    f"an all-reduce with the other workers failed at global step {step}: "
                    f"{describe(err)}"
                ) from err
            raise

    def _run(self) -> Summary:
        s, state = self.settings, self.state
        wall_started = time.monotonic()
        start_step = self.restore()
        program = SyncProgram(
            self.rt, index=self.index, dataset=self.dataset, steps_per_epoch=self.steps_per_epoch
        )
        actions: list[Action] = []
        if self.is_chief and s.evaluation.eval_every:
            actions.append(
                ChiefEvalEvery(self.job, s, state, self.publisher, start_step=start_step)
            )
        runner = CollectiveRunner(self, program, start_step=start_step)
        summary = run_training(
            self, runner, start_step=start_step, wall_started=wall_started, actions=actions
        )
        if not self.is_chief:
            log.info("worker %d done at global step %d", self.index, summary.global_step)
        return summary
