"""Regenerates the committed gRPC/protobuf stubs from protos/tandem/v1/*.proto.

    python -m protos.build          # rewrite the stubs in place
    python -m protos.build --check  # exit 1 when the committed stubs are stale

The .proto files import each other relative to protos/ (`import "tandem/v1/common.proto"`), so any project compiles
them with `protoc -I protos` (Go and Java packages are named in the files). protoc then writes Python imports as
`from tandem.v1 import ...`; this script rewrites them to `from protos.tandem.v1 import ...`, the package the
committed stubs live in here.

Needs grpcio-tools (a dev dependency); the machines that only run the services do not have it, which is why the
stubs are committed.

Compatibility: protoc stamps the gencode with its protobuf version and makes the module refuse to import under an
older runtime (`runtime_version.ValidateProtobufRuntimeVersion`), and the gRPC plugin does the same for grpcio
(`GRPC_GENERATED_VERSION`). The generated code itself only uses APIs present since protobuf 5.27 / grpcio 1.63
(`builder.BuildMessageAndEnumDescriptors`, `_registered_method=True`), so this script removes the protobuf check
and lowers the grpcio floor to the project's own floor (pyproject: protobuf>=5.29, grpcio>=1.70). The stubs then
import on any runtime the project supports. tests/protos/test_stubs.py checks both the staleness and the strip.
"""
from __future__ import annotations

import argparse
import difflib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository root
INCLUDE = ROOT / "protos"  # proto imports are "tandem/v1/x.proto", relative to it
PROTO_DIR = Path("protos") / "tandem" / "v1"
GRPC_FLOOR = "1.70.0"

_RUNTIME_CHECK = re.compile(
    r"from google\.protobuf import runtime_version as _runtime_version\n"
    r"|_runtime_version\.ValidateProtobufRuntimeVersion\(\n(?:.*\n)*?\)\n"
)
_PROTOC_VERSION = re.compile(r"# Protobuf Python Version: .*\n")
_GRPC_VERSION = re.compile(r"GRPC_GENERATED_VERSION = '[^']*'")
_IMPORT = re.compile(r"^from tandem\.v1 import ", re.M)


def proto_files() -> list[Path]:
    return sorted((ROOT / PROTO_DIR).glob("*.proto"))


def _postprocess(path: Path) -> None:
    text = _IMPORT.sub("from protos.tandem.v1 import ", path.read_text())
    if path.name.endswith("_pb2.py"):
        text, n = _RUNTIME_CHECK.subn("", text)
        assert n == 2, f"{path}: expected the protobuf runtime version check (import and call), found {n} parts"
        text = _PROTOC_VERSION.sub("# Protobuf runtime version check removed by protos/build.py (see its docstring)\n", text)
    elif path.name.endswith("_pb2_grpc.py"):
        text, n = _GRPC_VERSION.subn(f"GRPC_GENERATED_VERSION = '{GRPC_FLOOR}'", text)
        assert n == 1, f"{path}: expected one GRPC_GENERATED_VERSION, found {n}"
    path.write_text(text)


def generate(out_root: Path) -> list[Path]:
    """Runs protoc into out_root (mirroring the repository layout); returns the generated files."""
    import grpc_tools  # imported here: only this script needs grpcio-tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    files = [str(p.relative_to(INCLUDE)) for p in proto_files()]
    with tempfile.TemporaryDirectory() as tmp:
        # protoc in a child: its extension, imported into a process that has loaded NIXL's UCX libraries (a test run,
        # a service), crashes that process with a segfault.
        args = [sys.executable, "-m", "grpc_tools.protoc", f"-I{INCLUDE}", f"-I{include}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", *files]
        r = subprocess.run(args, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"protoc failed with exit code {r.returncode}: {r.stderr.strip()}")
        out = out_root / PROTO_DIR
        out.mkdir(parents=True, exist_ok=True)
        generated = []
        for p in sorted((Path(tmp) / "tandem" / "v1").iterdir()):
            if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")):
                (out / p.name).write_text(p.read_text())
                generated.append(out / p.name)
    for p in generated:
        if p.name.endswith((".py", ".pyi")):
            _postprocess(p)
    return generated


def stale_files() -> list[str]:
    """Names of the committed stubs that differ from a fresh generation (or are missing or extra)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p.read_text() for p in generate(Path(tmp))}
    committed = {p.name: p.read_text() for p in (ROOT / PROTO_DIR).iterdir()
                 if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))}
    out = []
    for name in sorted(set(fresh) | set(committed)):
        if fresh.get(name) != committed.get(name):
            diff = difflib.unified_diff((committed.get(name) or "").splitlines(), (fresh.get(name) or "").splitlines(),
                                        "committed/" + name, "fresh/" + name, lineterm="", n=1)
            out.append(name + "\n" + "\n".join(list(diff)[:20]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only report whether the committed stubs are stale")
    ns = ap.parse_args(argv)
    if ns.check:
        stale = stale_files()
        for s in stale:
            print("stale:", s)
        return 1 if stale else 0
    for p in generate(ROOT):
        print("wrote", p.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
