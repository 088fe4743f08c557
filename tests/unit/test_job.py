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
    assert job.create_model() == "model"
    assert job.eval_dataset_fn is None


def test_job_module_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "job_a.py").write_text(GOOD)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        job = load_job("userpkg.job_a")
        assert job.create_optimizer() == "opt"
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
