"""``python -m psctl``: the ``psctl`` command (what every re-exec of psctl runs)."""

import sys

from psctl.coordinator.cli.main import main

sys.exit(main())
