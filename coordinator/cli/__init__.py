"""The `psctl` command line: thin argparse front-ends over the coordinator's rooms."""

import os

# Before anything imports grpc (it reads these once): the C core's INFO lines (GOAWAY on
# shutdown; "skipping fork() handlers" each time a launcher that serves the control API
# starts a child) are not for operators, and psctl never forks without exec.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
