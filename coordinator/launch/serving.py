"""`psctl export`'s process: resolve the settings and the checkpoint, then export."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from psctl.cluster.errors import ConfigError
from psctl.coordinator.settings import resolve_settings

log = logging.getLogger("psctl.export")


def export_main(args: argparse.Namespace, flags: dict[str, Any]) -> int:
    settings = resolve_settings(flags=flags, config_file=args.config)
    if not settings.checkpoints.checkpoint_dir and not args.checkpoint and not args.requests:
        raise ConfigError(
            "--checkpoint-dir", "is required", "give the training run's checkpoint directory"
        )
    from psctl.coordinator.job import load_job
    from psctl.coordinator.training.saving.saved_model import READY, Exporter

    exporter = Exporter(load_job(settings.job), settings)
    if not args.requests:
        target = exporter.export(args.checkpoint, args.out)
        print(f"exported {target.checkpoint} to {target.path}", flush=True)
        return 0
    print(READY, flush=True)
    for line in sys.stdin:  # until the publisher closes it
        prefix = line.strip()
        try:
            target = exporter.export(prefix, args.out)
        except ConfigError as err:
            print(f"error: {err}", flush=True)
            continue
        print(f"exported {target.checkpoint} to {target.path}", flush=True)
    return 0
