"""A server imports TensorFlow without matplotlib (Keras loads pyplot where installed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

PROBE = """
import sys
from psctl.cluster.server import without_plotting
with without_plotting():
    try:
        import matplotlib.pyplot
    except ImportError:
        print("blocked")
import matplotlib  # left importable after the server's import
print("after:", matplotlib.__name__)
"""


def test_matplotlib_is_kept_out_of_a_servers_tensorflow_import_only():
    # matplotlib is in the test extra (bench/tta.py plots), as in many ML environments.
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=50, check=True
    ).stdout
    assert out.splitlines() == ["blocked", "after: matplotlib"], out
