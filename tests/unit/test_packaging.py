"""The package: what pyproject.toml declares, and what the built wheel holds (no network).

tools/check_package.py does the checks that need the package index (the protobuf floor
in a fresh venv, the aarch64 resolution): `make package-check`.
"""

from __future__ import annotations

import ast
import email.parser
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.conftest import REPO, child_env

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
TF_EXTRAS = {"cpu": "tensorflow-cpu", "tf": "tensorflow", "gpu": "tensorflow"}


def requirements(items: list[str]) -> dict[str, Requirement]:
    reqs = [Requirement(item) for item in items]
    return {req.name.lower(): req for req in reqs}


def gencode_versions() -> dict[str, Version]:
    """The protobuf version each generated module demands (its import-time check)."""
    out = {}
    for path in sorted((REPO / "protos").rglob("*_pb2.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "ValidateProtobufRuntimeVersion"
            ):
                major, minor, patch, suffix = (ast.literal_eval(a) for a in node.args[1:5])
                out[str(path.relative_to(REPO))] = Version(f"{major}.{minor}.{patch}{suffix}")
    return out


def test_protobuf_floor_is_what_the_generated_code_checks():
    versions = gencode_versions()
    assert "protos/psctl/control/v1/control_pb2.py" in versions
    protobuf = requirements(PROJECT["dependencies"])["protobuf"]
    floors = [Version(s.version) for s in protobuf.specifier if s.operator == ">="]
    assert floors == [max(versions.values())], (
        f"protobuf floor {floors} != generated code's {versions}: regenerated with a newer "
        "protoc? raise the floor in pyproject.toml"
    )
    floor = floors[0]
    assert floor in protobuf.specifier
    assert Version(f"{floor.major + 1}") not in protobuf.specifier  # a new major may break it


def test_grpcio_floor_is_what_the_generated_stubs_check():
    generated = {
        str(path.relative_to(REPO)): Version(m[1])
        for path in sorted((REPO / "protos").rglob("*_pb2_grpc.py"))
        if (m := re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'", path.read_text(), re.M))
    }
    assert "protos/psctl/control/v1/control_pb2_grpc.py" in generated
    grpcio = requirements(PROJECT["dependencies"])["grpcio"]
    floors = [Version(s.version) for s in grpcio.specifier if s.operator == ">="]
    assert floors == [max(generated.values())], (floors, generated)


def test_protobuf_range_is_inside_tensorflows():
    for dist in ("tensorflow-cpu", "tensorflow"):
        try:
            tf_requires = metadata.requires(dist) or []
            break
        except metadata.PackageNotFoundError:
            continue
    else:
        pytest.skip("no TensorFlow installed")
    ours = requirements(PROJECT["dependencies"])["protobuf"].specifier
    theirs = next(r for r in map(Requirement, tf_requires) if r.name == "protobuf").specifier
    floor = next(Version(s.version) for s in ours if s.operator == ">=")
    assert floor in theirs
    caps = [Version(s.version) for s in ours if s.operator == "<"]
    assert caps and all(
        cap <= Version(s.version) for cap in caps for s in theirs if s.operator == "<"
    )


def test_runtime_needs_neither_the_generator_nor_a_tensorflow_wheel():
    runtime = requirements(PROJECT["dependencies"])
    assert not {"grpcio-tools", "tensorflow", "tensorflow-cpu"} & set(runtime)
    extras = {name: requirements(items) for name, items in PROJECT["optional-dependencies"].items()}
    assert set(extras["dev"]) == {"grpcio-tools"}
    # One grpc release line for the runtime, and the generator pinned to its floor: the
    # stubs demand the generator's version of grpcio at import, and the drift test compares
    # them byte for byte (a newer generator on a fresh install failed it).
    grpc = {str(r.specifier) for n, r in runtime.items() if "grpcio" in n}
    assert len(grpc) == 1, grpc
    floor = [s.version for s in runtime["grpcio"].specifier if s.operator == ">="]
    assert str(extras["dev"]["grpcio-tools"].specifier) == f"=={floor[0]}", extras["dev"]
    specs = set()
    for extra, dist in TF_EXTRAS.items():
        assert set(extras[extra]) == {dist}, extra
        specs.add(str(extras[extra][dist].specifier))
    assert extras["gpu"]["tensorflow"].extras == {"and-cuda"}
    assert len(specs) == 1, f"the TensorFlow extras must pin the same release line: {specs}"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_installed_code_does_not_import_the_generator():
    checked = 0
    for root, _dirs, files in os.walk(REPO / "psctl", followlinks=True):
        for name in files:
            if name.endswith(".py"):
                assert "grpc_tools" not in _imports(Path(root) / name), Path(root) / name
                checked += 1
    assert checked > 50


def test_license_and_build_backend():
    assert PROJECT["license"] == "Apache-2.0"  # an SPDX expression (PEP 639)
    assert PROJECT["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    setuptools = requirements(PYPROJECT["build-system"]["requires"])["setuptools"]
    # setuptools reads the SPDX string and license-files from 77 on.
    assert Version("76.1") not in setuptools.specifier and Version("77") in setuptools.specifier
    assert (REPO / "psctl" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["psctl"]


def test_tool_targets_match_requires_python():
    oldest = re.fullmatch(r">=\s*3\.(\d+)", PROJECT["requires-python"])
    assert oldest, PROJECT["requires-python"]
    tool = PYPROJECT["tool"]
    assert tool["mypy"]["python_version"] == f"3.{oldest[1]}"
    assert tool["ruff"]["target-version"] == f"py3{oldest[1]}"


def test_markers_are_strict_and_declared():
    pytest_ini = PYPROJECT["tool"]["pytest"]["ini_options"]
    assert "--strict-markers" in pytest_ini["addopts"].split()
    declared = {m.split(":")[0].strip() for m in pytest_ini["markers"]}
    builtin = {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings"}
    builtin.add("timeout")  # pytest-timeout's
    used = set()
    for path in (REPO / "tests").rglob("*.py"):
        used.update(re.findall(r"pytest\.mark\.(\w+)", path.read_text()))
    assert used - builtin <= declared, used - builtin - declared


def test_makefile_installs_the_cpu_wheel_and_the_dev_tools():
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^TF_EXTRA \?= cpu$", makefile, re.M)
    assert "-e '.[$(TF_EXTRA),dev,test]'" in makefile
    assert {"cpu", "dev", "test"} <= set(PROJECT["optional-dependencies"])


def _source_copy(dest: Path) -> Path:
    """What the wheel is built from: pyproject, README, LICENSE, psctl/ and its links'
    targets (built apart from the checkout: setuptools writes build/ beside the sources)."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, dest / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "psctl", dest / "psctl", symlinks=True, ignore=ignore)
    tops = {
        (link.resolve().relative_to(REPO)).parts[0]
        for link in (REPO / "psctl").iterdir()
        if link.is_symlink()
    }
    for top in sorted(tops):
        shutil.copytree(REPO / top, dest / top, symlinks=True, ignore=ignore)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    base = tmp_path_factory.mktemp("wheel")
    src = _source_copy(base / "src")
    out = base / "dist"
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    proc = subprocess.run(
        [*pip_wheel, str(src), "-w", str(out)],
        capture_output=True,
        text=True,
        timeout=170,
        env=child_env(PIP_NO_INPUT="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [built] = out.glob("psctl-*.whl")
    return zipfile.ZipFile(built)


def _metadata(wheel: zipfile.ZipFile) -> Any:
    [name] = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return email.parser.Parser().parsestr(wheel.read(name).decode())


@pytest.mark.timeout(180)
def test_wheel_holds_only_psctl(wheel: zipfile.ZipFile):
    names = wheel.namelist()
    dist_info = f"psctl-{PROJECT['version']}.dist-info"
    assert {n.split("/")[0] for n in names} == {"psctl", dist_info}
    for path in (
        "psctl/py.typed",
        "psctl/job.py",
        "psctl/coordinator/cli/main.py",
        "psctl/coordinator/deploy/templates/server.service.in",
        "psctl/control/v1/control_pb2.py",
        "psctl/control/v1/control.proto",
        "psctl/jobs/mlp.py",
        f"{dist_info}/licenses/LICENSE",
    ):
        assert path in names, path
    assert not [n for n in names if "generate.py" in n or "/tests/" in n]


@pytest.mark.timeout(180)
def test_wheel_metadata(wheel: zipfile.ZipFile):
    meta = _metadata(wheel)
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    unconditional = [
        Requirement(r).name
        for r in meta.get_all("Requires-Dist")
        if "extra ==" not in (str(Requirement(r).marker) if Requirement(r).marker else "")
    ]
    assert "protobuf" in unconditional
    assert not {"grpcio-tools", "tensorflow", "tensorflow-cpu"} & set(unconditional)
    assert {"cpu", "tf", "gpu", "dev", "test"} <= set(meta.get_all("Provides-Extra"))


# Without TensorFlow: what `pip install psctl` (no extra) leaves behind.
_NO_TF = "import sys; sys.modules['tensorflow'] = None  # import tensorflow fails\n"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("code", "prefix"),
    [
        (
            "from psctl.coordinator.cli.main import main\n"
            "sys.exit(main(['local', '--control-address', '127.0.0.1:0',"
            " '--workdir', sys.argv[1]]))",
            "psctl: error: ",
        ),
        ("from psctl.cluster import server\nserver.main('ps', [])", "ps-server: error: "),
    ],
    ids=["psctl-local", "ps-server"],
)
def test_missing_tensorflow_is_one_line_naming_the_extras(tmp_path: Path, code: str, prefix: str):
    proc = subprocess.run(
        [sys.executable, "-c", _NO_TF + code, str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=50,
        env=child_env(),
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 78, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(prefix + "tensorflow: is not installed; ")
    for extra in TF_EXTRAS:
        assert f"'psctl[{extra}]'" in lines[0]
