"""The parameter-server strategy's runner (``--strategy async``) under the one outer loop
(loop.py): schedules the step program's calls (packed K steps each) on a
``ClusterCoordinator``, keeps a bounded number in flight, watches for stalls and gives up
calls stuck on a frozen worker (their steps run again elsewhere), hands every call's error
to the failure policy, and joins the workers at the end.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from psctl.coordinator.failures import Decision, FailurePolicy, classify
from psctl.coordinator.training.inflight import CallTracker, InFlight, StallWatchdog
from psctl.coordinator.training.loop import RunnerBase, Turn
from psctl.coordinator.training.steps.packing import Packer
from psctl.coordinator.training.steps.programs import StepProgram

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


class ScheduledRunner(RunnerBase):
    """Scheduled calls on a ``ClusterCoordinator``: a ``Runner`` (loop.py)."""

    def __init__(
        self,
        owner: Any,
        program: StepProgram,
        *,
        start_step: int,
        coordinator: Any,  # tf.distribute.coordinator.ClusterCoordinator
        policy: FailurePolicy,
        max_in_flight: int,
        stall_timeout: float,
        packer: Packer | None = None,
    ) -> None:
        """``owner``: the trainer (see ``RunnerBase``)."""
        super().__init__(owner, program, start_step=start_step, packer=packer)
        self.coordinator = coordinator
        self.policy = policy
        self.max_in_flight = max_in_flight
        self.calls = CallTracker()
        self.watchdog = StallWatchdog(timeout=stall_timeout)
        self.abandoned = 0  # calls given up by the stall watchdog
        self._done = threading.Event()  # the loop and its drain are over: stop watching
        self.control.steps_per_execution = self.packer.k
        self._k_logged: int | None = None  # the last K logged at INFO

    @property
    def stalls(self) -> int:
        return self.watchdog.stalls

    # -- the Runner -----------------------------------------------------------------------

    def start(self) -> None:
        # The program keeps its iterators, never collected: destroying per-worker iterators
        # sends ops to every worker, and one to a restarted worker can hold up all later
        # eager work (seen: the final evaluation hung after a worker and a ps restarted).
        self.program.start(self.settle)
        threading.Thread(target=self._watch_stalls, name="psctl-stall", daemon=True).start()

    def next_turn(self) -> Turn:
        control = self.control
        return Turn(
            stop=control.stop_requested.is_set(),
            pause=control.pause_requested,
            steps_per_call=self.packer.k,
        )

    def wants_more(self) -> bool:
        if self.program.wants_more(self.scheduled):
            return True
        # The last calls land, or the watchdog gives up those stuck on a frozen worker:
        # their steps are owed again, and scheduled on the others.
        self.settle()
        return bool(self.program.wants_more(self.scheduled))

    def run_call(self, steps: int) -> None:
        self._schedule(steps)
        self._wait(room_for=self.max_in_flight)
        self._poll()
        if self.metrics is not None:
            self.metrics.set_closures(in_flight=len(self.calls), queued=0)

    def quiesce(self) -> None:
        self.settle()

    def abort(self) -> None:
        self._done.set()

    def finish(self) -> None:
        """After the loop (STOPPING): every call landed (or given up), join the workers."""
        self.settle()
        self._done.set()
        self.hooks.before_join()
        if self.abandoned:
            # join() would wait for the calls given up on a frozen worker: not worth a hang.
            log.warning("finishing without %d call(s) stuck on a frozen task", self.abandoned)
        else:
            self.coordinator.join()
        self.hooks.after_join()

    def _schedule(self, steps: int) -> None:
        num = self.steps_tensor(steps)
        self.hooks.before_schedule(steps)
        # program.iterator: --epochs may start a new one (make-up passes: steps/epochs.py)
        remote = self.coordinator.schedule(self.program.function, args=(self.program.iterator, num))
        self.hooks.after_schedule(steps)
        self.calls.add(remote, steps)
        self.scheduled += steps

    def settle(self) -> None:
        """Wait until every call in flight has finished (or was given up)."""
        self._wait(room_for=0)

    def _wait(self, *, room_for: int) -> None:
        """Retire finished calls until at most ``room_for`` are in flight. Never blocks on
        one call: a frozen worker's call must not hold up the rest (stall watchdog)."""
        while len(self.calls) > room_for:
            finished = self.calls.take_finished()
            for entry in finished:
                self._retire(entry)
            if finished:
                continue
            self._poll()
            if len(self.calls) > room_for:
                self.calls.wait_for_oldest(0.05)

    def _retire(self, entry: InFlight) -> None:
        try:
            value = entry.remote.fetch()  # done: returns at once, or raises
        except BaseException as err:
            if self.policy.decide(classify(err)) is not Decision.RESCHEDULE:
                raise
            # TensorFlow usually reruns a dead worker's call elsewhere; when it gives the
            # error back instead, schedule its steps again ourselves.
            log.warning(
                "a call failed with its worker (%s); its steps are scheduled again",
                type(err).__name__,
            )
            self.scheduled -= entry.steps
            return
        steps, seconds = self.program.result(entry.steps, value)
        self.completed += steps
        if self.watchdog.progress():
            log.warning("steps finish again: the stall is over")
            self.control.set_message("")
            if self.metrics is not None:
                self.metrics.set_stalled(False)
        self._repack(steps, seconds)
        if self.metrics is not None:
            self.metrics.observe_call(steps=steps, seconds=seconds)
        self.hooks.after_call(steps, seconds)

    def _repack(self, steps: int, seconds: float) -> None:
        k = self.packer.observe(steps=steps, worker_seconds=seconds)
        if k is None:
            return
        m = self.packer.last
        # INFO only when K moves by more than 2x from the last K logged so: the tuner adjusts
        # K every window, and the progress lines drowned in them (16-19 in a short run).
        shown = self._k_logged
        big = shown is None or k > 2 * shown or 2 * k < shown
        if big:
            self._k_logged = k
        log.log(
            logging.INFO if big else logging.DEBUG,
            "steps per call: %d (per call %.1f ms overhead vs %.2f ms/step)",
            k,
            1e3 * m.overhead_seconds if m else 0.0,
            1e3 * m.step_seconds if m else 0.0,
        )
        self.control.steps_per_execution = k
        if self.metrics is not None:
            self.metrics.set_steps_per_execution(k)

    def _poll(self) -> None:
        """The stall watchdog's look (--stall-timeout), then the tools' hook. While the job
        stops, calls that cannot land are given up: all of them once it is stalled (a stop
        must end), or at once when the control says they never will."""
        if self.control.abandon_in_flight.is_set() and len(self.calls):
            self._give_up(list(self.calls), "they wait on a worker this process lost")
        stopping = self.control.stop_requested.is_set()
        stall = self.watchdog.check(self.calls, stopping=stopping)
        if stall is not None:
            self._report_stall(stall.stuck, started=stall.started, idle=stall.idle_seconds)
        self.hooks.on_poll(self)

    def _watch_stalls(self) -> None:
        """Beside the loop, once a second: a stall is reported even while the loop's own
        thread waits on a blocked ps (seen: a frozen worker held up the ps, and with it
        the loop's status read, until the worker thawed)."""
        while not self._done.wait(1.0):
            idle = self.watchdog.check_idle(len(self.calls))
            if idle is not None:
                self._announce_stall(idle, self._suspects())
            else:  # the status counts the stall on (the loop publishes nothing meanwhile)
                self.watchdog.while_stalled(self._show_stall)

    def _suspects(self) -> str:
        return ", ".join(self.control.unhealthy_tasks()) or "none (a task is frozen?)"

    def _announce_stall(self, idle: float, suspects: str) -> None:
        log.warning("%s", self._show_stall(idle, suspects))
        if self.metrics is not None:
            self.metrics.set_stalled(True)

    def _show_stall(self, idle: float, suspects: str | None = None) -> str:
        """The stall in the status: its length, its suspects, no steps a second."""
        suspects = self._suspects() if suspects is None else suspects
        message = f"stalled: no step finished for {idle:.0f}s; tasks not SERVING: {suspects}"
        self.control.update(message=message, steps_per_second=0.0, examples_per_second=0.0)
        return message

    def _report_stall(self, stuck: list[InFlight], *, started: bool, idle: float) -> None:
        """A stalled job says so, with the tasks that are not SERVING, until steps finish
        again; calls stuck on a frozen or cut-off worker are given up and their steps
        scheduled again, so the job finishes without a worker that stays frozen (if it
        thaws, its call still lands)."""
        suspects = self._suspects()
        if started:
            self._announce_stall(idle, suspects)
        if stuck:
            self._give_up(
                stuck,
                f"unfinished after {self.watchdog.timeout:.0f}s (tasks not SERVING: {suspects})",
            )

    def _give_up(self, stuck: list[InFlight], why: str) -> None:
        """Stop waiting for ``stuck`` calls (if one lands later, it still counts on the ps);
        their steps are owed again."""
        log.warning("%d call(s) given up, their steps scheduled again: %s", len(stuck), why)
        self.calls.give_up(stuck)
        for entry in stuck:
            self.scheduled -= entry.steps
            self.abandoned += 1
