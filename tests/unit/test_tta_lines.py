"""bench/tta.py's equal-step comparison: pure logic over recorded curves."""

from __future__ import annotations

import re

from bench import tta


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
