"""`psctl export`'s process: resolve the settings and the checkpoint, then export."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from psctl.cluster.errors import ConfigError
from psctl.coordinator.settings import resolve_settings

log = logging.getLogger("psctl.export")


def export_main(args: argparse.Namespace, flags: dict[str, Any]) -> int:
    settings = resolve_settings(flags=flags, config_file=args.config)
    if not settings.checkpoint_dir and not args.checkpoint:
        raise ConfigError(
            "--checkpoint-dir", "is required", "give the training run's checkpoint directory"
        )
    import tensorflow as tf

    from psctl.coordinator.job import load_job
    from psctl.coordinator.training.export import export

    checkpoint = args.checkpoint or tf.train.latest_checkpoint(settings.checkpoint_dir)
    if not checkpoint:
        raise ConfigError(
            "--checkpoint-dir",
            f"no checkpoint in {settings.checkpoint_dir}",
            "give the directory a training run wrote its checkpoints to",
        )
    target = export(load_job(settings.job), settings, checkpoint=checkpoint, out=args.out)
    print(f"exported {checkpoint} to {target}", flush=True)
    return 0
