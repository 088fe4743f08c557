"""The `gpu` extra on a machine without a GPU: it resolves, and the CPU path runs.

`psctl[gpu]` is `tensorflow[and-cuda]` (pyproject.toml): TensorFlow 2.21 with NVIDIA's CUDA
libraries from pip, gigabytes of wheels. The first test resolves `.[gpu]` against PyPI
with `pip install --dry-run --ignore-installed --report` and checks the report, without
downloading those wheels: where the index serves PEP 658 metadata (pypi.org) pip reads
that, and where it does not (some mirrors) `--use-feature=fast-deps` reads each wheel's
METADATA with HTTP range requests; since pip 25.3 a dry run then downloads no wheel at all
(pypa/pip#13482; older pips fetch every wheel after resolving, about 3.5 GB here). So the
test runs a pip of at least 25.3 from its wheel (about 2 MB), whatever pip the venv has,
and asserts that its log shows no wheel downloaded. It skips only when PyPI cannot be
reached. The second test runs `psctl local` with `CUDA_VISIBLE_DEVICES=""`, as on a host
with no GPU, on the TensorFlow installed here.
"""

from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO, child_env, local_argv, processes_mentioning, read_json

pytestmark = pytest.mark.integration

INDEX = "https://pypi.org/simple"
# The first pip whose `install --dry-run` downloads no wheel it has metadata for.
PIP = "pip>=25.3,<27"
# What `tensorflow[and-cuda]` 2.21 brings at least (its METADATA lists more).
CUDA_CORE = {"nvidia-cublas-cu12", "nvidia-cuda-runtime-cu12", "nvidia-cudnn-cu12"}
# pip settings that only say how to connect, kept from this environment; every other PIP_*
# variable and every pip configuration file is left out (they may name other indexes,
# local wheel directories or constraints).
PIP_TRANSPORT = ("PIP_CERT", "PIP_CLIENT_CERT", "PIP_PROXY", "PIP_DEFAULT_TIMEOUT")


def pip_env() -> dict[str, str]:
    env = {k: v for k, v in child_env().items() if not k.startswith("PIP_")}
    env.update({k: os.environ[k] for k in PIP_TRANSPORT if k in os.environ})
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def pypi_unreachable() -> str | None:
    """Why PyPI's simple index cannot be reached from here, or None when it answers. Only a
    failure to connect counts: an HTTP error status is an answer (the test then fails)."""
    cafile = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
    context = ssl.create_default_context(cafile=cafile)
    request = urllib.request.Request(f"{INDEX}/pip/", headers={"Accept": "text/html"})
    try:
        with urllib.request.urlopen(request, timeout=15, context=context) as response:
            response.read(1)
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError) as err:
        return f"{type(err).__name__}: {getattr(err, 'reason', err)}"
    return None


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def and_cuda_requirements(metadata: dict) -> set[str]:
    """The names of what tensorflow's METADATA requires for its `and-cuda` extra."""
    names = set()
    for requirement in metadata.get("requires_dist", []):
        name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
        if name and re.search(r"""extra\s*==\s*["']and-cuda["']""", requirement):
            names.add(normalized(name[0]))
    return names


@pytest.mark.timeout(300)
def test_gpu_extra_resolves_from_pypi_without_downloading_wheels(tmp_path: Path):
    reason = pypi_unreachable()
    if reason is not None:
        pytest.skip(f"PyPI ({INDEX}) is unreachable from this machine ({reason})")
    env = pip_env()
    started = time.monotonic()
    fetch = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"),
            *("--index-url", INDEX, "--dest", str(tmp_path / "pip"), PIP),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert fetch.returncode == 0, fetch.stdout + fetch.stderr
    (wheel,) = (tmp_path / "pip").glob("pip-*.whl")
    report = tmp_path / "report.json"
    resolve = subprocess.run(
        # pip runs from its own wheel; under this venv's Python, so that the markers are
        # this machine's and --no-build-isolation finds setuptools for psctl's metadata.
        [
            *(sys.executable, f"{wheel}/pip", "install", "--dry-run", "--ignore-installed"),
            *("--no-build-isolation", "--no-cache-dir", "--use-feature=fast-deps", "--verbose"),
            *("--index-url", INDEX, "--report", str(report), ".[gpu]"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
    )
    seconds = time.monotonic() - started
    log = resolve.stdout + resolve.stderr
    assert resolve.returncode == 0, log[-5000:]
    print(f"{wheel.name}: .[gpu] resolved in {seconds:.1f}s")
    # Metadata only: a `.whl.metadata` file or range requests, never a whole wheel.
    downloaded = re.findall(r"Downloading (\S+\.whl)(?:\s|$)", log, re.M)
    assert downloaded == [], f"the dry run downloaded wheels: {downloaded}"

    installs = json.loads(report.read_text())["install"]
    found = {normalized(i["metadata"]["name"]): i for i in installs}
    assert found["psctl"]["requested_extras"] == ["gpu"], found["psctl"]
    tensorflow = found["tensorflow"]["metadata"]
    assert tensorflow["version"].startswith("2.21."), tensorflow["version"]
    # The GPU build itself, never the CPU-only wheel beside it (they share tensorflow/).
    assert "tensorflow-cpu" not in found, sorted(found)
    cuda = and_cuda_requirements(tensorflow)
    assert cuda >= CUDA_CORE, sorted(cuda)
    assert all(name.startswith("nvidia-") for name in cuda), sorted(cuda)
    missing = cuda - set(found)
    assert not missing, f"tensorflow[and-cuda] needs {sorted(missing)}, not in {sorted(found)}"
    print(
        "CUDA packages:", ", ".join(f"{n} {found[n]['metadata']['version']}" for n in sorted(cuda))
    )


@pytest.mark.timeout(180)
def test_psctl_local_trains_on_the_cpu_with_no_gpu_visible(workdir: Path, run_cli):
    """What a `psctl[gpu]` install does on a host without a GPU: TensorFlow finds none and
    psctl trains on the CPU (here on the venv's TensorFlow, with every GPU hidden)."""
    out = workdir / "out.json"
    proc = run_cli(
        local_argv(workdir, "--steps", "20", "--log-every", "2", "--summary-json", str(out)),
        timeout=150,
        env=child_env(CUDA_VISIBLE_DEVICES=""),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_json(out)
    assert summary["global_step"] == 20, summary
    assert summary["num_workers"] == 2 and summary["num_ps"] == 1, summary
    assert processes_mentioning(str(workdir)) == []
