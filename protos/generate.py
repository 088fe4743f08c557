"""Regenerate psctl's gRPC Python code from protos/**/*.proto (run: python -m protos.generate).

Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py beside each .proto. With --check, generates
into a temporary directory and exits 1 if the committed files differ.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    return sorted(ROOT.rglob("*.proto"))


def generate(out: Path) -> None:
    include = Path(protoc.__file__).resolve().parent / "_proto"
    for proto in proto_files():
        rel = proto.relative_to(ROOT)
        code = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{ROOT}",
                f"-I{include}",
                f"--python_out={out}",
                f"--pyi_out={out}",
                f"--grpc_python_out={out}",
                str(rel),
            ]
        )
        if code != 0:
            raise SystemExit(f"protoc failed on {rel} (status {code})")


def generated_files(base: Path) -> list[Path]:
    return sorted(p.relative_to(base) for p in base.rglob("*") if p.name.endswith(SUFFIXES))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if committed code is stale")
    args = parser.parse_args(argv)
    if not args.check:
        generate(ROOT)
        print(f"generated {len(generated_files(ROOT))} files under {ROOT}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(fresh)
        stale = [
            str(rel)
            for rel in generated_files(fresh)
            if not (ROOT / rel).is_file() or not filecmp.cmp(fresh / rel, ROOT / rel, shallow=False)
        ]
        extra = sorted(set(map(str, generated_files(ROOT))) - set(map(str, generated_files(fresh))))
    if stale or extra:
        print(
            "generated code differs from protos/*.proto: "
            + ", ".join(stale + extra)
            + "; run: python -m protos.generate",
            file=sys.stderr,
        )
        return 1
    print("generated code is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
