"""Every command's flags: each value a parser accepts works, or is refused at parse time naming the flag (engine/
args.py); vLLM's spellings carry over (--port, --enable-chunked-prefill, --pipeline-parallel-size 1). The walk goes
over every parser's `_actions` with `choices`, so a value added to a choice list later is covered without editing
this file; the cheap ones (random:tiny on the CPU) start a real engine."""
from __future__ import annotations

import argparse
import functools

import pytest
import torch

from bench.throughput import build_parser as throughput_parser
from cli.main import generate_parser
from cli.up import build_parser as up_parser
from cli.up import launch_commands
from decode_svc.server import build_parser as decode_parser
from engine.args import EngineArgs
from engine.plan import build_parser as plan_parser
from prefill_svc.server import build_parser as prefill_parser
from router.server import build_parser as router_parser

# Each parser, and the arguments it needs besides the flag under test.
PARSERS = {"up": (up_parser, []), "router": (router_parser, []), "prefill": (prefill_parser, []),
           "decode": (decode_parser, []), "generate": (generate_parser, ["hi"]),
           "plan": (plan_parser, ["--model", "random:tiny", "--memory", "1GiB", "--max-model-len", "64"]),
           "throughput": (throughput_parser, [])}
ENGINE_PARSERS = ("up", "router", "prefill", "decode", "generate")


@functools.cache
def _parser(name: str) -> argparse.ArgumentParser:
    return PARSERS[name][0]()


def _parse(name: str, *argv: str) -> argparse.Namespace:
    return _parser(name).parse_args([*argv, *PARSERS[name][1]])


def _refusal(name: str, capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as ei:
        _parse(name, *argv)
    assert ei.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def _choices():
    for name in PARSERS:
        for action in _parser(name)._actions:
            if action.choices and action.option_strings:
                for value in action.choices:
                    yield name, action.option_strings[0], action.dest, value


CHOICES = list(_choices())


@pytest.mark.parametrize("name,flag,dest,value", CHOICES, ids=[f"{n}{f}={v}" for n, f, _, v in CHOICES])
def test_every_choice_parses(name, flag, dest, value):
    ns = _parse(name, flag, value)
    parsed = getattr(ns, dest)
    assert value in (parsed if isinstance(parsed, list) else [parsed]) or parsed == value.upper()


ENGINE_CHOICES = sorted({(flag, dest, value) for name, flag, dest, value in CHOICES
                         if name == "prefill" and dest in {f.name for f in EngineArgs.__dataclass_fields__.values()}})


@pytest.mark.slow
@pytest.mark.parametrize("flag,dest,value", ENGINE_CHOICES, ids=[f"{f}={v}" for f, _, v in ENGINE_CHOICES])
def test_every_engine_choice_starts_an_engine_or_names_the_flag_at_load(flag, dest, value):
    """random:tiny on the CPU with each value: an engine that generates (a 4-bit format rounds the random model to
    it), or a ValueError naming the flag and what the checkpoint is."""
    from engine import LLMEngine, SamplingParams

    ns = _parse("prefill", "--model", "random:tiny", "--device", "cpu", "--kv-cache-memory", "0.02", flag, value)
    try:
        engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(ns))
    except ValueError as e:
        assert dest == "quantization" and value in ("awq", "gptq", "compressed-tensors"), e
        assert f"--quantization {value}" in str(e) and "quant_method=None" in str(e), e
        return
    try:
        engine.add_request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2))
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert sum(len(o.new_token_ids) for o in outs) == 2
    finally:
        engine.close()


