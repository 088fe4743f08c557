"""The training process's core: builds the strategy, the state on the ps, the step program,
checkpoints and evaluation, and runs the controller to a ``Summary``.

The outer loop (controller.py: progress, checkpoints, evaluation, failures) is kept apart
from the step that gets scheduled (programs.py, epochs.py, local_step.py): one scheduled
function runs K packed steps on a worker, updates loss and metric objects that live on the
ps tasks, and the loop reads those at a cadence instead of fetching values every step.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from psctl.cluster.spec import ClusterConfig
from psctl.coordinator.failures import FailurePolicy
from psctl.coordinator.job import DataContext, Job
from psctl.coordinator.settings import IN_FLIGHT_PER_WORKER, TrainSettings
from psctl.coordinator.training.actions import EvalEvery, status_and_checkpoints
from psctl.coordinator.training.checkpoints import Checkpointer
from psctl.coordinator.training.controller import Controller
from psctl.coordinator.training.epochs import EpochProgram
from psctl.coordinator.training.evaluation import evaluate_elsewhere, evaluate_final
from psctl.coordinator.training.inline_eval import InlineEval
from psctl.coordinator.training.model import TrainState
from psctl.coordinator.training.packing import packer_for
from psctl.coordinator.training.programs import (
    DefaultProgram,
    LocalStepProgram,
    Runtime,
    StepProgram,
)
from psctl.coordinator.training.publish import Publisher
from psctl.coordinator.training.strategy import connect
from psctl.coordinator.training.summary import Summary, accuracy_of
from psctl.hooks import LoopHooks

if TYPE_CHECKING:
    from psctl.coordinator.control.metrics import CoordinatorMetrics
    from psctl.coordinator.control.service import JobControl

log = logging.getLogger(__name__)


class Trainer:
    """Builds the strategy, the model on the ps tasks, and runs the loop."""

    def __init__(
        self,
        *,
        job: Job,
        cluster: ClusterConfig,
        settings: TrainSettings,
        control: JobControl,
        metrics: CoordinatorMetrics | None = None,
        data_dispatcher: str | None = None,  # the tf.data service's, for --epochs
        hooks: LoopHooks | None = None,
        policy: FailurePolicy | None = None,
    ) -> None:
        self.job = job
        self.cluster = cluster
        self.settings = settings
        self.control = control
        self.metrics = metrics
        self.data_dispatcher = data_dispatcher
        self.hooks = hooks
        self.policy = policy or FailurePolicy()
        self.num_workers = cluster.num_workers
        self.strategy, self.coordinator = connect(cluster, settings)
        self.publisher = Publisher(
            control=control, metrics=metrics, logdir=settings.logdir, batch_size=settings.batch_size
        )
        s = settings
        # The element spec, from a dataset built here but never iterated, tells the
        # model's input shape and which accuracy fits the labels.
        ctx = DataContext.from_settings(
            s, worker_index=0, num_workers=self.num_workers, batch_size=s.batch_size
        )
        x_spec, y_spec = job.dataset_fn(ctx).element_spec[:2]
        with self.strategy.scope():
            self.state = TrainState(job, x_spec, y_spec, settings=s, strategy=self.strategy)
        self.checkpointer = Checkpointer(
            state=self.state,
            job=job,
            settings=settings,
            x_spec=x_spec,
            y_spec=y_spec,
            control=control,
            metrics=metrics,
        )
        self.rt = Runtime(
            job=job,
            settings=settings,
            strategy=self.strategy,
            coordinator=self.coordinator,
            num_workers=self.num_workers,
            state=self.state,
        )
        self.program: StepProgram | None = None  # kept: its iterators must never be collected

    @property
    def model(self) -> Any:
        return self.state.model

    @property
    def optimizer(self) -> Any:
        return self.state.optimizer

    def _program(self) -> StepProgram:
        if self.settings.epochs:
            return EpochProgram(
                self.rt,
                dispatcher=self.data_dispatcher,
                worker_failures=lambda: self.control.failure_counts().get("worker", 0),
            )
        if self.settings.update_mode == "local":
            return LocalStepProgram(self.rt)
        return DefaultProgram(self.rt)

    def run(self) -> Summary:
        s, control, state = self.settings, self.control, self.state
        wall_started = time.monotonic()
        start_step = self.checkpointer.restore()
        program = self.program = self._program()
        target = program.target
        status, actions = status_and_checkpoints(
            s,
            state=state,
            publisher=self.publisher,
            checkpointer=self.checkpointer,
            progress_total=program.progress_total,
            batch_size=s.batch_size,
            start_step=start_step,
        )
        evals = None
        if s.eval_every:
            evals = InlineEval(
                self.rt, self.publisher, self.policy, every=s.eval_every, start_step=start_step
            )
            actions.append(EvalEvery(evals))
        packer = packer_for(s, self.num_workers)
        loop = Controller(
            program=program,
            coordinator=self.coordinator,
            control=control,
            publisher=self.publisher,
            status=status,
            checkpointer=self.checkpointer,
            actions=actions,
            packer=packer,
            policy=self.policy,
            metrics=self.metrics,
            max_in_flight=s.max_in_flight or IN_FLIGHT_PER_WORKER * self.num_workers,
            stall_timeout=s.stall_timeout,
            start_step=start_step,
            global_step=state.global_step,
            hooks=self.hooks,
        )
        if start_step >= target:
            log.info(
                "global step %d already reaches --steps %d: nothing to train", start_step, target
            )
        control.update(global_step=start_step)
        if self.metrics is not None:
            self.metrics.set_global_step(start_step)
            self.metrics.set_target_steps(program.progress_total)
            self.metrics.set_steps_per_execution(packer.k)
        if start_step < target and not control.stop_requested.is_set():
            loop.run(target)
        loop.finish()
        if evals is not None:
            evals.poll()  # an inline evaluation that finished with the last steps
        train_seconds = loop.train_seconds()
        final_step = state.step()
        trained = final_step - start_step
        values = state.read_train_metrics() if trained > 0 else {}
        values = values or status.last_values
        rate = trained / train_seconds if trained > 0 and train_seconds > 0 else 0.0
        status.progress.finish(final_step, rate * s.batch_size, values)
        self.publisher.progress(final_step, rate, values)
        if self.checkpointer.enabled:
            checkpoint = self.checkpointer.save() if trained > 0 else self.checkpointer.latest
        else:
            checkpoint = None
        if loop.abandoned and checkpoint:
            eval_values = evaluate_elsewhere(s, checkpoint)
        else:
            eval_values = evaluate_final(
                self.job, s, state.model, state.metric_factories, final_step
            )
        if eval_values:
            self.publisher.evaluation(eval_values, step=final_step)
        extra = {k: v for k, v in values.items() if k not in ("loss", "accuracy")}
        return Summary(
            job=self.job.name,
            global_step=final_step,
            start_step=start_step,
            target_steps=final_step if s.epochs else target,
            loss=values.get("loss"),
            accuracy=accuracy_of(values),
            eval_accuracy=accuracy_of(eval_values),
            eval_loss=eval_values.get("loss"),
            eval_auc=eval_values.get("auc"),
            examples_per_sec=rate * s.batch_size,
            steps_per_sec=rate,
            wall_seconds=time.monotonic() - wall_started,
            train_seconds=train_seconds,
            num_workers=self.num_workers,
            num_ps=self.cluster.num_ps,
            batch_size=s.batch_size,
            steps_per_execution=packer.k,
            checkpoint=checkpoint,
            stopped_early=program.stopped_early(final_step),
            stalls=loop.stalls,
            metrics=extra,
            eval_metrics=eval_values,
        )
