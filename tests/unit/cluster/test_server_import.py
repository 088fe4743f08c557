"""How a server imports TensorFlow (cluster/tf_runtime.py): its server's few modules under a
bare package, not the public API (0.5-0.6 s of CPU instead of 3.1 s); TensorFlow whole where
its ``__init__`` would load plugins, and for anything reaching past the bare package; and
never matplotlib (Keras loads pyplot where installed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def _run(probe: str, *args: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


BARE = """
import socket, sys
from psctl.cluster.tf_runtime import data_worker_api, server_api
api = server_api()
data = data_worker_api()
print("whole:", api.whole)
api_modules = ("keras", "tensorflow._api.v2", "matplotlib")
print("api modules:", sorted(m for m in api_modules if m in sys.modules))
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
server = api.Server(
    api.ClusterSpec({"worker": [f"127.0.0.1:{port}"]}),
    job_name="worker", task_index=0, protocol="grpc",
    config=api.ConfigProto(inter_op_parallelism_threads=16), start=True,
)
print("target:", server.target == f"grpc://127.0.0.1:{port}")
import tensorflow as tf  # the bare package: tf.<name> imports the rest
print("same:", tf.distribute.Server is api.Server, tf.train.ClusterSpec is api.ClusterSpec,
      tf.compat.v1.ConfigProto is api.ConfigProto,
      tf.data.experimental.service.WorkerServer is data.WorkerServer,
      tf.data.experimental.service.WorkerConfig is data.WorkerConfig)
tf.config.experimental_connect_to_cluster(api.ClusterSpec({"worker": [f"127.0.0.1:{port}"]}))
with tf.device("/job:worker/replica:0/task:0/device:CPU:0"):
    print("ran on it:", int(tf.reduce_sum(tf.range(10))))
"""


def test_a_server_imports_only_its_modules_and_serves_ops():
    assert _run(BARE) == [
        "whole: False",
        "api modules: []",
        "target: True",
        "same: True True True True True",
        "ran on it: 45",
    ]


PLUGINS = """
import sys, pathlib
site = pathlib.Path(sys.argv[1]) / "site-packages"
(site / "tensorflow-plugins").mkdir(parents=True)
sys.path.append(str(site))
from psctl.cluster.tf_runtime import server_api
api = server_api()
import tensorflow as tf
print("whole:", api.whole, api.Server is tf.distribute.Server)
print("matplotlib:", "matplotlib.pyplot" in sys.modules)
"""


def test_tensorflow_plugins_get_tensorflow_imported_whole_without_matplotlib(tmp_path):
    # matplotlib is in the test extra (bench/tta.py plots), as in many ML environments.
    assert _run(PLUGINS, str(tmp_path)) == ["whole: True True", "matplotlib: False"]


PLOTTING = """
from psctl.cluster.tf_runtime import without_plotting
with without_plotting():
    try:
        import matplotlib.pyplot
    except ImportError:
        print("blocked")
import matplotlib  # left importable after the server's import
print("after:", matplotlib.__name__)
"""


def test_matplotlib_is_kept_out_of_a_servers_tensorflow_import_only():
    assert _run(PLOTTING) == ["blocked", "after: matplotlib"]