REFUSED = [
    (["--block-size", "0"], "argument --block-size: block_size=0: must be in [1, 1024]"),
    (["--gpu-memory-utilization", "0"], "argument --gpu-memory-utilization: gpu_memory_utilization=0.0"),
    (["--kv-cache-memory", "-1"], "argument --kv-cache-memory: kv_cache_memory=-1.0: must be > 0"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: max_num_seqs=0: must be >= 1"),
    (["--max-num-batched-tokens", "0"], "argument --max-num-batched-tokens: max_num_batched_tokens=0"),
    (["--new-token-ratio", "1.5"], "argument --new-token-ratio: new_token_ratio=1.5: must be in [0, 1]"),
    (["--max-model-len", "0"], "argument --max-model-len: max_model_len=0: must be >= 1"),
    (["--max-prefill-cudagraph-tokens", "-1"], "argument --max-prefill-cudagraph-tokens"),
    (["--num-gpu-blocks-override", "0"], "argument --num-gpu-blocks-override: num_gpu_blocks_override=0"),
    (["--tensor-parallel-size", "0"], "argument --tensor-parallel-size: tensor_parallel_size=0: must be >= 1"),
    (["--device", "tpu"], "argument --device: device='tpu': must be auto, cpu, cuda or cuda:N"),
    (["--dtype", "float8"], "argument --dtype: dtype='float8': must be one of auto, float32"),
    (["--kv-cache-dtype", "fp4"], "argument --kv-cache-dtype: kv_cache_dtype='fp4': must be one of auto"),
    (["--quantization", "bitsandbytes"], "argument --quantization: quantization='bitsandbytes': must be one of"),
    (["--max-num-seqs", "many"], "argument --max-num-seqs: invalid int value: 'many'"),
    (["--pipeline-parallel-size", "2"], "argument --pipeline-parallel-size/-pp: pipeline_parallel_size=2: Tandem "
                                        "has no pipeline parallelism yet"),
    (["--no-enable-chunked-prefill"], "argument --enable-chunked-prefill/--no-enable-chunked-prefill: chunked "
                                      "prefill is always on: it cannot be turned off"),
]


@pytest.mark.parametrize("name", ENGINE_PARSERS)
@pytest.mark.parametrize("argv,message", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_a_value_no_engine_takes_is_refused_at_parse_time_naming_the_flag(capsys, name, argv, message):
    assert message in _refusal(name, capsys, *argv)


@pytest.mark.parametrize("name", ENGINE_PARSERS)
def test_vllm_spellings_for_what_is_always_so_parse(name):
    ns = _parse(name, "--enable-chunked-prefill", "--pipeline-parallel-size", "1")
    assert ns.enable_chunked_prefill is True and ns.pipeline_parallel_size == 1
    assert _parse(name, "-pp", "1").pipeline_parallel_size == 1


@pytest.mark.parametrize("name", ["up", "router"])
def test_port_is_the_http_port_as_vllm_and_http_port_stays(name):
    assert _parse(name, "--port", "8123").http_port == 8123
    assert _parse(name, "--http-port", "8124").http_port == 8124
    assert _parse(name).http_port == 8000


def test_workers_port_stays_their_grpc_port_and_up_passes_each_its_own():
    assert _parse("prefill", "--port", "7001").port == 7001
    cmds = launch_commands(_parse("up", "--port", "8123", "--worker-port", "7100", "--model", "random:tiny"))
    router = cmds["router"]
    assert router[router.index("--http-port") + 1] == "8123"
    assert [c[c.index("--port") + 1] for n, c in sorted(cmds.items()) if n != "router"] == ["7101", "7100"]
    assert _parser("router").parse_args(router[2:]).http_port == 8123
    for name, cmd in cmds.items():
        if name != "router":
            assert _parser(name.split("-")[0]).parse_args(cmd[2:]).port == int(cmd[cmd.index("--port") + 1])


def test_throughput_takes_vllms_stream_spellings():
    assert _parse("throughput", "--stream").stream and _parse("throughput", "--async-engine").stream
    assert not _parse("throughput").stream


def test_a_worker_given_a_format_its_checkpoint_is_not_exits_1_with_the_message(capsys, tiny_llama_dir):
    """--quantization awq on a 16-bit checkpoint: what only loading can tell, said in one line; main returns 1 (it
    raised out of main before, a traceback in the worker's log). (A random: model is rounded to the format instead,
    so it would serve: the checkpoint is a directory.)"""
    from prefill_svc.server import main

    rc = main(["--model", str(tiny_llama_dir), "--device", "cpu", "--kv-cache-memory", "0.02", "--quantization", "awq",
               "--port", "0"])
    assert rc == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        f"tandem prefill: quantization='awq': model='{tiny_llama_dir}' has quantization_config.quant_method=None; "
        "--quantization awq")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_a_cuda_device_on_a_host_without_one_exits_1_naming_device(capsys):
    from cli.main import main

    assert main(["generate", "--model", "random:tiny", "--device", "cuda", "hi"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "tandem generate: device='cuda': this host has no CUDA device (torch.cuda.is_available() is False); use "
        "--device cpu")


@pytest.mark.parametrize("argv,message", [(["--max-prompt-bytes", "0"], "max_prompt_bytes=0: must be >= 1"),
                                          (["--max-sub-requests", "0"], "max_sub_requests=0: must be >= 1")])
def test_router_limits_are_refused_before_it_starts(capsys, argv, message):
    from router.server import main

    with pytest.raises(SystemExit) as ei:
        main(["--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2", *argv])
    assert ei.value.code == 2 and capsys.readouterr().err.strip().endswith(message)
