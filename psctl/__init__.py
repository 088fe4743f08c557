"""psctl: parameter-server training for TensorFlow 2.

One import namespace for everything the distribution installs; the repository keeps one
top-level folder per part (``coordinator/``, ``cluster/``, ``ps_server/``,
``worker_server/``, ``jobs/``, ``protos/``), linked in here.
"""

__version__ = "0.1.0"

import os as _os

# psctl forks only to exec a child (servers, training processes, tools). gRPC's fork
# support, on by default in this grpcio's core, runs a pre-fork handler that waits for gRPC's
# threads, one of which can be waiting for the GIL the forking thread holds: a hang for good
# (seen in the test suite, in subprocess's fork). Off unless the environment says otherwise;
# set before anything imports grpc, and inherited by every child.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
