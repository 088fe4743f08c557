"""The benchmarks' summary lines, pure logic over recorded runs: bench/tta.py's equal-step
comparison, bench/embeddings.py's ratios and round trips per step."""

from __future__ import annotations

import argparse
import re

from bench import embeddings, soak, tta


def _row(mode: str, median_s: float) -> dict:
    return {"mode": mode, "median_s": median_s}


def test_a_mode_whose_first_call_is_past_the_others_last_step_is_still_compared():
    # CI's case: raw stopped at step 90 (target reached), psctl-local's first applied
    # snapshot was at step 100 (50 steps a call). Each curve starts at step 0 at 0 s.
    raw = {
        "label": "raw@1",
        "curve": [[0.0, 0, 0.50, 0.7], [1.0, 30, 0.60, 0.6], [2.0, 90, 0.70, 0.5]],
    }
    ours = {"label": "psctl-local", "curve": [[0.0, 0, 0.50, 0.7], [1.0, 100, 0.72, 0.5]]}
    rows = [_row("raw@1", 2.0), _row("psctl-local", 1.0)]
    line = tta.equal_steps_line(rows, [raw, ours], "auc")
    assert line == "eval auc at step 90: raw@1 (best raw) 0.7000; psctl-local 0.6980 (-0.0020)"


def test_the_step_compared_is_the_fewest_any_run_reached():
    raw = {"label": "raw@1", "curve": [[0.0, 0, 0.5, 1.0], [1.0, 200, 0.9, 0.1]]}
    ours = {"label": "psctl", "curve": [[0.0, 0, 0.5, 1.0], [1.0, 100, 0.8, 0.2]]}
    line = tta.equal_steps_line([_row("raw@1", 1.0), _row("psctl", 1.0)], [raw, ours], "acc")
    assert re.fullmatch(
        r"eval acc at step 100: raw@1 \(best raw\) 0\.7000; psctl 0\.8000 \(\+0\.1000\)", line
    )


def test_no_mode_reaching_the_target_is_said_so():
    raw = {"label": "raw@1", "curve": [[0.0, 0, 0.5, 1.0]]}
    line = tta.equal_steps_line([_row("raw@1", 0.0)], [raw], "auc")
    assert line == "eval auc at the same step: n/a (a mode never reached the target)"


def _run(mode: str, rtt: str, steps_per_sec: float, optimizer: str = "adam") -> dict:
    return {
        "mode": mode,
        "rows": 1_000_000,
        "optimizer": optimizer,
        "rtt": rtt,
        "status": "budget",
        "steps_per_sec": steps_per_sec,
    }


def _args(rtts: list[str], optimizers: tuple[str, ...] = ("adam",)) -> argparse.Namespace:
    return argparse.Namespace(
        rtt_list=rtts, row_counts=[1_000_000], optimizer_list=list(optimizers), ps=2, workers=2
    )


def test_round_trips_per_step_are_the_slope_of_a_workers_step_time():
    # 2 workers: a worker's step takes 2/50 s at 0 ms, 2/40 s at 1 ms: 10 ms more, 10 trips.
    runs = [_run("psctl", "0 ms", 50.0), _run("psctl", "1 ms", 40.0), _run("local", "0 ms", 100)]
    rows = embeddings.summarize(runs, _args(["0 ms", "1 ms"]))
    assert [r["rtt"] for r in rows] == ["0 ms", "1 ms"]
    assert rows[0]["round_trips"] == {}
    assert abs(rows[1]["round_trips"]["psctl"] - 10.0) < 1e-9
    assert rows[1]["local"]["steps_per_sec"] == 100  # no network: shown in every row
    assert rows[1]["ratio_local"] == 0.4


def test_the_last_lines_name_the_network_and_come_raw_then_tf_keras():
    runs = [
        _run("psctl", "1 ms", 60.0),
        _run("raw", "1 ms", 6.0),
        _run("psctl", "1 ms", 50.0, "adagrad"),
        _run("tf_keras", "1 ms", 40.0, "adagrad"),
    ]
    rows = embeddings.summarize(runs, _args(["1 ms"], ("adam", "adagrad")))
    lines = embeddings.ratio_lines(rows)
    assert lines[-2:] == [
        "psctl/raw_keras steps/s at 1M rows (adam, rtt 1 ms) = 10.00",
        "psctl/tf_keras steps/s at 1M rows (adagrad, rtt 1 ms) = 1.25",
    ]


def test_repeats_show_the_median_run_and_every_repeats_ratio():
    tunnel = "1 ms" + embeddings.TUNNEL
    rates = [(60.0, 50.0), (62.0, 56.0), (58.0, 51.0)]  # open, tunnel; interleaved
    networks = ("1 ms", tunnel)
    runs = [
        _run("psctl", n, rate) for pair in rates for n, rate in zip(networks, pair, strict=True)
    ]
    runs[-1]["status"] = "failed"  # the third tunnel run: its ratio is n/a, the median of two
    rows = embeddings.summarize(runs, _args(["1 ms", tunnel]))
    assert [r["psctl"]["steps_per_sec"] for r in rows] == [60.0, 50.0]
    lines = embeddings.repeat_ratio_lines(runs, "tls")
    what = "hosts behind their tls tunnels/open (1 ms) at 1M rows (adam)"
    assert lines == [f"each repeat: psctl steps/s, {what} = 0.83, 0.90, n/a"]
    assert embeddings.namespace_lines(rows, "tls") == [
        f"psctl steps/s, {what} = 0.83 (50.0 / 60.0)"
    ]


