"""`tandem up --colocated` and `tandem router --colocated`: the command line, and the flags each refuses."""
import pytest

from cli.up import _check, build_parser, launch_commands
from router.server import build_parser as router_parser
from router.server import engine_only_flags
from router.server import main as router_main


def up(*argv: str):
    return build_parser().parse_args(list(argv))


def test_colocated_starts_the_router_alone_with_every_engine_flag():
    ns = up("--colocated", "--model", "random:tiny", "--http-port", "7001", "--grpc-port", "7000", "--device", "cuda",
            "--dtype", "bfloat16", "--kv-cache-memory", "24", "--max-model-len", "4096")
    assert _check(ns) is None
    assert launch_commands(ns) == {"router": [
        "tandem", "router", "--colocated", "--host", "127.0.0.1", "--grpc-port", "7000", "--http-port", "7001",
        "--model", "random:tiny", "--dtype", "bfloat16", "--max-model-len", "4096", "--kv-cache-memory", "24.0",
        "--device", "cuda"]}
    cmd = launch_commands(ns)["router"]
    parsed = router_parser().parse_args(cmd[2:])  # the router's own parser takes it
    assert parsed.colocated and parsed.kv_cache_memory == 24.0 and parsed.dtype == "bfloat16"


def test_colocated_refuses_worker_counts():
    assert "--decode=2: --colocated starts no workers" in _check(up("--colocated", "--decode", "2"))


def test_worker_counts_must_be_positive():
    assert _check(up("--prefill", "0")) == "--prefill=0 --decode=1: each must be >= 1"


def test_engines_sharing_a_gpu_need_a_fixed_kv_cache():
    problem = _check(up("--device", "cuda"))
    assert problem.startswith("--device=cuda with 2 engines on one GPU") and "--kv-cache-memory" in problem
    assert _check(up("--device", "cuda", "--kv-cache-memory", "24")) is None
    assert _check(up("--device", "cuda", "--num-gpu-blocks-override", "1000")) is None
    assert _check(up("--device", "cpu")) is None
    assert _check(up("--device", "cuda", "--colocated")) is None  # one engine


def test_a_router_without_colocated_refuses_engine_flags(capsys):
    ns = router_parser().parse_args(["--prefill", "a:1", "--decode", "b:2", "--dtype", "bfloat16",
                                     "--max-model-len", "512"])
    assert engine_only_flags(ns) == ["--dtype"]  # --max-model-len is the router's too
    with pytest.raises(SystemExit):
        router_main(["--prefill", "a:1", "--decode", "b:2", "--dtype", "bfloat16"])
    assert "--dtype: engine flags, and this router runs no engine" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        router_main(["--colocated", "--decode", "b:2"])
    assert "--decode: --colocated runs its own engine" in capsys.readouterr().err


def test_a_colocated_router_tokenizes_with_the_tokenizer_flag(other_tokenizer_dir):
    """`tandem router --colocated --tokenizer DIR`: the router's tokenizer is its engine's, which is DIR's."""
    import asyncio

    from engine.args import EngineArgs
    from router.colocated import ColocatedBackend

    ns = router_parser().parse_args(["--colocated", "--model", "random:tiny", "--device", "cpu",
                                     "--kv-cache-memory", "0.02", "--tokenizer", str(other_tokenizer_dir)])
    backend = asyncio.run(ColocatedBackend.from_engine_args(EngineArgs.from_cli_args(ns)))
    try:
        assert backend.tokenizer("abc")["input_ids"] == [256, 99] and backend.vocab_size == 512
    finally:
        backend.engine.close()
