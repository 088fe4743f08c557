"""Job loading: built-in name, module path, file path, and clear errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from psctl.cluster.errors import ConfigError
from psctl.coordinator.job import load_job
from tests.conftest import REPO

GOOD = """
metrics = ["accuracy"]
def create_model(): return "model"
def create_optimizer(): return "opt"
def loss_fn(labels, predictions): return 0
def dataset_fn(ctx): return ctx
"""


def test_builtin_mlp_loads():
    job = load_job("mlp")
    assert job.metrics == ["accuracy"]
    assert job.eval_dataset_fn is not None


def test_job_file_loads(tmp_path: Path):
    path = tmp_path / "my_job.py"
    path.write_text(GOOD)
    job = load_job(str(path))
    assert job.loss_fn(1, 2) == 0
    assert job.eval_dataset_fn is None


@pytest.mark.timeout(60)
def test_what_a_jobs_functions_return_is_checked_in_one_line(tmp_path: Path):
    """A function returning what psctl cannot train on: one line naming it (exit 78), not
    an AttributeError or a TypeError from deep in Keras or TensorFlow (exit 1)."""
    import tensorflow as tf

    path = tmp_path / "my_job.py"
    path.write_text(GOOD)  # a str for a model, for an optimizer, a context for a dataset
    job = load_job(str(path))
    expected = [
        (job.create_model, "create_model() returned str ('model'), not a keras.Model"),
        (job.create_optimizer, "create_optimizer() returned str ('opt'), not a Keras optimizer"),
        (lambda: job.dataset_fn(None), "dataset_fn returned NoneType, not a tf.data.Dataset"),
    ]
    for call, problem in expected:
        with pytest.raises(ConfigError) as err:
            call()
        assert str(err.value).startswith(f"--job {path}: {problem}; "), err.value
    path.write_text(
        GOOD.replace("return ctx", "return __import__('tensorflow').data.Dataset.range(3)").replace(
            "return 0", "return None"
        )
    )
    job = load_job(str(path))
    with pytest.raises(ConfigError, match=r"dataset_fn's dataset yields TensorSpec\(shape=\(\)"):
        job.dataset_fn(None)
    with pytest.raises(ConfigError, match=r": loss_fn returned None; return the loss"):
        job.loss_fn(1, 2)
    pairs = tf.data.Dataset.range(3).map(lambda x: (x, x))
    path.write_text(
        GOOD.replace("def dataset_fn(ctx): return ctx", "def dataset_fn(ctx): return ctx")
    )
    assert load_job(str(path)).dataset_fn(pairs) is pairs  # (features, labels): passed on


def test_job_module_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "job_a.py").write_text(GOOD)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        job = load_job("userpkg.job_a")
        assert job.loss_fn(1, 2) == 0 and job.name == "userpkg.job_a"
    finally:
        sys.modules.pop("userpkg.job_a", None)
        sys.modules.pop("userpkg", None)


def test_missing_function_is_named(tmp_path: Path):
    path = tmp_path / "half_job.py"
    path.write_text(GOOD.replace("def dataset_fn(ctx): return ctx", ""))
    with pytest.raises(ConfigError) as err:
        load_job(str(path))
    assert "dataset_fn" in str(err.value)
    assert err.value.exit_status == 78
    assert "\n" not in str(err.value)


def test_unknown_job_lists_builtins():
    with pytest.raises(ConfigError) as err:
        load_job("surely_not_a_job")
    assert "no job named 'surely_not_a_job'" in str(err.value)
    assert "mlp" in str(err.value)


def test_missing_job_file():
    with pytest.raises(ConfigError, match="no job file at"):
        load_job("does/not/exist.py")


def test_job_importing_a_missing_module_shows_the_real_problem(tmp_path, monkeypatch):
    pkg = tmp_path / "brokenpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "job_b.py").write_text("import not_installed_dependency_xyz\n" + GOOD)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "file_job.py").write_text("import not_installed_dependency_xyz\n" + GOOD)
    for spec in ("brokenpkg.job_b", str(tmp_path / "file_job.py")):
        with pytest.raises(ConfigError) as err:
            load_job(spec)
        assert str(err.value).startswith(
            f"--job {spec}: imports 'not_installed_dependency_xyz', which is not installed"
        ), err.value


@pytest.mark.parametrize(
    ("code", "said"),
    [
        ("def broken(:\n", "SyntaxError in bad_job.py, line 1: invalid syntax: 'def broken(:'"),
        ("if True:\nx = 1\n", "IndentationError in bad_job.py, line 2: expected an indented"),
    ],
)
def test_a_job_that_does_not_compile_is_one_line_naming_the_line(tmp_path, code, said):
    path = tmp_path / "bad_job.py"
    path.write_text(code)
    with pytest.raises(ConfigError) as err:
        load_job(str(path))
    assert str(err.value).startswith(f"--job {path}: {said}"), err.value


def test_the_public_job_api_is_psctl_job_alone():
    """``psctl.job`` names everything a job needs, and the built-in jobs (which users copy)
    import nothing else of psctl's."""
    import ast

    import psctl.job

    for name in psctl.job.__all__:
        assert getattr(psctl.job, name) is not None, name
    for module in (psctl.job.data, psctl.job.criteo):
        assert all(hasattr(module, name) for name in module.__all__), module.__name__
    for path in sorted((REPO / "jobs").glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = [
            node.module if isinstance(node, ast.ImportFrom) else alias.name
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in node.names
        ]
        inner = [m for m in imported if m and m.startswith("psctl") and m != "psctl.job"]
        assert not inner, f"{path.name} imports {inner}"
