"""TensorFlow, which psctl's install leaves to an extra: one clear line when it is missing.

``tensorflow`` and ``tensorflow-cpu`` ship the same files, so psctl depends on neither and
names both as extras (docs/development.md#which-tensorflow).
"""

from __future__ import annotations

import importlib.util

from psctl.cluster.errors import ConfigError

EXTRAS = (
    "pip install 'psctl[cpu]' (x86_64 CPU), 'psctl[tf]' (aarch64, macOS) "
    "or 'psctl[gpu]' (NVIDIA GPUs)"
)


def require_tensorflow() -> None:
    """Raise ConfigError (exit 78) naming the extras if TensorFlow is not installed.

    Looks the package up without importing it (seconds), so it costs nothing when present.
    """
    if importlib.util.find_spec("tensorflow") is None:
        raise ConfigError("tensorflow", "is not installed", f"install it with psctl: {EXTRAS}")
