"""serving/metrics.py and router/metrics.py: the prefix, the families each role exports, vLLM's buckets, and the
router's per-request observations, checked in the default registry."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from router.metrics import RequestMetrics
from serving.metrics import FAMILIES, Metrics, build_1_2_5_buckets, prefix, set_prefix

ROOT = Path(__file__).resolve().parents[2]


def sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(f"tandem:{name}", labels) or 0.0


def test_buckets_are_vllms_1_2_5():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(1024)[-3:] == [200, 500, 1000]


def test_a_bad_prefix_names_the_flag_and_a_late_one_is_refused():
    Metrics("unit", "router")  # (families exist from here on, under the default prefix)
    with pytest.raises(ValueError, match="--metrics-prefix='vllm:'"):
        set_prefix("vllm:")
    with pytest.raises(RuntimeError, match="after"):
        set_prefix("vllm")
    set_prefix(prefix())  # the same one again is fine


def test_the_vllm_prefix_names_every_family_in_a_fresh_process():
    code = ("from prometheus_client import generate_latest; from serving.metrics import Metrics, set_prefix; "
            "set_prefix('vllm'); Metrics('m', 'router', 100); Metrics('m', 'decode'); "
            "print(generate_latest().decode())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=True).stdout
    names = {line.split("{")[0].split(" ")[0] for line in out.splitlines() if line.startswith("vllm:")}
    assert "vllm:request_params_max_tokens_bucket" in names and "vllm:kv_cache_usage_perc" in names
    assert 'vllm:request_params_max_tokens_bucket{le="100.0",model_name="m",role="router"} 0.0' in out
    assert not [line for line in out.splitlines() if line.startswith("tandem")]


def test_each_role_exports_only_what_it_records():
    colocated, router = Metrics("unit-c", "colocated"), Metrics("unit-c", "router")
    prefill = Metrics("unit-c", "prefill")
    assert colocated.time_to_first_token_seconds is None and colocated.request_success is None
    assert router.kv_cache_usage_perc is None and router.iteration_tokens_total is None
    assert prefill.time_to_first_token_seconds is not None and prefill.request_queue_time_seconds is None
    assert REGISTRY.get_sample_value("tandem:time_to_first_token_seconds_count",
                                     {"model_name": "unit-c", "role": "colocated"}) is None
    assert sample("time_to_first_token_seconds_count", model_name="unit-c", role="router") == 0.0
    assert all(role in ("router", "prefill", "decode", "colocated") for f in FAMILIES.values() for role in f.roles)


def test_an_engine_step_observes_its_tokens_and_the_cache_config():
    m = Metrics("unit-e", "colocated")
    stats = SimpleNamespace(num_running=2, num_waiting=1, kv_cache_usage=0.5, prefix_cache_queries=32,
                            prefix_cache_hits=16, num_preemptions=0, num_step_tokens=40)
    m.observe_step(stats)
    m.observe_step(SimpleNamespace(**{**vars(stats), "num_step_tokens": 0}))  # an empty step: not a batch
    lv = dict(model_name="unit-e", role="colocated")
    assert sample("iteration_tokens_total_count", **lv) == 1 and sample("iteration_tokens_total_sum", **lv) == 40
    assert sample("iteration_tokens_total_bucket", le="32.0", **lv) == 0
    assert sample("iteration_tokens_total_bucket", le="64.0", **lv) == 1
    assert sample("prefix_cache_hits_total", **lv) == 16  # totals, counted once
    cache = SimpleNamespace(block_size=16, kv_cache_dtype="auto", enable_prefix_caching=True,
                            gpu_memory_utilization=0.9, num_gpu_blocks_override=None)
    m.observe_cache_config(cache, 512)
    assert sample("cache_config_info", block_size="16", cache_dtype="auto", enable_prefix_caching="True",
                  gpu_memory_utilization="0.9", num_gpu_blocks="512", num_gpu_blocks_override="None", **lv) == 1


def test_the_host_tier_counters_follow_the_engine_totals():
    m = Metrics("unit-h", "decode")
    base = dict(num_running=1, num_waiting=2, kv_cache_usage=0.9, prefix_cache_queries=0, prefix_cache_hits=0,
                num_preemptions=3, num_step_tokens=8, num_host_blocks=10, num_host_used_blocks=4, num_swapped=1,
                num_swaps=2, swapped_out_blocks=12, swapped_in_blocks=5, host_stored_blocks=7, host_prefix_hits=32)
    m.observe_step(SimpleNamespace(**base))
    m.observe_step(SimpleNamespace(**{**base, "swapped_in_blocks": 12, "num_swapped": 0, "num_host_used_blocks": 2}))
    lv = dict(model_name="unit-h", role="decode")
    assert sample("cpu_cache_usage_perc", **lv) == 0.2 and sample("num_requests_swapped", **lv) == 0
    assert sample("num_swaps_total", **lv) == 2 and sample("num_preemptions_total", **lv) == 3
    assert sample("kv_swapped_out_blocks_total", **lv) == 12 and sample("kv_swapped_in_blocks_total", **lv) == 12
    assert sample("cpu_prefix_cache_stored_blocks_total", **lv) == 7
    assert sample("cpu_prefix_cache_hits_total", **lv) == 32


def test_the_router_observes_a_request_once_and_each_completion():
    m = Metrics("unit-r", "router", max_model_len=256)
    lv = dict(model_name="unit-r", role="router")
    rm = RequestMetrics(m, arrival=0.0, num_prompt_tokens=10, n=2, max_tokens=5)
    delta = SimpleNamespace
    for index, ids, reason in ((0, [1], None), (1, [2], None), (0, [3, 4], "length"), (1, [5], "stop")):
        rm.delta(delta(index=index, token_ids=ids, finish_reason=reason))
    rm.done()
    rm.finished("stop")
    assert sample("request_params_n_count", **lv) == 1 and sample("request_params_n_sum", **lv) == 2
    assert sample("request_params_max_tokens_sum", **lv) == 5
    assert sample("request_queue_time_seconds_count", **lv) == 1
    assert sample("time_to_first_token_seconds_count", **lv) == 1
    assert sample("inter_token_latency_seconds_count", **lv) == 3 == sample("time_per_output_token_seconds_count", **lv)
    assert sample("request_generation_tokens_count", **lv) == 2 and sample("request_generation_tokens_sum", **lv) == 5
    assert sample("request_prompt_tokens_sum", **lv) == 20  # once per completion
    assert sample("generation_tokens_total", **lv) == 5 and sample("prompt_tokens_total", **lv) == 10
    for phase in ("prefill", "decode", "inference"):
        assert sample(f"request_{phase}_time_seconds_count", **lv) == 1
    assert sample("e2e_request_latency_seconds_count", **lv) == 1
    assert sample("request_success_total", finished_reason="stop", **lv) == 1


def test_every_role_takes_the_prefix_flag_and_tandem_up_passes_it_on():
    from cli.up import build_parser, launch_commands

    for colocated in ([], ["--colocated"]):
        cmds = launch_commands(build_parser().parse_args(["--metrics-prefix", "vllm", *colocated]))
        assert all(cmd[cmd.index("--metrics-prefix") + 1] == "vllm" for cmd in cmds.values()), cmds
    default = launch_commands(build_parser().parse_args([]))
    assert not [cmd for cmd in default.values() if "--metrics-prefix" in cmd]  # compose.yaml's lines stay as they are


@pytest.mark.parametrize("role", ["router", "prefill", "decode", "up"])
def test_a_bad_prefix_is_a_usage_error_on_every_role(role, capsys):
    import cli.up
    import decode_svc.server
    import prefill_svc.server
    import router.server

    main = {"router": lambda argv: router.server.main(["--colocated", *argv]), "prefill": prefill_svc.server.main,
            "decode": decode_svc.server.main, "up": cli.up.main}[role]
    with pytest.raises(SystemExit) as e:
        main(["--metrics-prefix", "9lives"])
    assert e.value.code == 2 and "--metrics-prefix='9lives'" in capsys.readouterr().err
