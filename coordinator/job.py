"""The job API: what a user writes, how psctl loads it, and the DataContext it is given.

A job is a module (``--job my_pkg.my_job``), a file (``--job path/to/job.py``) or a built-in
name (``--job mlp``) that defines::

    create_model() -> keras.Model            # called under strategy.scope()
    create_optimizer() -> keras.optimizers.Optimizer
    loss_fn(labels, predictions) -> Tensor   # per-example losses
    dataset_fn(ctx: DataContext) -> tf.data.Dataset       # per worker, batched
    eval_dataset_fn(ctx: DataContext) -> tf.data.Dataset  # optional
    metrics = ["accuracy"]                   # optional

``create_optimizer``, ``loss_fn`` and ``metrics`` may instead come from ``create_model()``
returning a compiled model (``model.compile(optimizer=..., loss=..., metrics=...)``), as in
TensorFlow's multi-worker tutorial; what the job defines itself wins.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import pkgutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from psctl.cluster.errors import ConfigError, echo
from psctl.coordinator.data.context import DataContext

if TYPE_CHECKING:
    from psctl.coordinator.settings import TrainSettings

REQUIRED = ("create_model", "dataset_fn")
# What a compiled model can give instead (its compile() arguments).
FROM_COMPILE = ("create_optimizer", "loss_fn")
# Optional, together: the served model's raw inputs and their features (docs/serving.md).
SERVING = ("serving_inputs", "serving_features")
BUILTIN_PACKAGE = "psctl.jobs"


# tf.data.INFINITE_CARDINALITY, without importing TensorFlow here.
INFINITE_CARDINALITY = -1


@dataclass(frozen=True)
class Job:
    name: str
    create_model: Callable[[], Any]
    create_optimizer: Callable[[], Any]
    loss_fn: Callable[[Any, Any], Any]
    dataset_fn: Callable[[DataContext], Any]
    eval_dataset_fn: Callable[[DataContext], Any] | None
    metrics: Sequence[Any] | Mapping[str, Any]  # a dict: per output, by name
    module: ModuleType
    # Optional, for `psctl export`: the raw request the served model takes
    # (``serving_inputs()``: named TensorSpecs) and how it becomes the model's features
    # inside the graph (``serving_features(inputs)``), e.g. the hashing a file reader does.
    serving_inputs: Callable[[], Any] | None = None
    serving_features: Callable[[Any], Any] | None = None

    def eval_dataset(self, ctx: DataContext) -> Any:
        """``eval_dataset_fn(ctx)``, refused in one line when it never ends: the eval split
        is read exactly once, so an endless one (``.repeat()`` copied from ``dataset_fn``)
        would hang every evaluation, the final one of a stopping job included."""
        assert self.eval_dataset_fn is not None
        dataset = self.eval_dataset_fn(ctx)
        if int(dataset.cardinality()) == INFINITE_CARDINALITY:
            raise ConfigError(
                f"--job {self.name}",
                "eval_dataset_fn returns an endless dataset (repeat() without a count?)",
                "return one pass over the eval split: drop repeat() from eval_dataset_fn",
            )
        return dataset

    def whole_eval_split(self, settings: TrainSettings) -> Any:
        """The eval split as one reader reads it whole (worker 0 of 1, batches of
        --eval-batch-size): what the final and the sidecar evaluations read."""
        return self.eval_dataset(
            DataContext.from_settings(
                settings,
                worker_index=0,
                num_workers=1,
                batch_size=settings.evaluation.eval_batch_size,
            )
        )


def _job_file(spec: str) -> Path | None:
    """The file a path-like ``--job`` names (a ConfigError if there is none); None for a
    module name."""
    if not (spec.endswith(".py") or "/" in spec or spec.startswith(".")):
        return None
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError("--job", f"no job file at {spec}", "give an existing .py file")
    return path


def _module_names(spec: str) -> list[str]:
    return [spec] if "." in spec else [f"{BUILTIN_PACKAGE}.{spec}", spec]


def _no_job_named(spec: str) -> ConfigError:
    builtins = ", ".join(builtin_jobs()) or "none"
    return ConfigError(
        "--job",
        f"no job named {spec!r}",
        f"use a built-in job ({builtins}), a module on PYTHONPATH (my_pkg.my_job) "
        "or a file (job.py)",
    )


def check_job_found(spec: str) -> None:
    """Before anything waits on servers: a ``--job`` that names no file and no module is one
    line now (exit 78), not after --connect-timeout (nothing is imported here)."""
    if _job_file(spec) is not None:
        return
    for name in _module_names(spec):
        try:
            if importlib.util.find_spec(name) is not None:
                return
        except (ImportError, ValueError):  # a parent package missing: not this one
            continue
    raise _no_job_named(spec)


def _import_module(spec: str) -> ModuleType:
    path = _job_file(spec)
    if path is not None:
        mod_name = f"psctl_job_{path.stem}"
        file_spec = importlib.util.spec_from_file_location(mod_name, path)
        if file_spec is None or file_spec.loader is None:
            raise ConfigError("--job", f"cannot load {spec} as Python", "give a .py file")
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[mod_name] = module
        try:
            file_spec.loader.exec_module(module)
        except (SyntaxError, ModuleNotFoundError) as err:
            raise _import_error(spec, err) from None
        return module
    for name in _module_names(spec):
        try:
            return importlib.import_module(name)
        except SyntaxError as err:
            raise _import_error(spec, err) from None
        except ModuleNotFoundError as err:
            if err.name is not None and not name.startswith(err.name):
                # The job exists but imports something missing: name that.
                raise _import_error(spec, err) from None
    raise _no_job_named(spec)


def _import_error(spec: str, err: SyntaxError | ModuleNotFoundError) -> ConfigError:
    """The job's code cannot be imported: one line (exit 78), as a restart cannot help."""
    if isinstance(err, ModuleNotFoundError):
        return ConfigError(
            f"--job {spec}",
            f"imports {err.name!r}, which is not installed for {sys.executable}",
            "install it in psctl's environment, or correct the import",
        )
    where = f"{Path(err.filename).name}, line {err.lineno}" if err.filename else "the job"
    code = f": {echo(err.text.strip())}" if err.text and err.text.strip() else ""
    return ConfigError(
        f"--job {spec}",
        f"{type(err).__name__} in {where}: {err.msg}{code}",
        "correct the job's code (python -m py_compile FILE shows the same)",
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
            f"does not define {', '.join(missing)}{misspelt(module, missing)}",
            f"add def {missing[0]}(...) to the job (see the job API in README)",
        )
    eval_fn = getattr(module, "eval_dataset_fn", None)
    if eval_fn is not None and not callable(eval_fn):
        raise ConfigError(f"--job {spec}", "eval_dataset_fn is not callable", "make it a function")
    metrics = getattr(module, "metrics", None)
    if isinstance(metrics, Mapping):  # per output of a multi-output model: {name: metrics}
        metrics = dict(metrics)
    elif metrics is not None:
        if isinstance(metrics, str) or not isinstance(metrics, Sequence):
            raise ConfigError(
                f"--job {spec}",
                "metrics must be a list (or a dict by output name)",
                'e.g. metrics = ["accuracy"]',
            )
        metrics = list(metrics)
    serving = {name: getattr(module, name, None) for name in SERVING}
    given_serving = [name for name, fn in serving.items() if fn is not None]
    incomplete = len(given_serving) < len(SERVING) or not all(map(callable, serving.values()))
    if given_serving and incomplete:
        raise ConfigError(
            f"--job {spec}",
            "defines " + " and ".join(given_serving) + ", but the export needs both "
            "serving_inputs() and serving_features(inputs) as functions",
            "define both (see docs/serving.md), or neither",
        )
    extra = {name: serving[name] for name in SERVING}
    given = {name: getattr(module, name, None) for name in FROM_COMPILE}
    needed = [name for name, fn in given.items() if not callable(fn)]
    create_model, dataset_fn = module.create_model, module.dataset_fn
    create_optimizer: Any = given["create_optimizer"]  # callable unless ``needed``
    loss_fn: Any = given["loss_fn"]
    if needed or metrics is None:  # what the job leaves to its compiled model
        compiled = FromCompile(spec, create_model, needed=needed, hint=misspelt(module, needed))
        create_model = compiled.create_model
        if "create_optimizer" in needed:
            create_optimizer = compiled.create_optimizer
        if "loss_fn" in needed:
            loss_fn = compiled.loss_fn
        if metrics is None:
            metrics = compiled.metrics
    return _checked(
        Job(
            name=spec,
            create_model=create_model,
            create_optimizer=create_optimizer,
            loss_fn=loss_fn,
            dataset_fn=dataset_fn,
            eval_dataset_fn=eval_fn,
            metrics=metrics,
            module=module,
            **extra,
        )
    )