def test_on_loopback_the_line_is_the_one_it_always_was():
    runs = [_run("psctl", "loopback", 60.0), _run("raw", "loopback", 30.0)]
    lines = embeddings.ratio_lines(embeddings.summarize(runs, _args(["loopback"])))
    assert lines == ["psctl/raw_keras steps/s at 1M rows (adam) = 2.00"]


def test_a_soak_fault_not_recovered_before_the_operators_stop_is_cut():
    """bench/soak.py: a fault whose first step after it is the restarted job's counts in no
    percentile (the restart's start-up is no recovery); one recovered before stays."""
    sampler = soak.Sampler()
    sampler.stop()
    # One training process (uptime growing) steps every second until t=100, the operator
    # stops it then; the restarted job (a new process: uptime from 0) steps from t=130.
    sampler.samples = [(t, 10 * t, "JOB_STATE_RUNNING", t) for t in range(1, 100)]
    sampler.samples += [(130 + t, 2000 + t, "JOB_STATE_RUNNING", 1 + t) for t in range(5)]
    early = soak.Fault(at=50, kind="kill-worker", injected=50.5)
    late = soak.Fault(at=99, kind="freeze", injected=95.0, released=99.5)
    after = soak.Fault(at=131, kind="kill-worker", injected=131.2)
    state = argparse.Namespace(sampler=sampler, restart=(100.0, 130.0), runs=[])
    soak.measure([early, late, after], state)  # type: ignore[arg-type]
    assert (early.recovery, early.cut) == (0.5, False)
    assert (late.recovery, late.cut) == (None, True)
    assert after.recovery is not None and after.recovery < 1.0 and not after.cut
    row = next(r for r in soak.table([early, late, after]) if r.startswith("freeze"))
    assert row.split()[-3:] == ["0", "1", "0"]  # no step, cut, redone


class _Prom:
    """Prometheus's query API as bench/soak.py calls it, over fixed answers."""

    def __init__(self, restarts: dict[str, int], fired: list[str]) -> None:
        self.restarts, self.fired = restarts, fired

    def api(self, path: str, *, query: str, time: str) -> dict:
        assert path == "query" and float(time) > 0
        if query.startswith("max_over_time(ALERTS"):
            return {"result": [{"metric": {"alertname": name}} for name in self.fired]}
        instance = re.search(r'instance="([^"]+)"', query)
        value = self.restarts.get(instance[1]) if instance else None
        return {"result": [] if value is None else [{"value": [0, str(value)]}]}


def test_a_soaks_prometheus_invariants():
    """Each run's psctl_restarts_total against its summary; PsctlRestartLoop must fire at 3
    restarts in a run, may at 3 new processes (resizes too), and no other alert may."""
    state = argparse.Namespace(
        coordinators=["a:1", "b:2"],
        summaries=[{"restarts": 1, "resizes": []}, {"restarts": 3, "resizes": []}],
    )

    def verdicts(restarts: dict[str, int], fired: list[str]) -> list[bool]:
        checks = soak.scraped(state, _Prom(restarts, fired), 1e9, 30)  # type: ignore[arg-type]
        return [held for _, held, _ in checks]

    assert verdicts({"a:1": 1, "b:2": 3}, ["PsctlRestartLoop"]) == [True, True]
    assert verdicts({"a:1": 1}, ["PsctlRestartLoop"]) == [False, True]  # a run unseen
    assert verdicts({"a:1": 1, "b:2": 3}, []) == [True, False]  # should have fired
    assert verdicts({"a:1": 1, "b:2": 3}, ["PsctlRestartLoop", "PsctlPsDown"]) == [True, False]
    state.summaries[1] = {"restarts": 1, "resizes": [{"reason": "psctl scale"}] * 2}
    assert verdicts({"a:1": 1, "b:2": 1}, ["PsctlRestartLoop"]) == [True, True]  # may
    assert verdicts({"a:1": 1, "b:2": 1}, []) == [True, True]


def test_the_untrained_model_never_reaches_the_target():
    """bench/tta.py: the curve's 0-s point (the model when the clock started) is for the
    equal-step comparison only; TTA starts with the first snapshot after it (CI: an
    untrained ctr model scored 0.554 against a 0.55 target, TTA 0.00 and then n/a)."""
    curve = [[0.0, 0, 0.554, 0.7], [1.0, 50, 0.54, 0.6], [2.0, 100, 0.61, 0.5]]
    assert tta.time_to_target(curve, 0.55) == 2.0
    assert tta.time_to_target(curve[:2], 0.55) is None
