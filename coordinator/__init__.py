"""The coordinator: job API, training loop, local-cluster launcher and the `psctl` CLI."""
