"""The controller's call tracking, stall watchdog and --epochs's drain watch, driven with
fake calls and a fake clock (no TensorFlow)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from psctl.coordinator.training.inflight import CallTracker, DrainWatch, StallWatchdog


@dataclass
class FakeCall:
    done: bool = False


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def tracker(clock: Clock) -> CallTracker:
    return CallTracker(is_done=lambda call: call.done, wait=lambda call, t: None, clock=clock)


def test_finished_calls_are_taken_and_older_running_ones_marked_overtaken():
    clock = Clock()
    calls = tracker(clock)
    first, second, third = FakeCall(), FakeCall(), FakeCall()
    entries = []
    for call in (first, second, third):
        entries.append(calls.add(call, steps=10))
        clock.now += 1
    assert calls.take_finished() == []
    second.done = True
    clock.now = 200.0
    taken = calls.take_finished()
    assert [e.remote for e in taken] == [second]
    assert len(calls) == 2
    assert entries[0].overtaken_at == 200.0  # scheduled before the finished one
    assert entries[2].overtaken_at is None  # scheduled after it: may still be queued


def test_watchdog_gives_up_calls_overtaken_for_the_timeout():
    clock = Clock()
    calls = tracker(clock)
    watchdog = StallWatchdog(timeout=8, clock=clock)
    frozen, later = FakeCall(), FakeCall()
    calls.add(frozen, steps=20)
    clock.now += 1
    calls.add(later, steps=20)
    later.done = True
    calls.take_finished()
    watchdog.progress()
    clock.now += 7.9
    assert watchdog.check(calls) is None
    clock.now += 0.2
    stall = watchdog.check(calls)
    assert stall is not None and [e.remote for e in stall.stuck] == [frozen]
    assert stall.started  # and nothing else finished for as long: the job is stalled too


def test_watchdog_reports_a_stall_once_until_progress():
    clock = Clock()
    calls = tracker(clock)
    watchdog = StallWatchdog(timeout=5, clock=clock)
    calls.add(FakeCall(), steps=1)
    clock.now += 5
    first = watchdog.check(calls)
    assert first is not None and first.started and first.idle_seconds == pytest.approx(5)
    assert watchdog.stalled and watchdog.stalls == 1
    clock.now += 5
    again = watchdog.check(calls)
    assert again is not None and not again.started  # still the same stall
    assert watchdog.stalls == 1
    assert watchdog.progress() is True  # a call finished: the stall is over
    assert watchdog.progress() is False
    clock.now += 5
    third = watchdog.check(calls)
    assert third is not None and third.started and watchdog.stalls == 2


def test_watchdog_is_quiet_with_nothing_in_flight():
    clock = Clock()
    watchdog = StallWatchdog(timeout=1, clock=clock)
    clock.now += 100
    assert watchdog.check(tracker(clock)) is None


def test_watchdog_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout"):
        StallWatchdog(timeout=0)


def test_the_side_thread_check_reports_a_stall_once_and_the_loop_does_not_again():
    """check_idle (the controller's thread beside the loop, for a loop blocked on the ps)
    and check (the loop's own) start one stall between them."""
    clock = Clock()
    calls = tracker(clock)
    watchdog = StallWatchdog(timeout=5, clock=clock)
    calls.add(FakeCall(), steps=1)
    clock.now += 4
    assert watchdog.check_idle(len(calls)) is None  # not yet
    clock.now += 2
    assert watchdog.check_idle(0) is None  # nothing in flight: no stall
    assert watchdog.check_idle(len(calls)) == pytest.approx(6)
    assert watchdog.check_idle(len(calls)) is None  # reported once
    seen = watchdog.check(calls)
    assert seen is not None and not seen.started and watchdog.stalls == 1
    # While it lasts the status counts it on (it said "for 10s" a minute in).
    shown: list[float] = []
    clock.now += 30
    watchdog.while_stalled(shown.append)
    assert shown == [pytest.approx(36)]
    assert watchdog.progress() is True  # "steps finish again"
    watchdog.while_stalled(shown.append)
    assert len(shown) == 1  # over: nothing more to show


def test_a_stopping_job_gives_up_every_call_once_stalled():
    """A stop or a resize waits for calls that nothing overtook (all stuck: the whole job
    stalled) only until the stall: then each is given up, so that the stop ends (found by
    bench/soak.py: a resize that waited 140 s). Before the timeout it waits for them."""
    clock = Clock()
    calls = tracker(clock)
    watchdog = StallWatchdog(timeout=5, clock=clock)
    first, second = FakeCall(), FakeCall()
    calls.add(first, steps=1)
    calls.add(second, steps=1)
    clock.now += 4.9
    assert watchdog.check(calls, stopping=True) is None
    clock.now += 0.2
    quiet = StallWatchdog(timeout=5, clock=clock)  # the same calls, not stopping
    quiet.last_progress = watchdog.last_progress
    stall = quiet.check(calls)
    assert stall is not None and stall.stuck == []  # a stall, but nothing given up
    stall = watchdog.check(calls, stopping=True)
    assert stall is not None and [e.remote for e in stall.stuck] == [first, second]


def test_drain_watch_expires_after_the_timeout_of_empty_calls_while_a_worker_is_at_the_end():
    clock = Clock()
    watch = DrainWatch(timeout=10.0, clock=clock)
    for _ in range(30):  # a minute of training, then a worker reaches the end
        clock.now += 2
        watch.observe(640, draining=False)
    assert not watch.expired
    for _ in range(9):  # empty calls from the finished worker, one a second
        clock.now += 1
        watch.observe(0, draining=True)
    assert not watch.expired and watch.waited == pytest.approx(9.0)
    clock.now += 1
    watch.observe(0, draining=True)
    assert watch.expired


def test_drain_watch_starts_over_when_a_draining_worker_trains_or_a_new_pass_starts():
    clock = Clock()
    watch = DrainWatch(timeout=10.0, clock=clock)
    watch.observe(0, draining=True)
    for _ in range(8):
        clock.now += 1
        watch.observe(0, draining=True)
    clock.now += 1
    watch.observe(64, draining=True)  # the last worker drains its buffered batches
    assert watch.waited == 0.0
    for _ in range(8):
        clock.now += 1
        watch.observe(0, draining=True)
    watch.reset()  # make-up passes: nobody is at the end any more
    assert watch.waited == 0.0 and not watch.expired
    clock.now += 100
    watch.observe(0, draining=True)  # the first call after a reset has no gap to count
    assert watch.waited == 0.0


def test_drain_watch_counts_a_pause_as_one_short_gap():
    clock = Clock()
    watch = DrainWatch(timeout=10.0, max_gap=5.0, clock=clock)
    watch.observe(0, draining=True)
    clock.now += 3600  # paused for an hour: no call came back
    watch.observe(0, draining=True)
    assert watch.waited == pytest.approx(5.0) and not watch.expired
