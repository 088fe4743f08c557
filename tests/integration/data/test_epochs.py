"""``--epochs``: every example exactly once per epoch through the tf.data service, on real
clusters (psctl local), proven by the visitation job's per-id counter on the ps; and
``--eval-every``: every eval example once per distributed evaluation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, local_argv, processes_mentioning, read_json, run_python

pytestmark = pytest.mark.integration

VISIT_JOB = str(REPO / "tests" / "jobs" / "visit.py")


def checkpoint_tensor(directory: Path, suffix: str) -> list[float]:
    """The newest checkpoint's variable whose name ends with ``suffix``, read by TensorFlow in
    a separate process (keeps this process free of TensorFlow)."""
    code = (
        "import sys, json, tensorflow as tf\n"
        "reader = tf.train.load_checkpoint(sys.argv[1])\n"
        "names = [n for n in reader.get_variable_to_shape_map() if n.endswith(sys.argv[2])]\n"
        "print(json.dumps(reader.get_tensor(names[0]).tolist()))\n"
    )
    stdout = run_python(code, str(directory), suffix)
    return json.loads(stdout.splitlines()[-1])


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("workers", "epochs"), [(2, 2), (3, 1)])
def test_every_id_exactly_once_per_epoch_and_per_eval(workdir, run_cli, workers, epochs):
    out = workdir / "summary.json"
    argv = local_argv(
        workdir,
        "--workers",
        str(workers),
        "--job",
        VISIT_JOB,
        "--epochs",
        str(epochs),
        "--batch-size",
        "8",  # 1001 ids: every worker's last batch of an epoch is partial
        "--steps-per-execution",
        "7",
        "--eval-every",
        "60",
        "--eval-batch-size",
        "50",
        "--summary-json",
        str(out),
    )
    proc = run_cli(argv, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    visits = checkpoint_tensor(workdir / "checkpoints", "model/visits/.ATTRIBUTES/VARIABLE_VALUE")
    assert len(visits) == 1001
    wrong = {i: v for i, v in enumerate(visits) if v != epochs}
    assert not wrong, f"ids not visited exactly {epochs} time(s): {dict(list(wrong.items())[:20])}"
    summary = read_json(out)
    assert summary["stopped_early"] is False
    for index in range(workers):
        assert f"worker {index}: end of the data" in proc.stderr
    assert f"{epochs * 1001} examples" in proc.stderr
    assert "UserWarning" not in proc.stderr  # TensorFlow's, from the service's distribute()
    # Inline evaluations: S shards on the workers, every eval id once each time (the mean
    # of id / 1001 over all ids is 0.4995; a repeated or missing id changes the count).
    evals = [line for line in proc.stderr.splitlines() if "shards on the workers" in line]
    assert evals, proc.stderr[-3000:]
    for line in evals:
        assert "| 1001 examples in" in line and f"({workers} shards" in line, line
        assert "label_mean: 0.4995" in line, line
    assert processes_mentioning(str(workdir)) == []
