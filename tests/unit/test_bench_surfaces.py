"""Benchmarks import psctl only through the surfaces docs/development.md lists ("What the
benchmarks may import"): a bench reaching for another internal module fails here, so that
the list stays the whole contract."""

from __future__ import annotations

import ast
import re

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(30)

SECTION = "### What the benchmarks may import"


def documented() -> set[str]:
    text = (REPO / "docs" / "development.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n#", 1)[0]
    return set(re.findall(r"`(psctl(?:\.[a-z0-9_]+)*)`", section))


def module_of(module: str, name: str) -> str:
    """``from MODULE import NAME``'s module: MODULE.NAME where that is a module of its own."""
    path = REPO.joinpath(*f"{module}.{name}".split("."))
    return f"{module}.{name}" if path.with_suffix(".py").exists() or path.is_dir() else module


def bench_imports() -> dict[str, list[str]]:
    """Every psctl module a bench file imports -> the files."""
    found: dict[str, list[str]] = {}
    for path in sorted((REPO / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            modules: list[str] = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("psctl"):
                modules = [module_of(node.module or "", a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names if a.name.startswith("psctl")]
            for module in modules:
                found.setdefault(module, []).append(str(path.relative_to(REPO)))
    return found


def test_every_bench_import_is_a_documented_surface():
    listed = documented()
    assert "psctl.hooks" in listed and "psctl.coordinator.training.trainer" in listed
    undocumented = {m: files for m, files in bench_imports().items() if m not in listed}
    assert not undocumented, (
        f"bench imports not in docs/development.md's '{SECTION[4:]}': {undocumented}"
    )


def test_the_list_names_only_modules_that_exist():
    missing = [m for m in documented() if module_of(*m.rsplit(".", 1)) != m]
    assert not missing, missing
