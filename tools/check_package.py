"""Check the built package against the package index (`make package-check`; needs the index).

1. Build the wheel (with build isolation: the declared setuptools) and list it: only the
   `psctl` package and its dist-info, py.typed, the LICENSE.
2. The protobuf and grpcio floors in a fresh venv: the wheel's generated code imports with
   exactly the declared floors, and not with the protobuf release before the floor.
3. Resolution for aarch64 Linux (pip --dry-run): the wheel alone, and with `[tf]`.

tests/unit/test_packaging.py checks the same declarations offline; this one runs pip for
real. Exit 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
# TensorFlow 2.21's aarch64 wheel is tagged manylinux_2_27 (glibc >= 2.27); pip does not
# widen --platform, so name every tag an aarch64 host with a recent glibc accepts.
AARCH64 = ["manylinux_2_27_aarch64", "manylinux_2_17_aarch64", "manylinux2014_aarch64"]


def run(
    argv: list[str], *, check: bool = False, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    print("$", " ".join(argv), flush=True)
    return subprocess.run(argv, text=True, capture_output=True, check=check, env=env)


def floor(requirement: str) -> str:
    spec = Requirement(requirement).specifier
    return next(s.version for s in spec if s.operator == ">=")


def build(out: Path, *, isolated: bool) -> Path:
    argv = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(REPO), "-w", str(out)]
    proc = run(argv if isolated else [*argv, "--no-build-isolation"])
    if proc.returncode:
        sys.exit(f"wheel build failed:\n{proc.stderr}")
    [wheel] = out.glob("psctl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = sorted({n.split("/")[0] for n in names})
    print(f"  {wheel.name}: {len(names)} files; top level: {', '.join(tops)}")
    dist_info = next(t for t in tops if t.endswith(".dist-info"))
    ok = tops == ["psctl", dist_info]
    for path in ("psctl/py.typed", f"{dist_info}/licenses/LICENSE"):
        print(f"  {path}: {'yes' if path in names else 'MISSING'}")
        ok = ok and path in names
    if not ok:
        sys.exit("the wheel must hold exactly psctl, its dist-info, py.typed and the LICENSE")
    return wheel


def check_floors(wheel: Path, work: Path) -> bool:
    deps = {
        Requirement(d).name: d
        for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    }
    protobuf, grpcio = floor(deps["protobuf"]), floor(deps["grpcio"])
    venv, code = work / "venv", work / "code"
    zipfile.ZipFile(wheel).extractall(code)
    run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    env = {"PYTHONPATH": str(code), "PATH": "/usr/bin:/bin"}
    probe = "import psctl.control.v1.control_pb2, psctl.control.v1.control_pb2_grpc"
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    run([*pip, f"protobuf=={protobuf}", f"grpcio=={grpcio}"], check=True)
    at_floor = run([py, "-c", probe], env=env)
    verdict = "FAILED" if at_floor.returncode else "OK"
    print(f"  protobuf=={protobuf}, grpcio=={grpcio}: imports {verdict}")
    if at_floor.returncode:
        print(at_floor.stderr.strip().splitlines()[-1])
    # The release just below the floor must fail: the floor is not higher than it needs.
    run([*pip, f"protobuf<{protobuf},>={protobuf.split('.')[0]}"], check=True)
    below = run([py, "-c", f"import google.protobuf as p; print(p.__version__); {probe}"], env=env)
    refused = below.returncode != 0 and "VersionError" in below.stderr
    verdict = "refused" if refused else "NOT refused"
    print(f"  protobuf {below.stdout.strip()} (below the floor): {verdict}")
    return not at_floor.returncode and refused


def dry_run(wheel: Path, work: Path, spec: str, platforms: list[str]) -> bool:
    report = work / f"report-{len(platforms)}-{spec}.json"
    argv = [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed"]
    argv += [f"--platform={p}" for p in platforms]
    argv += ["--python-version", "3.11", "--only-binary=:all:", "--target", str(work / "t")]
    proc = run([*argv, "--report", str(report), f"{wheel}{spec}"])
    if proc.returncode:
        print("  " + proc.stderr.strip().splitlines()[-1])
        return False
    got = {
        i["metadata"]["name"].lower(): i["metadata"]["version"]
        for i in json.loads(report.read_text())["install"]
    }
    keys = ("tensorflow", "protobuf", "grpcio")
    print("  resolves: " + ", ".join(f"{k} {got[k]}" for k in keys if k in got))
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--no-build-isolation", action="store_true", help="build with this venv's setuptools"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="psctl-package-") as tmp:
        work = Path(tmp)
        print("1. the wheel")
        wheel = build(work / "dist", isolated=not args.no_build_isolation)
        print("2. the protobuf and grpcio floors in a fresh venv")
        results = {"floors": check_floors(wheel, work)}
        print("3. aarch64 Linux")
        results["aarch64 psctl"] = dry_run(wheel, work, "", ["manylinux2014_aarch64"])
        results["aarch64 psctl[tf]"] = dry_run(wheel, work, "[tf]", AARCH64)
    failed = [name for name, ok in results.items() if not ok]
    print("package check:", "FAILED: " + ", ".join(failed) if failed else "all passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