def misspelt(module: ModuleType, names: Sequence[str]) -> str:
    """`` (create_optimiser is there: a misspelling?)`` when the job defines a function
    whose name is close to one of ``names`` (which it lacks); else ""."""
    defined = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
    for name in names:
        close = difflib.get_close_matches(name, defined, n=1, cutoff=0.8)
        if close:
            return f" ({close[0]} is there: a misspelling of {name}?)"
    return ""


def _returned(value: object) -> str:
    shown = f" ({echo(value, limit=40)})" if isinstance(value, (str, int, float)) else ""
    return f"{type(value).__name__}{shown}"


def _checked(job: Job) -> Job:
    """``job`` whose functions refuse in one line (exit 78) what they return that psctl
    cannot train on, naming the function, instead of an AttributeError deep in Keras."""
    field = f"--job {job.name}"

    def create_model() -> Any:
        import keras

        from psctl.coordinator.embeddings.dynamic import built_by_psctl

        with built_by_psctl():
            model = job.create_model()
        if not isinstance(model, keras.Model):
            raise ConfigError(
                field,
                f"create_model() returned {_returned(model)}, not a keras.Model",
                "return the model it builds (keras.Model, keras.Sequential or a subclass)",
            )
        return model

    def create_optimizer() -> Any:
        import keras

        optimizer = job.create_optimizer()
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise ConfigError(
                field,
                f"create_optimizer() returned {_returned(optimizer)}, not a Keras optimizer",
                "return an instance, e.g. keras.optimizers.Adam(1e-3)",
            )
        return optimizer

    def datasets(name: str, fn: Callable[[DataContext], Any]) -> Callable[[DataContext], Any]:
        def made(ctx: DataContext) -> Any:
            import tensorflow as tf

            dataset = fn(ctx)
            if not isinstance(dataset, tf.data.Dataset):
                raise ConfigError(
                    field,
                    f"{name} returned {_returned(dataset)}, not a tf.data.Dataset",
                    "return a dataset of batches of (features, labels)",
                )
            spec = dataset.element_spec
            if not isinstance(spec, (tuple, list)) or len(spec) < 2:
                raise ConfigError(
                    field,
                    f"{name}'s dataset yields {str(spec)[:120]}, not (features, labels)",
                    "yield (features, labels) pairs, e.g. dataset.map(lambda x: (x, label(x)))",
                )
            return dataset

        return made

    def loss_fn(labels: Any, predictions: Any) -> Any:
        loss = job.loss_fn(labels, predictions)
        if loss is None:
            raise ConfigError(
                field, "loss_fn returned None", "return the loss: one per example, or its mean"
            )
        return loss

    eval_fn = job.eval_dataset_fn
    return dataclasses.replace(
        job,
        create_model=create_model,
        create_optimizer=create_optimizer,
        loss_fn=loss_fn,
        dataset_fn=datasets("dataset_fn", job.dataset_fn),
        eval_dataset_fn=datasets("eval_dataset_fn", eval_fn) if eval_fn is not None else None,
    )


