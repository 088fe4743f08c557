"""psctl: parameter-server training for TensorFlow 2.

One import namespace for everything the distribution installs; the repository keeps one
top-level folder per part (``coordinator/``, ``cluster/``, ``ps_server/``,
``worker_server/``, ``jobs/``, ``protos/``), linked in here.
"""

__version__ = "0.1.0"
