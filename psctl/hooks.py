"""Public hooks into the training loop, for tools that measure it (benchmarks, probes):
``from psctl.hooks import LoopHooks``.

Subclass ``LoopHooks``, override what you need and pass it as ``Trainer(hooks=...)``: each
method is called on the loop's thread at the moment its name says; none may block for
long. ``on_poll`` gets the controller and may call ``request_stop()``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LoopHooks"]


class LoopHooks:
    def before_dataset(self) -> None:
        """The per-worker datasets are about to be created."""

    def after_dataset(self) -> None:
        """The per-worker datasets exist (and the train function is built)."""

    def before_schedule(self, steps: int) -> None:
        """A call of ``steps`` steps is about to be scheduled."""

    def after_schedule(self, steps: int) -> None:
        """``schedule`` returned for a call of ``steps`` steps."""

    def after_call(self, steps: int, seconds: float) -> None:
        """A finished call's value was fetched: ``steps`` steps, ``seconds`` on the worker."""

    def on_poll(self, controller: Any) -> None:
        """The loop looked at its calls in flight (every turn, and while it waits)."""

    def before_join(self) -> None:
        """The loop ended; ``ClusterCoordinator.join()`` comes next."""

    def after_join(self) -> None:
        """``join()`` returned (or was skipped: calls stuck on a frozen task)."""
