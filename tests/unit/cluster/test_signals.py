"""cluster.signals: stop signals handled on a relay thread, never under a lock the main
thread may hold (real signals sent to this process's main thread)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from psctl.cluster.processes.signals import SignalRelay
from tests.conftest import child_env

pytestmark = pytest.mark.timeout(30)


def send_to_main_thread(sig: int) -> None:
    signal.pthread_kill(threading.main_thread().ident or 0, sig)


def test_the_handler_takes_no_lock_that_the_main_thread_holds() -> None:
    """A signal can land while the main thread is inside Event.set() or Event.wait()'s
    bookkeeping, holding the Event's lock (a second parent-death signal during the first's
    handler, seen). Calling Event.set() from the handler then waits forever; through the
    relay it waits only until the main thread lets go."""
    event = threading.Event()
    on_thread: list[bool] = []

    def handler(_signum: int) -> None:
        on_thread.append(threading.current_thread() is not threading.main_thread())
        event.set()

    old = signal.getsignal(signal.SIGUSR1)
    relay = SignalRelay(handler, [signal.SIGUSR1])
    try:
        with event._cond:  # held as Event.set() holds it
            send_to_main_thread(signal.SIGUSR1)
            time.sleep(0.2)  # the handler runs in this thread meanwhile: it must return
            assert relay.received == 1 and not event.is_set()
        assert event.wait(5.0) and on_thread == [True]
    finally:
        relay.restore()
    assert signal.getsignal(signal.SIGUSR1) is old


def test_a_second_signal_aborts_when_asked() -> None:
    handled: list[int] = []
    relay = SignalRelay(handled.append, [signal.SIGUSR1], abort_on_second=True)
    try:
        send_to_main_thread(signal.SIGUSR1)
        deadline = time.monotonic() + 5.0
        while not handled and time.monotonic() < deadline:
            time.sleep(0.01)
        assert handled == [signal.SIGUSR1]
        with pytest.raises(KeyboardInterrupt):
            send_to_main_thread(signal.SIGUSR1)
            time.sleep(2.0)
        assert handled == [signal.SIGUSR1]  # the second one went to the main thread only
    finally:
        relay.restore()


def test_early_stops_counts_the_first_and_dies_of_the_second():
    """A training process still starting keeps a stop for its loop (``received``); a
    second one ends it as the default action would."""
    code = (
        "import os, signal, sys\n"
        "from psctl.cluster.processes.signals import EarlyStops\n"
        "early = EarlyStops()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "early.die() if sys.argv[1] == 'die' else None\n"
        "print(early.received, early.signum == signal.SIGTERM, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "print('not reached')\n"
    )
    for how, want in (("keep", "1 True\n"), ("die", "")):
        proc = subprocess.run(
            [sys.executable, "-c", code, how],
            capture_output=True,
            text=True,
            timeout=60,
            env=child_env(),
        )
        assert proc.stdout == want
        assert proc.returncode == (-signal.SIGINT if how == "keep" else -signal.SIGTERM)
