"""The one place a run's strategy is chosen: `psctl train` and `psctl local` resolve their
run settings here and hand over to the launchers of ``--strategy`` (parameter servers:
train.py and local.py; sync: sync.py). Nothing else in launch/ branches on the strategy.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psctl.cluster import netns
from psctl.coordinator.job import check_job_found
from psctl.coordinator.launch.local import local_ps_main, prepare_local
from psctl.coordinator.launch.sync import local_sync_main, sync_train_main
from psctl.coordinator.launch.train import ps_train_main
from psctl.coordinator.settings import TrainSettings, env_switch, resolve_settings
from psctl.coordinator.training.saving.checkpoint_files import check_output_dirs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Launchers:
    """What a strategy runs for each command."""

    train: Callable[[argparse.Namespace, TrainSettings], int]  # psctl train
    local: Callable[[argparse.Namespace, dict[str, Any], Path, TrainSettings], int]


LAUNCHERS: dict[str, Launchers] = {
    "async": Launchers(train=ps_train_main, local=local_ps_main),
    "sync": Launchers(train=sync_train_main, local=local_sync_main),
}


def train_main(args: argparse.Namespace, flags: dict[str, Any]) -> int:
    """`psctl train`: the coordinator (async) or this worker's training process (sync)."""
    settings = resolve_settings(flags=flags, config_file=args.config)
    check_job_found(settings.job)  # now, not after waiting --connect-timeout for servers
    return LAUNCHERS[settings.strategy].train(args, settings)


def local_main(args: argparse.Namespace, flags: dict[str, Any]) -> int:
    """`psctl local`: a whole cluster (async) or every worker's training process (sync) on
    this machine; bad settings and output paths fail before any process starts."""
    workdir, flags = prepare_local(args, flags)
    settings = resolve_settings(flags=flags, config_file=args.config)
    check_job_found(settings.job)
    check_output_dirs(
        settings.checkpoints.checkpoint_dir,
        settings.reporting.summary_json,
        settings.publishing.export_dir,
        settings.reporting.logdir,
    )
    with job_network(args, os.environ):
        return LAUNCHERS[settings.strategy].local(args, flags, workdir, settings)


@contextlib.contextmanager
def job_network(args: argparse.Namespace, environ: MutableMapping[str, str]) -> Iterator[None]:
    """The job's TensorFlow ports in a network namespace of its own for as long as the
    job runs (cluster/netns.py): every process psctl starts finds it in ``environ``. With
    --open-tf-ports (PSCTL_OPEN_TF_PORTS=1), as TensorFlow serves them, said once."""
    if args.open_tf_ports or env_switch(environ, "PSCTL_OPEN_TF_PORTS"):
        log.warning(
            "TensorFlow's ports are open (--open-tf-ports): any local user, and any host that "
            "reaches this one, can run operations on this job's tasks"
        )
        yield
        return
    with netns.job_namespace(environ):
        log.info("TensorFlow's ports are in a network namespace of the job's: only it reaches them")
        yield
