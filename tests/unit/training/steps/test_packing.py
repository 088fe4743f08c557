"""The pure logic of --steps-per-execution auto (coordinator/training/steps/packing.py)."""

from __future__ import annotations

import pytest

from psctl.cluster.errors import ConfigError
from psctl.coordinator.settings import TrainSettings, resolve_settings
from psctl.coordinator.training.steps.packing import MAX_K, Packer, choose_k, packer_for


def test_choose_k_keeps_overhead_under_target():
    k = choose_k(step_seconds=0.001, overhead_seconds=0.009, target=0.10, min_k=1, max_k=1000)
    assert k == 81  # 9 ms / (9 ms + 81 ms) = 10%
    assert 0.009 / (0.009 + k * 0.001) <= 0.10
    assert 0.009 / (0.009 + (k - 1) * 0.001) > 0.10


@pytest.mark.parametrize(
    ("step", "overhead", "expected"),
    [(0.001, 10.0, 50), (0.001, 0.0, 2), (0.0, 0.01, 50), (0.01, -1.0, 2)],
)
def test_choose_k_is_clamped(step, overhead, expected):
    k = choose_k(step_seconds=step, overhead_seconds=overhead, target=0.1, min_k=2, max_k=50)
    assert k == expected


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_windows(packer: Packer, clock: FakeClock, *, step: float, overhead: float, n: int) -> None:
    """Two workers, every call taking overhead + K * step of a worker's time."""
    for _ in range(n):
        call = overhead + packer.k * step
        clock.now += call / 2  # two workers finish calls in turn
        packer.observe(steps=packer.k, worker_seconds=packer.k * step)


def test_auto_converges_to_a_k_within_bounds():
    clock = FakeClock()
    packer = Packer(num_workers=2, max_steps=5000, clock=clock, max_call_seconds=10.0)
    assert packer.auto and packer.k == 20
    run_windows(packer, clock, step=0.001, overhead=0.009, n=400)
    assert abs(packer.k - 81) <= 8  # K moves only when off by more than 10%
    assert packer.last is not None and packer.last.overhead_fraction == pytest.approx(0.1, abs=0.01)
    # The step time grows (another load): fewer steps per call keep the same overhead share.
    run_windows(packer, clock, step=0.003, overhead=0.009, n=400)
    assert 25 <= packer.k <= 30


def test_auto_respects_call_length_and_checkpoint_bounds():
    clock = FakeClock()
    packer = Packer(num_workers=1, max_steps=40, clock=clock, max_call_seconds=0.5)
    run_windows(packer, clock, step=0.001, overhead=1.0, n=300)
    assert packer.k == 40  # would be 9000; checkpoints every 40 steps bound it
    clock = FakeClock()
    packer = Packer(num_workers=1, max_steps=5000, clock=clock, max_call_seconds=0.5)
    run_windows(packer, clock, step=0.01, overhead=1.0, n=300)
    assert packer.k == 50  # 0.5 s per call at 10 ms per step


def test_auto_does_not_collapse_when_no_overhead_is_seen():
    clock = FakeClock()
    packer = Packer(num_workers=2, max_steps=5000, clock=clock)
    run_windows(packer, clock, step=0.001, overhead=0.0, n=300)
    assert packer.k == 8


def test_fixed_k_never_changes():
    packer = Packer(fixed=7, num_workers=2)
    assert not packer.auto
    assert packer.observe(steps=7, worker_seconds=10.0) is None
    assert packer.k == 7


def test_packer_for_settings():
    assert packer_for(TrainSettings(), 2).auto
    assert packer_for(TrainSettings(), 2).max_k == MAX_K
    with_ckpt = TrainSettings.of(checkpoint_dir="x", checkpoint_every=100)
    assert packer_for(with_ckpt, 2).max_k == 100
    local = packer_for(TrainSettings.of(update_mode="local", local_steps=30), 2)
    assert not local.auto and local.k == 30


@pytest.mark.parametrize(("value", "expected"), [("auto", 0), ("AUTO", 0), ("12", 12), (5, 5)])
def test_steps_per_execution_accepts_auto(value, expected):
    flags = {"steps_per_execution": value}
    assert resolve_settings(flags=flags, config_file=None, environ={}).loop.steps_per_execution == (
        expected
    )


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        ({"steps_per_execution": "fast"}, "--steps-per-execution"),
        ({"update_mode": "sync"}, "--update-mode"),
        ({"local_steps": 0}, "--local-steps"),
        ({"local_scale": 0}, "--local-scale"),
    ],
)
def test_bad_packing_settings_name_the_flag(flags, field):
    with pytest.raises(ConfigError) as err:
        resolve_settings(flags=flags, config_file=None, environ={})
    assert field in str(err.value)
