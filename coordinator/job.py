"""The job API: what a user writes, how psctl loads it, and the DataContext it is given.

A job is a module (``--job my_pkg.my_job``), a file (``--job path/to/job.py``) or a built-in
name (``--job mlp``) that defines::

    create_model() -> keras.Model            # called under strategy.scope()
    create_optimizer() -> keras.optimizers.Optimizer
    loss_fn(labels, predictions) -> Tensor   # per-example losses
    dataset_fn(ctx: DataContext) -> tf.data.Dataset       # per worker, batched
    eval_dataset_fn(ctx: DataContext) -> tf.data.Dataset  # optional
    metrics = ["accuracy"]                   # optional
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from psctl.cluster.errors import ConfigError

if TYPE_CHECKING:
    from psctl.coordinator.settings import TrainSettings

REQUIRED = ("create_model", "create_optimizer", "loss_fn", "dataset_fn")
BUILTIN_PACKAGE = "psctl.jobs"


@dataclass(frozen=True)
class DataContext:
    """What a dataset function needs to read its own part of the data.

    ``worker_index`` is a scalar int64 tensor inside per-worker dataset functions (they are
    traced once for all workers), usable in ``shard``/``skip``/seeds; a plain int elsewhere
    (on the coordinator, for evaluation). ``num_workers`` is always a Python int, so is
    ``batch_size`` (per worker).
    """

    worker_index: Any
    num_workers: int
    batch_size: int
    seed: int
    # File inputs given on the command line (--train-data / --eval-data GLOB); "" = none,
    # and the job uses its own data.
    train_data: str = ""
    eval_data: str = ""
    label_column: str = "label"
    # --epochs: return ONE pass over the data (finite: no repeat; keep the last partial
    # batch; no sharding, the context says worker 0 of 1). psctl repeats it and the tf.data
    # service hands its pieces to the workers, so every example is read once per epoch.
    one_pass: bool = False

    @classmethod
    def from_settings(
        cls, settings: TrainSettings, *, worker_index: Any, num_workers: int, batch_size: int
    ) -> DataContext:
        """The context a run's settings give (seed, data files, label column)."""
        return cls(
            worker_index=worker_index,
            num_workers=num_workers,
            batch_size=batch_size,
            seed=settings.seed,
            train_data=settings.train_data,
            eval_data=settings.eval_data,
            label_column=settings.label_column,
        )


@dataclass(frozen=True)
class Job:
    name: str
    create_model: Callable[[], Any]
    create_optimizer: Callable[[], Any]
    loss_fn: Callable[[Any, Any], Any]
    dataset_fn: Callable[[DataContext], Any]
    eval_dataset_fn: Callable[[DataContext], Any] | None
    metrics: Sequence[Any]
    module: ModuleType


def _import_module(spec: str) -> ModuleType:
    looks_like_path = spec.endswith(".py") or "/" in spec or spec.startswith(".")
    if looks_like_path:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ConfigError("--job", f"no job file at {spec}", "give an existing .py file")
        mod_name = f"psctl_job_{path.stem}"
        file_spec = importlib.util.spec_from_file_location(mod_name, path)
        if file_spec is None or file_spec.loader is None:
            raise ConfigError("--job", f"cannot load {spec} as Python", "give a .py file")
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[mod_name] = module
        file_spec.loader.exec_module(module)
        return module
    candidates = [spec] if "." in spec else [f"{BUILTIN_PACKAGE}.{spec}", spec]
    for name in candidates:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name is not None and not name.startswith(err.name):
                raise  # the job exists but imports something missing: show the real problem
    builtins = ", ".join(builtin_jobs()) or "none"
    raise ConfigError(
        "--job",
        f"no job named {spec!r}",
        f"use a built-in job ({builtins}), a module path (my_pkg.my_job) or a file (job.py)",
    )


def builtin_jobs() -> list[str]:
    package = importlib.import_module(BUILTIN_PACKAGE)
    names = (info.name for info in pkgutil.iter_modules(package.__path__))
    return sorted(name for name in names if not name.startswith("_"))


def load_job(spec: str) -> Job:
    """Load and check a job; a missing function is a ConfigError naming it."""
    module = _import_module(spec)
    missing = [name for name in REQUIRED if not callable(getattr(module, name, None))]
    if missing:
        raise ConfigError(
            f"--job {spec}",
            f"does not define {', '.join(missing)}",
            f"add def {missing[0]}(...) to the job (see the job API in README)",
        )
    eval_fn = getattr(module, "eval_dataset_fn", None)
    if eval_fn is not None and not callable(eval_fn):
        raise ConfigError(f"--job {spec}", "eval_dataset_fn is not callable", "make it a function")
    metrics = getattr(module, "metrics", [])
    if isinstance(metrics, str) or not isinstance(metrics, Sequence):
        raise ConfigError(f"--job {spec}", "metrics must be a list", 'e.g. metrics = ["accuracy"]')
    return Job(
        name=spec,
        create_model=module.create_model,
        create_optimizer=module.create_optimizer,
        loss_fn=module.loss_fn,
        dataset_fn=module.dataset_fn,
        eval_dataset_fn=eval_fn,
        metrics=list(metrics),
        module=module,
    )
