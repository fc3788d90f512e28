"""Regenerate the protobuf / gRPC Python modules from ``protos/``.

    python -m protos.codegen            # writes splitserve/v1/*_pb2*.py[i] in the repo root
    python -m protos.codegen OUT_DIR    # writes OUT_DIR/splitserve/v1/... instead

The generated files are committed; ``tests/service/test_protos.py`` fails when they drift from the
protos. With ``-I protos`` and the files at ``protos/splitserve/v1/``, the generated code
imports as ``from splitserve.v1 import generation_pb2``.
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_FILES = ("splitserve/v1/generation.proto", "splitserve/v1/worker.proto")


def generate(out_dir: str | Path) -> list[Path]:
    """Run protoc on every proto into ``out_dir``; returns the generated files (sorted)."""
    # grpc_tools is a build/test dependency only, so import it here.
    import grpc_tools
    from grpc_tools import protoc

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bundled = Path(grpc_tools.__file__).resolve().parent / "_proto"  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{bundled}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--pyi_out={out}",
        *(str(PROTO_ROOT / f) for f in PROTO_FILES),
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}: {' '.join(args)}")
    return generated_files(out)


def generated_files(root: str | Path) -> list[Path]:
    """The generated modules under ``root`` (relative paths), e.g. splitserve/v1/worker_pb2.py."""
    root = Path(root)
    found = []
    for proto in PROTO_FILES:
        stem = proto.removesuffix(".proto")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            if (root / f"{stem}{suffix}").exists():
                found.append(Path(f"{stem}{suffix}"))
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else REPO_ROOT
    for path in generate(out):
        print(out / path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
