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
    from psctl.coordinator.job import load_job
    from psctl.coordinator.training.saving.saved_model import export

    target = export(load_job(settings.job), settings, checkpoint=args.checkpoint, out=args.out)
    print(f"exported {target.checkpoint} to {target.path}", flush=True)
    return 0
