"""engine/presets.py: each preset has its real architecture's exact shape."""

from __future__ import annotations

import json

import pytest
import torch

from engine.presets import PRESETS, preset_config


def _rope_theta(c) -> float:
    return c.rope_parameters["rope_theta"]


def _shape(c) -> tuple:
    return (
        c.architectures[0], c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
        c.intermediate_size, c.vocab_size, c.tie_word_embeddings, _rope_theta(c), c.rms_norm_eps,
        c.max_position_embeddings,
    )


def test_preset_names():
    assert sorted(PRESETS) == ["llama-3-8b", "qwen2.5-7b", "smollm2-135m", "tiny", "tiny-qwen2"]


@pytest.mark.parametrize(
    "name, shape",
    [
        ("smollm2-135m", ("LlamaForCausalLM", 576, 30, 9, 3, 1536, 49152, True, 100000.0, 1e-5, 8192)),
        ("qwen2.5-7b", ("Qwen2ForCausalLM", 3584, 28, 28, 4, 18944, 152064, False, 1e6, 1e-6, 32768)),
        ("llama-3-8b", ("LlamaForCausalLM", 4096, 32, 32, 8, 14336, 128256, False, 500000.0, 1e-5, 8192)),
        ("tiny", ("LlamaForCausalLM", 64, 2, 4, 2, 128, 512, False, 10000.0, 1e-5, 2048)),
        ("tiny-qwen2", ("Qwen2ForCausalLM", 64, 2, 4, 2, 128, 512, False, 1e6, 1e-6, 2048)),
    ],
)
def test_preset_shapes(name, shape):
    c = preset_config(name)
    assert _shape(c) == shape
    assert c.dtype == torch.bfloat16
    assert c.rope_parameters["rope_type"] == "default"
    expected_head_dim = {"smollm2-135m": 64, "qwen2.5-7b": 128, "llama-3-8b": 128}.get(name, 16)
    assert (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads) == expected_head_dim


def test_qwen2_presets_use_full_attention():
    for name in ("qwen2.5-7b", "tiny-qwen2"):
        assert preset_config(name).use_sliding_window is False


def test_smollm2_preset_matches_the_converted_checkpoint(smollm2_dir):
    real = json.loads((smollm2_dir / "config.json").read_text())
    c = preset_config("smollm2-135m")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "tie_word_embeddings", "max_position_embeddings"):
        assert getattr(c, key) == real[key], key
    assert _rope_theta(c) == real["rope_parameters"]["rope_theta"]
    assert c.rms_norm_eps == pytest.approx(real["rms_norm_eps"], rel=1e-6)  # the GGUF stores eps as float32


def test_preset_config_returns_a_fresh_object():
    a = preset_config("tiny")
    a.num_hidden_layers = 99
    assert preset_config("tiny").num_hidden_layers == 2


def test_unknown_preset_names_value_and_choices():
    with pytest.raises(ValueError) as e:
        preset_config("llama-9")
    msg = str(e.value)
    assert "preset='llama-9'" in msg and "qwen2.5-7b" in msg and "random:tiny" in msg


def test_random_presets_fit_the_synthetic_tokenizer():
    from engine.tokenizer import synthetic_tokenizer

    for name in PRESETS:
        c = preset_config(name)
        tok = synthetic_tokenizer(512)
        assert (c.bos_token_id, c.eos_token_id) == (tok.bos_token_id, tok.eos_token_id), name
