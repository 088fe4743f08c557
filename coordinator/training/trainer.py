"""The training process's core: builds the strategy, the state on the ps, the step program,
checkpoints and evaluation, and runs the controller to a ``Summary``.

The outer loop (training/loop.py: progress, checkpoints, evaluation, failures) is kept apart
from the step that gets scheduled (training/steps/programs.py, training/steps/epochs.py,
training/steps/local_step.py): one scheduled function runs K packed steps on a worker,
updates loss and metric objects that live on the ps tasks, and the loop reads those at a
cadence instead of fetching values every step.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from psctl.cluster.spec import ClusterConfig
from psctl.coordinator.data.context import DataContext
from psctl.coordinator.data.files import file_list
from psctl.coordinator.embeddings.dynamic_updates import Evict
from psctl.coordinator.failures import FailurePolicy
from psctl.coordinator.job import Job
from psctl.coordinator.settings import IN_FLIGHT_PER_WORKER, TrainSettings
from psctl.coordinator.training.actions import Action, EvalEvery
from psctl.coordinator.training.evaluation.final_eval import evaluate_elsewhere, evaluate_final
from psctl.coordinator.training.evaluation.inline_eval import InlineEval
from psctl.coordinator.training.job_model.model import TrainState
from psctl.coordinator.training.loop import TrainerBase, run_training
from psctl.coordinator.training.reporting.summary import Summary
from psctl.coordinator.training.saving.publish_gate import check_metric
from psctl.coordinator.training.saving.publishing import VersionPublisher
from psctl.coordinator.training.scheduled import ScheduledRunner
from psctl.coordinator.training.steps.epochs import EpochProgram
from psctl.coordinator.training.steps.follow import FollowInput, freshness_summary
from psctl.coordinator.training.steps.programs import (
    DefaultProgram,
    LocalStepProgram,
    StepProgram,
)
from psctl.coordinator.training.strategy import connect
from psctl.hooks import LoopHooks

if TYPE_CHECKING:
    from psctl.coordinator.operations.job_state import JobControl
    from psctl.coordinator.operations.metrics import CoordinatorMetrics

log = logging.getLogger(__name__)


class Trainer(TrainerBase):
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
        # The coordinator reports, checkpoints and evaluates; a call's steps read a batch each.
        super().__init__(
            job, cluster, settings, control, metrics, hooks,
            is_chief=True, examples_per_step=settings.loop.batch_size, num_ps=cluster.num_ps,
        )  # fmt: skip
        self.data_dispatcher = data_dispatcher
        self.policy = policy or FailurePolicy()
        self.strategy, self.coordinator = connect(cluster, settings)
        s = settings
        # The element spec, from a dataset built here but never iterated, tells the
        # model's input shape and which accuracy fits the labels.
        ctx = DataContext.from_settings(
            s, worker_index=0, num_workers=self.num_workers, batch_size=s.loop.batch_size
        )
        self.follow = FollowInput(s, control, metrics) if s.data.follow else None
        if self.follow is not None:  # the first complete partition's files tell the spec
            ctx = dataclasses.replace(ctx, train_data=file_list(list(self.follow.first.files)))
        x_spec, y_spec = job.dataset_fn(ctx).element_spec[:2]
        with self.strategy.scope():
            self.state = TrainState(
                job, x_spec, y_spec, settings=s, strategy=self.strategy, num_ps=cluster.num_ps
            )
        self.attach_state(
            self.state,
            x_spec=x_spec,
            y_spec=y_spec,
            strategy=self.strategy,
            coordinator=self.coordinator,
            run_settings=settings,
        )
        self.program: StepProgram | None = None  # kept: its iterators must never be collected

    @property
    def model(self) -> Any:
        return self.state.model

    @property
    def optimizer(self) -> Any:
        return self.state.optimizer

    def _program(self) -> StepProgram:
        if self.follow is not None:
            return self.follow.program(
                self.rt,
                dispatcher=self.data_dispatcher,
                worker_failures=lambda: self.control.failure_counts().get("worker", 0),
                save=self.checkpointer.save,
                step=self.state.step,
                serve_requests=self.checkpointer.serve_requests,
            )
        if self.settings.data.epochs:
            return EpochProgram(
                self.rt,
                dispatcher=self.data_dispatcher,
                worker_failures=lambda: self.control.failure_counts().get("worker", 0),
            )
        if self.settings.loop.update_mode == "local":
            return LocalStepProgram(self.rt)
        return DefaultProgram(self.rt)

    def run(self) -> Summary:
        s, state = self.settings, self.state
        wall_started = time.monotonic()
        follow = self.follow
        start_step = self.checkpointer.restore(
            at_most=follow.journal.restore_step() if follow is not None else None
        )
        if follow is not None:
            follow.resume(start_step)
        program = self.program = self._program()
        publisher = None
        if s.publishing.export_if_better:
            check_metric(s.publishing.export_if_better, state.metric_factories)
        if s.publishing.export_every:
            publisher = VersionPublisher(
                settings=s,
                checkpointer=self.checkpointer,
                control=self.control,
                metrics=self.metrics,
                train_data=follow.newest_files if follow is not None else lambda: s.data.train_data,
            )
            publisher.start()
            if follow is not None:
                follow.on_round_recorded = publisher.poke
        actions: list[Action] = []
        evals = None
        if state.dynamic_layers:
            actions.append(
                Evict(state.dynamic_layers, step=state.step, publish=self.publisher.tables)
            )
        if s.evaluation.eval_every:
            evals = InlineEval(
                self.rt,
                self.publisher,
                self.policy,
                every=s.evaluation.eval_every,
                start_step=start_step,
            )
            actions.append(EvalEvery(evals))
        runner = ScheduledRunner(
            self,
            program,
            start_step=start_step,
            coordinator=self.coordinator,
            policy=self.policy,
            max_in_flight=s.loop.max_in_flight or IN_FLIGHT_PER_WORKER * self.num_workers,
            stall_timeout=s.loop.stall_timeout,
        )

        def evaluate(step: int, checkpoint: str | None) -> dict[str, float]:
            if evals is not None:
                evals.poll()  # an inline evaluation that finished with the last steps
            if runner.abandoned and checkpoint:
                return evaluate_elsewhere(s, checkpoint)
            return evaluate_final(self.job, s, state.model, state.metric_factories, step)

        summary = run_training(
            self, runner, start_step=start_step, wall_started=wall_started, actions=actions,
            evaluate=evaluate,
        )  # fmt: skip
        if publisher is not None:
            publisher.finish()
        summary.freshness = freshness_summary(self.control, follow)
        return summary
