"""The .proto files compile anywhere with `protoc -I protos`: nothing in them names this repository's layout, each
names its Go and Java package, and the Python protoc writes from a copy of them imports on its own."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PROTOS = Path(__file__).resolve().parents[2] / "protos"
FILES = sorted((PROTOS / "tandem" / "v1").glob("*.proto"))


@pytest.mark.parametrize("proto", FILES, ids=lambda p: p.name)
def test_imports_are_relative_to_protos_and_packages_are_named(proto):
    text = proto.read_text()
    for imported in re.findall(r'^import "([^"]+)";', text, re.M):
        assert (PROTOS / imported).is_file(), f"{proto.name}: import {imported!r} is not relative to protos/"
    assert re.search(r'^option go_package = "[^"]+/tandem/v1;tandemv1";', text, re.M), proto.name
    assert re.search(r'^option java_package = "[\w.]+";', text, re.M), proto.name


def test_a_copy_compiles_with_protoc_and_imports_alone(tmp_path):
    grpc_tools = pytest.importorskip("grpc_tools")
    from grpc_tools import protoc

    src, out = tmp_path / "include", tmp_path / "gen"
    shutil.copytree(PROTOS / "tandem", src / "tandem", ignore=shutil.ignore_patterns("*.py", "*.pyi", "__pycache__"))
    out.mkdir()
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    files = [str(p.relative_to(src)) for p in sorted(src.rglob("*.proto"))]
    assert protoc.main(["protoc", f"-I{src}", f"-I{well_known}", f"--python_out={out}",
                        f"--grpc_python_out={out}", *files]) == 0
    # Isolated mode: neither the repository nor the current directory is on the path; only the generated code.
    code = (f"import sys; sys.path.insert(0, {str(out)!r}); "
            "from tandem.v1 import decode_pb2, decode_pb2_grpc, generate_pb2_grpc, prefill_pb2_grpc; "
            "m = decode_pb2.DecodeRequest(request_id='x'); "
            "assert decode_pb2.DecodeRequest.FromString(m.SerializeToString()).request_id == 'x'; "
            "print(decode_pb2.DESCRIPTOR.name)")
    r = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "tandem/v1/decode.proto"


def test_committed_stubs_register_the_same_file_names():
    from protos.tandem.v1 import decode_pb2, generate_pb2

    assert decode_pb2.DESCRIPTOR.name == "tandem/v1/decode.proto"
    assert generate_pb2.DESCRIPTOR.dependencies[0].name == "tandem/v1/common.proto"
