"""The part of TensorFlow a ps or worker server runs, without TensorFlow's public API.

A server is C++: its gRPC services and op kernels live in the library that any import of
TensorFlow loads. From Python it needs three names (Server, ClusterSpec, ConfigProto) and,
for a tf.data service worker, two more. ``import tensorflow`` costs 3.1 s of CPU (2.83 s user
+ 0.27 s sys here, with matplotlib kept out), nearly all of it Python modules a server never
calls: the public API's namespaces, autograph, Keras. The modules that define those names,
imported under a bare ``tensorflow`` package whose ``__init__`` is not run, cost 0.5-0.6 s:
a server is up 2.5 s sooner, at every start and every restart after a failure.

The bare package is used only where that ``__init__`` would add nothing a server needs: no
``tensorflow/core/kernels`` directory and no ``tensorflow-plugins`` (dynamic kernels and
pluggable devices, which it loads), no TF_PLUGGABLE_DEVICE_LIBRARY_PATH or
TF_USE_MODULAR_FILESYSTEM. Elsewhere, or if a TensorFlow release moves one of those modules,
the server imports TensorFlow whole, as before. Code in the process that reaches past the
bare package (``tf.anything`` after ``import tensorflow as tf``) gets the whole of TensorFlow,
imported at that moment.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import site
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerAPI:
    """The names a server calls: tf.distribute.Server, tf.train.ClusterSpec,
    tf.compat.v1.ConfigProto (the same objects, however they were imported). ``whole``:
    TensorFlow was imported whole."""

    Server: Any
    ClusterSpec: Any
    ConfigProto: Any
    whole: bool


@dataclass(frozen=True)
class DataWorkerAPI:
    """tf.data.experimental.service.WorkerServer and WorkerConfig."""

    WorkerServer: Any
    WorkerConfig: Any


@contextlib.contextmanager
def without_plotting() -> Iterator[None]:
    """Around a server's whole ``import tensorflow``: it loads Keras, which imports
    matplotlib.pyplot wherever matplotlib is installed (0.4-0.5 s of the 3.1 s of CPU the
    import costs, measured) for plots a server never draws. Keras does without it."""
    if "matplotlib" in sys.modules:
        yield
        return
    sys.modules["matplotlib"] = None  # type: ignore[assignment]  # import -> ImportError
    try:
        yield
    finally:
        if "matplotlib" in sys.modules and sys.modules["matplotlib"] is None:
            del sys.modules["matplotlib"]


def server_api() -> ServerAPI:
    """Server, ClusterSpec and ConfigProto, from the bare package where it is safe (above),
    else from TensorFlow imported whole."""
    if _bare_package():
        try:
            from tensorflow.core.protobuf import config_pb2
            from tensorflow.python import tf2
            from tensorflow.python.training import server_lib

            tf2.enable()  # what TensorFlow's __init__ tells its C++ side (enable_v2_behavior)
            names = (server_lib.Server, server_lib.ClusterSpec, config_pb2.ConfigProto)
            return ServerAPI(*names, whole=False)
        except (ImportError, AttributeError) as err:  # a release that moved them
            log.debug("TensorFlow's server modules moved (%s): importing it whole", err)
    tf = _whole()
    names = (tf.distribute.Server, tf.train.ClusterSpec, tf.compat.v1.ConfigProto)
    return ServerAPI(*names, whole=True)


def data_worker_api() -> DataWorkerAPI:
    """The tf.data service worker's two names, the same way as ``server_api``."""
    if _bare_package():
        try:
            from tensorflow.python.data.experimental.service import server_lib

            return DataWorkerAPI(server_lib.WorkerServer, server_lib.WorkerConfig)
        except (ImportError, AttributeError) as err:
            log.debug("tf.data service modules moved (%s): importing it whole", err)
    service = _whole().data.experimental.service
    return DataWorkerAPI(service.WorkerServer, service.WorkerConfig)


def _bare_package() -> bool:
    """Put a bare ``tensorflow`` package in sys.modules (its ``__init__`` not run) unless
    TensorFlow is already imported or its ``__init__`` would load kernels or plugins; True
    when ``tensorflow`` is that bare package."""
    current = sys.modules.get("tensorflow")
    if current is not None:
        return getattr(current, "__psctl_bare__", False)
    spec = importlib.util.find_spec("tensorflow")
    if spec is None or not spec.submodule_search_locations:
        return False
    locations = list(spec.submodule_search_locations)
    if _loads_plugins(locations):
        return False
    bare = types.ModuleType("tensorflow")
    bare.__path__ = locations
    bare.__spec__ = spec
    bare.__file__ = spec.origin
    bare.__psctl_bare__ = True  # type: ignore[attr-defined]
    bare.__getattr__ = _rest_of_tensorflow  # type: ignore[method-assign]
    sys.modules["tensorflow"] = bare
    return True


def _loads_plugins(locations: list[str]) -> bool:
    """Whether tensorflow/__init__.py (2.21) would load more than Python modules."""
    if os.environ.get("TF_PLUGGABLE_DEVICE_LIBRARY_PATH"):
        return True
    if os.environ.get("TF_USE_MODULAR_FILESYSTEM") in ("true", "1"):
        return True
    if any((Path(where) / "core" / "kernels").exists() for where in locations):
        return True
    dirs = {p for p in sys.path if "site-packages" in p}
    with contextlib.suppress(AttributeError):  # virtualenvs without site.getsitepackages
        dirs.update(site.getsitepackages())
    if site.ENABLE_USER_SITE and site.USER_SITE:
        dirs.add(site.USER_SITE)
    return any((Path(d) / "tensorflow-plugins").exists() for d in dirs)


def _rest_of_tensorflow(name: str) -> Any:
    """The bare package's ``__getattr__``: a name it lacks comes from TensorFlow imported
    whole (its ``__init__`` run now, the modules already imported reused)."""
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(_whole(), name)


def _whole() -> types.ModuleType:
    if getattr(sys.modules.get("tensorflow"), "__psctl_bare__", False):
        del sys.modules["tensorflow"]
    with without_plotting():
        return importlib.import_module("tensorflow")
