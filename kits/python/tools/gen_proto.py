#!/usr/bin/env python3
"""Regenerates the kit's protobuf module from the contract.

    python tools/gen_proto.py           # rewrite src/shelfsync_kit/proto/shelfsync_pb2.py(i)
    python tools/gen_proto.py --check   # exit 1 if the committed files are not current

It runs the protoc bundled in grpcio-tools, at the version pinned in
pyproject.toml's `test` extra (its generated code needs a protobuf runtime at
least as new as that protoc: 5.29, hence `protobuf>=5.29` in the
dependencies). The descriptor keeps the contract's own path,
`shelfsync/v1/shelfsync.proto`, so it registers exactly as any other code
generated from that file would.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

KIT = pathlib.Path(__file__).resolve().parents[1]
REPO = KIT.parents[1]
PROTO_ROOT = REPO / "proto"
PROTO = "shelfsync/v1/shelfsync.proto"
OUT = KIT / "src" / "shelfsync_kit" / "proto"
FILES = ("shelfsync_pb2.py", "shelfsync_pb2.pyi")


def generate(into: pathlib.Path) -> dict[str, bytes]:
    """Runs protoc into `into`; returns the generated files' bytes by name."""
    from grpc_tools import protoc  # the `test` extra installs it

    code = protoc.main(
        ["protoc", f"-I{PROTO_ROOT}", f"--python_out={into}", f"--pyi_out={into}", PROTO]
    )
    if code != 0:
        raise RuntimeError(f"protoc failed ({code}) on {PROTO_ROOT / PROTO}")
    generated = into / "shelfsync" / "v1"
    return {name: (generated / name).read_bytes() for name in FILES}


def stale_files() -> list[str]:
    """The committed files that differ from what protoc generates now."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(pathlib.Path(tmp))
    return [n for n, b in fresh.items() if not (OUT / n).is_file() or (OUT / n).read_bytes() != b]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; write nothing")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        if stale:
            print(f"not current: {', '.join(stale)}: run python {pathlib.Path(__file__).relative_to(REPO)}",
                  file=sys.stderr)
            return 1
        print("generated protobuf code is current")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in generate(pathlib.Path(tmp)).items():
            (OUT / name).write_bytes(data)
    print(f"wrote {', '.join(FILES)} into {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
