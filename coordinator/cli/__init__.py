"""The `psctl` command line: thin argparse front-ends over the coordinator's rooms."""
