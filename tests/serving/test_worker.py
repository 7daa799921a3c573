"""serving/worker.py: the engine config a worker builds from its flags, with its role's defaults (no engine is started,
no GPU is needed)."""
import pytest

import engine.args
from decode_svc import server as decode_server
from engine.args import EngineArgs
from engine.config import PREFILL_CPU_MAX_NUM_BATCHED_TOKENS, SchedulerConfig
from prefill_svc import server as prefill_server
from router import server as router_server
from serving import worker


def budget(server, *argv: str) -> int:
    """The max_num_batched_tokens of the engine `server`'s worker would start with these flags."""
    ns = server.build_parser().parse_args(list(argv))
    return worker.engine_args(server.ROLE, ns).create_engine_config().scheduler.max_num_batched_tokens


def test_a_prefill_worker_on_the_cpu_steps_in_smaller_budgets_by_default():
    assert PREFILL_CPU_MAX_NUM_BATCHED_TOKENS == 512 < SchedulerConfig.max_num_batched_tokens == 2048
    assert budget(prefill_server, "--device", "cpu") == 512


def test_the_flag_wins_over_the_roles_default():
    for n in ("2048", "4096", "64"):
        assert budget(prefill_server, "--device", "cpu", "--max-num-batched-tokens", n) == int(n)
        assert budget(decode_server, "--device", "cpu", "--max-num-batched-tokens", n) == int(n)


def test_a_decode_worker_keeps_the_engines_default():
    assert budget(decode_server, "--device", "cpu") == 2048


def test_a_prefill_worker_on_a_gpu_keeps_the_engines_default(monkeypatch):
    monkeypatch.setattr(engine.args, "_check_device", lambda device: None)  # (no GPU here: the config alone)
    for device in ("cuda", "cuda:1"):
        assert budget(prefill_server, "--device", device) == 2048


def test_auto_is_the_cpu_on_a_host_without_cuda(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert budget(prefill_server, "--device", "auto") == 512


def test_colocated_and_offline_engines_keep_the_engines_default():
    ns = router_server.build_parser().parse_args(["--colocated", "--device", "cpu"])
    assert EngineArgs.from_cli_args(ns).create_engine_config().scheduler.max_num_batched_tokens == 2048
    assert EngineArgs(device="cpu").create_engine_config().scheduler.max_num_batched_tokens == 2048


@pytest.mark.parametrize("server", [prefill_server, decode_server])
def test_help_gives_both_defaults(server):
    text = server.build_parser().format_help()
    assert "(default: 2048; 512 for a prefill worker on the CPU)" in " ".join(text.split())
