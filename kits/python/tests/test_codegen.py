"""The committed protobuf module is what protoc generates from the contract now."""

import importlib.util
import pathlib

TOOL = pathlib.Path(__file__).resolve().parents[1] / "tools" / "gen_proto.py"


def test_generated_code_is_current():
    spec = importlib.util.spec_from_file_location("gen_proto", TOOL)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.stale_files() == [], (
        "src/shelfsync_kit/proto is not current: run python kits/python/tools/gen_proto.py")