class FromCompile:
    """The optimizer, loss and metrics a job leaves to its compiled model.

    They are read from the model each time ``create_model()`` runs (under the strategy's
    scope, where psctl builds it; never earlier, since sync mode must create its strategy
    before any TensorFlow op), and handed out fresh: a new optimizer from the compiled one's
    config in the caller's scope, the loss per example, metric objects cloned per use.
    """

    def __init__(
        self, spec: str, create_model: Callable[[], Any], *, needed: list[str], hint: str = ""
    ) -> None:
        self._spec = spec
        self._create_model = create_model
        self._needed = needed
        self._hint = hint  # misspelt(): a near miss of a needed function's name
        self._optimizer: Any = None
        self._loss: Callable[[Any, Any], Any] | None = None
        self._metrics: list[Any] | None = None
        self.metrics = _LazyList(self._read_metrics)

    def create_model(self) -> Any:
        model = self._create_model()
        self._read(model)
        return model

    def create_optimizer(self) -> Any:
        optimizer = self._arguments()._optimizer
        return type(optimizer).from_config(optimizer.get_config())

    def loss_fn(self, labels: Any, predictions: Any) -> Any:
        loss = self._arguments()._loss
        assert loss is not None
        return loss(labels, predictions)

    def _read_metrics(self) -> list[Any]:
        return list(self._arguments()._metrics or [])

    def _arguments(self) -> FromCompile:
        if self._metrics is None:  # nothing has built the model yet: build one to read it
            self.create_model()
        return self

    def _fail(self, problem: str, fix: str) -> ConfigError:
        return ConfigError(f"--job {self._spec}", problem, fix)

    def _read(self, model: Any) -> None:
        if not getattr(model, "compiled", False):
            if not self._needed:  # metrics are optional
                self._metrics = []
                return
            raise self._fail(
                f"does not define {', '.join(self._needed)}{self._hint}, and create_model() "
                "returns a model that is not compiled",
                f"add def {self._needed[0]}(...) to the job, or return the model after "
                "model.compile(optimizer=..., loss=...)",
            )
        args = compile_arguments(model)
        if "create_optimizer" in self._needed and args.get("optimizer") is None:
            raise self._fail(
                f"does not define create_optimizer{self._hint} and create_model()'s compile() "
                "has no optimizer",
                "pass compile(optimizer=...) or add def create_optimizer()",
            )
        if "loss_fn" in self._needed:
            self._loss = self._per_example_loss(args.get("loss"))
        self._optimizer = args.get("optimizer")
        metrics = args.get("metrics") or []
        if isinstance(metrics, str) or not isinstance(metrics, Sequence):
            raise self._fail(
                "compile(metrics=...) is not a flat list (one list per output is not supported)",
                'pass compile(metrics=["accuracy", ...]) or set metrics = [...] in the job',
            )
        self._metrics = list(metrics)

    def _per_example_loss(self, loss: Any) -> Callable[[Any, Any], Any]:
        """compile()'s loss, per example as ``loss_fn`` returns it."""
        import copy

        import keras

        if loss is None:
            raise self._fail(
                f"does not define loss_fn{self._hint} and create_model()'s compile() has no loss",
                "pass compile(loss=...) or add def loss_fn(labels, predictions)",
            )
        if isinstance(loss, (dict, list, tuple)):
            raise self._fail(
                "compile() has one loss per output, which psctl does not train",
                "add def loss_fn(labels, predictions) returning per-example losses",
            )
        found = keras.losses.get(loss)
        if isinstance(found, keras.losses.Loss):
            found = copy.copy(found)  # the job's object stays as it is
            found.reduction = "none"
        if not callable(found):
            raise self._fail(f"cannot use compile(loss={loss!r})", "pass a Keras loss")
        result: Callable[[Any, Any], Any] = found
        return result


class _LazyList(Sequence[Any]):
    """A list read when first used (metrics from a compiled model: known once it is built)."""

    def __init__(self, read: Callable[[], list[Any]]) -> None:
        self._read = read

    def __getitem__(self, index: Any) -> Any:
        return self._read()[index]

    def __len__(self) -> int:
        return len(self._read())

    def __repr__(self) -> str:
        return f"metrics from compile(): {self._read()!r}"


def compile_arguments(model: Any) -> dict[str, Any]:
    """The arguments of the model's ``compile()``: the objects it was given where Keras
    keeps them, else rebuilt from its public ``get_compile_config()``."""
    kept = getattr(getattr(model, "_compile_config", None), "config", None)
    if isinstance(kept, dict):
        return kept
    import keras

    config = dict(model.get_compile_config())
    if isinstance(config.get("optimizer"), (dict, str)):
        config["optimizer"] = keras.optimizers.get(config["optimizer"])
    if isinstance(config.get("loss"), dict):
        config["loss"] = keras.losses.deserialize(config["loss"])
    metrics = config.get("metrics")
    if isinstance(metrics, list):
        config["metrics"] = [
            keras.metrics.deserialize(m) if isinstance(m, dict) else m for m in metrics
        ]
    return config
