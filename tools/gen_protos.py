"""Generate the checked-in gRPC Python code from protos/voicechat/v1/*.proto.

    python -m tools.gen_protos           # regenerate *_pb2.py, *_pb2_grpc.py, *_pb2.pyi in place
    python -m tools.gen_protos --check   # regenerate into a temp dir; exit 1 listing files that differ

protoc runs with `-I .` on the repository-relative paths, so the generated imports read
`from protos.voicechat.v1 import tensor_pb2` and resolve as ordinary package imports from the repository root.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = Path("protos/voicechat/v1")  # relative to ROOT; also the generated files' package path
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def proto_files(root: Path = ROOT) -> list[Path]:
    """The .proto sources, as paths relative to root, sorted."""
    return sorted(p.relative_to(root) for p in (root / PROTO_DIR).glob("*.proto"))


def generated_names(protos: list[Path]) -> list[str]:
    """File names protoc writes for these sources: tensor.proto -> tensor_pb2.py, tensor_pb2_grpc.py, ..."""
    return sorted(p.stem + suffix for p in protos for suffix in GENERATED_SUFFIXES)


def generate(out_dir: Path, root: Path = ROOT) -> list[str]:
    """Run protoc on every source into out_dir (mirroring PROTO_DIR below it); returns the generated names."""
    from grpc_tools import protoc  # dev dependency: imported only when generating

    protos = proto_files(root)
    if not protos:
        raise SystemExit(f"no .proto files under {root / PROTO_DIR}")
    well_known = resources.files("grpc_tools") / "_proto"
    (out_dir / PROTO_DIR).mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        "-I",
        ".",  # run from root: the sources' import paths and the generated imports start at `protos/`
        "-I",
        str(well_known),
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *(str(p) for p in protos),
    ]
    rc = _run_in(root, lambda: protoc.main(args))
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    return generated_names(protos)


def _run_in(cwd: Path, fn):
    previous = Path.cwd()
    os.chdir(cwd)
    try:
        return fn()
    finally:
        os.chdir(previous)


def check(root: Path = ROOT) -> list[str]:
    """Generated files that are missing, stale or differ from a fresh generation (empty when clean)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh_dir = Path(tmp) / PROTO_DIR
        expected = generate(Path(tmp), root)
        checked_in_dir = root / PROTO_DIR
        differing = [
            name
            for name in expected
            if not (checked_in_dir / name).is_file()
            or not filecmp.cmp(fresh_dir / name, checked_in_dir / name, shallow=False)
        ]
    stale = [
        p.name
        for suffix in GENERATED_SUFFIXES
        for p in checked_in_dir.glob("*" + suffix)
        if p.name not in expected
    ]
    return sorted(set(differing + stale))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gen_protos", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="compare a fresh generation with the checked-in files"
    )
    args = parser.parse_args(argv)
    if args.check:
        differing = check()
        if differing:
            print("generated protobuf code is out of date; run `make protos`. Differing files:")
            for name in differing:
                print(f"  {PROTO_DIR / name}")
            return 1
        print("generated protobuf code is up to date")
        return 0
    names = generate(ROOT)
    print(f"wrote {len(names)} files under {PROTO_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
