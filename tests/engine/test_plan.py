"""engine/plan.py: exact KV sizing arithmetic, parameter counts equal to transformers' models, the CLI's errors."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine.plan import count_params, main, parse_size, plan
from engine.presets import PRESETS, preset_config

GiB = 2**30


def test_qwen2_5_7b_at_80gib():
    p = plan("random:qwen2.5-7b", 80 * GiB, 4096)
    assert (p.dtype, p.kv_cache_dtype) == ("bfloat16", "bfloat16")
    assert p.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2 == 57344
    assert p.num_params == 7_615_616_512  # Qwen2.5-7B's published count
    assert p.weight_bytes == 15_231_233_024
    assert p.kv_memory_bytes == 77_309_411_328 - 15_231_233_024 == 62_078_178_304  # 80 GiB * 0.9 - weights
    assert p.num_blocks == 62_078_178_304 // (16 * 57344) == 67_659
    assert p.max_kv_tokens == 67_659 * 16 == 1_082_544
    assert p.max_num_seqs_at_max_len == 67_659 // (4096 // 16) == 264
    assert p.fits


def test_llama_3_8b_fp8_kv():
    p = plan("random:llama-3-8b", 24 * 10**9, 8192, kv_cache_dtype="fp8", gpu_memory_utilization=0.95)
    assert p.kv_cache_dtype == "fp8_e4m3"
    assert p.kv_bytes_per_token == 2 * 32 * 8 * 128 * 1 == 65536
    assert p.num_params == 8_030_261_248  # Llama-3-8B's published count
    assert p.kv_memory_bytes == 22_800_000_000 - 2 * 8_030_261_248 == 6_739_477_504
    assert p.num_blocks == 6_739_477_504 // (16 * 65536) == 6427
    assert p.max_num_seqs_at_max_len == 6427 // 512 == 12


def test_smollm2_float32_and_partial_last_block():
    p = plan("random:smollm2-135m", 2 * GiB, 1000, dtype="float32", gpu_memory_utilization=1.0, block_size=16)
    assert p.num_params == 134_515_008
    assert p.weight_bytes == 4 * 134_515_008
    assert p.kv_cache_dtype == "float32" and p.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46080
    assert p.num_blocks == (2 * GiB - 4 * 134_515_008) // (16 * 46080) == 2182
    assert p.max_num_seqs_at_max_len == 2182 // 63 == 34  # 1000 tokens need ceil(1000/16) = 63 blocks


def test_weights_that_do_not_fit_are_an_ordinary_result():
    p = plan("random:qwen2.5-7b", 8 * GiB, 4096)
    assert p.kv_memory_bytes < 0 and p.num_blocks == p.max_kv_tokens == p.max_num_seqs_at_max_len == 0
    assert not p.fits


def test_plan_of_a_hf_dir_reads_its_config(tiny_qwen2_dir):
    p = plan(str(tiny_qwen2_dir), 64 * 2**20, 2048, dtype="float16")
    assert p.architecture == "Qwen2ForCausalLM"
    assert p.kv_bytes_per_token == 2 * 3 * 2 * 16 * 2
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)
    assert p.num_params == sum(t.numel() for t in model.parameters())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_count_params_equals_transformers(name):
    config = preset_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert count_params(config) == sum(t.numel() for t in model.parameters())


@pytest.mark.parametrize("extra", [dict(attention_bias=True), dict(mlp_bias=True), dict(head_dim=32)])
def test_count_params_llama_variants(extra):
    config = preset_config("tiny")
    for k, v in extra.items():
        setattr(config, k, v)
    config = AutoConfig.for_model(**config.to_dict())
    model = AutoModelForCausalLM.from_config(config)
    assert count_params(config) == sum(t.numel() for t in model.parameters())


@pytest.mark.parametrize(
    "text, expected",
    [("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("512MiB", 512 * 2**20), ("1.5GiB", 3 * 2**29),
     ("1024", 1024), ("2 TiB", 2 * 2**40), ("80gib", 80 * 2**30), ("7KB", 7000)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "80XB", "-1GiB", "0", "eighty", "80 G i B"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match=r"--memory="):
        parse_size(text)


@pytest.mark.parametrize(
    "bad, flag",
    [
        (["--memory", "80XB"], "--memory='80XB'"),
        (["--max-model-len", "4k"], "--max-model-len='4k'"),
        (["--max-model-len", "0"], "--max-model-len='0'"),
        (["--max-model-len", "40000"], "--max-model-len=40000: must be <= 32768"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization='1.5'"),
        (["--dtype", "fp13"], "--dtype='fp13'"),
        (["--kv-cache-dtype", "int3"], "--kv-cache-dtype='int3'"),
        (["--model", "random:nope"], "--model='random:nope'"),
    ],
)
def test_cli_errors_name_the_flag(bad, flag, capsys):
    args = {"--model": "random:qwen2.5-7b", "--memory": "80GiB", "--max-model-len": "4096"}
    args.update(dict(zip(bad[::2], bad[1::2])))
    with pytest.raises(SystemExit) as e:
        main([x for kv in args.items() for x in kv])
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_cli_prints_the_table(capsys):
    rc = main(["--model", "random:qwen2.5-7b", "--memory", "80GiB", "--max-model-len", "4096"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "57,344 = 2 x 28 layers x 4 kv heads x 128 head_dim x 2 B" in out
    assert "7,615,616,512" in out and "1,082,544" in out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("sequences of 4,096 tokens")]
    assert line.split()[-1] == "264"


def test_cli_exit_status_when_nothing_fits(capsys):
    assert main(["--model", "random:qwen2.5-7b", "--memory", "8GiB", "--max-model-len", "4096"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_fp8_weights_qwen2_5_7b():
    p = plan("random:qwen2.5-7b", 80 * GiB, 4096, quantization="fp8")
    linear = 28 * (4608 * 3584 + 3584 * 3584 + 37888 * 3584 + 3584 * 18944)  # fused qkv, o, gate_up, down
    scales = 28 * (4608 + 3584 + 37888 + 3584) * 4
    assert linear == 6_525_288_448
    assert p.weight_bytes == 15_231_233_024 - linear + scales == 8_711_506_944
    assert p.num_blocks == (77_309_411_328 - 8_711_506_944) // (16 * 57344)
    with pytest.raises(ValueError, match=r"quantization='int4': must be one of None, fp8"):
        plan("random:qwen2.5-7b", 80 * GiB, 4096, quantization="int4")


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_weight_bytes_equal_the_engines_model(quantization):
    """The plan's weight bytes are what the engine's loaded model holds (float32 on the CPU: fp8 weights 1 byte,
    scales and everything else 4)."""
    from engine import LLM
    from engine.plan import weight_bytes_of

    llm = LLM("random:tiny-qwen2", device="cpu", kv_cache_memory=0.01, max_model_len=256, quantization=quantization)
    model = llm.engine.runner.model
    held = sum(t.numel() * t.element_size() for t in model.parameters())
    held += sum(t.numel() * t.element_size() for name, t in model.named_buffers() if name != "cos_sin_cache")
    assert held == weight_bytes_of(llm.engine.resolved.config, "float32", quantization)


@pytest.mark.parametrize("method, per_channel, static, ignore", [
    ("compressed-tensors", True, False, ("model.layers.1.mlp.down_proj",)),
    ("fp8", False, True, ()),
])
def test_weight_bytes_of_an_fp8_checkpoint_equal_the_engines_model(tiny_qwen2_dir, tmp_path, method, per_channel,
                                                                   static, ignore):
    """A checkpoint stored in fp8 is sized as the engine loads it, with or without quantization='fp8': fp8 linears
    at 1 byte + a float32 scale per channel (+ a static input scale per fused linear), ignored linears and the rest
    in the model dtype (float32 on the CPU)."""
    import sys
    from pathlib import Path

    from engine import LLM
    from engine.plan import weight_bytes_of
    from engine.quant import Fp8Linear

    sys.path.insert(0, str(Path(__file__).parent))
    from test_quant import write_fp8_checkpoint

    ckpt = write_fp8_checkpoint(tiny_qwen2_dir, tmp_path / "fp8", method, per_channel, static, ignore=ignore)
    llm = LLM(str(ckpt), device="cpu", kv_cache_memory=0.01, max_model_len=256)
    model = llm.engine.runner.model
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == 3 * 4 - len(ignore)
    held = sum(t.numel() * t.element_size() for t in model.parameters())
    config = llm.engine.resolved.config
    assert held == weight_bytes_of(config, "float32") == weight_bytes_of(config, "float32", "fp8")
    assert held < weight_bytes_of(AutoConfig.from_pretrained(tiny_qwen2_dir), "float32")
    p = plan(str(ckpt), 1 * GiB, 256, dtype="bfloat16")
    assert p.quantization == "fp8" and p.weight_bytes == weight_bytes_of(config, "bfloat16", "fp8")


def test_cli_quantization(capsys):
    assert main(["--model", "random:qwen2.5-7b", "--memory", "80GiB", "--max-model-len", "4096",
                 "--quantization", "fp8"]) == 0
    assert "weights (bfloat16, layer linears fp8)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--model", "random:qwen2.5-7b", "--memory", "80GiB", "--max-model-len", "4096", "--quantization", "x"])
    assert "--quantization='x': must be one of None, fp8" in capsys.readouterr().err
