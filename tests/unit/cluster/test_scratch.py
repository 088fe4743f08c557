"""The training process's private temporary directory (cluster/processes/scratch.py): where
autograph's files go, removed at its end; those of dead processes swept by the next."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from psctl.cluster.processes import scratch

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _restore_tempdir():
    before = tempfile.tempdir
    yield
    scratch.remove_private_tempdir()
    tempfile.tempdir = before


def test_tempfile_writes_into_the_private_directory_until_it_is_removed(tmp_path: Path):
    own = scratch.use_private_tempdir(str(tmp_path))
    assert own.parent == tmp_path and own.name.startswith(f"{scratch.PREFIX}{os.getpid()}-")
    with tempfile.NamedTemporaryFile(suffix=".py", delete=False) as made:
        pass
    assert Path(made.name).parent == own
    scratch.remove_private_tempdir()
    assert not own.exists() and list(tmp_path.iterdir()) == []


def test_the_directories_of_dead_processes_are_swept_and_live_ones_kept(tmp_path: Path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    gone = tmp_path / f"{scratch.PREFIX}{dead.stdout.strip()}-abc"
    (gone / "sub").mkdir(parents=True)
    (gone / "sub" / "__autograph_generated_file1.py").write_text("x = 1\n")
    alive = tmp_path / f"{scratch.PREFIX}{os.getpid()}-def"
    alive.mkdir()
    other = tmp_path / "not-psctl-1-x"
    other.mkdir()
    own = scratch.use_private_tempdir(str(tmp_path))
    assert not gone.exists()
    assert alive.is_dir() and other.is_dir() and own.is_dir()
