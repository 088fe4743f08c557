"""`ps-server` entry point."""

from __future__ import annotations

from psctl.cluster import server


def main() -> int:
    return server.main("ps")


if __name__ == "__main__":
    main()
