"""Configs of real architectures for `random:<preset>` models (random weights, real shapes).

`tiny` and `tiny-qwen2` are for CPU tests; `smollm2-135m`, `qwen2.5-7b` and `llama-3-8b` have the exact shapes of
those checkpoints, for sizing (`tandem plan`) and GPU benchmarks. All are bfloat16. transformers 5 keeps rope
settings in `config.rope_parameters`.
"""

from __future__ import annotations

from typing import Callable

from transformers import LlamaConfig, PretrainedConfig, Qwen2Config

from engine.tokenizer import BOS_TOKEN, EOS_TOKEN, NUM_BYTE_TOKENS, SPECIAL_TOKENS

# Random models use the synthetic tokenizer, whose special-token ids are fixed.
_BOS_ID = NUM_BYTE_TOKENS + SPECIAL_TOKENS.index(BOS_TOKEN)
_EOS_ID = NUM_BYTE_TOKENS + SPECIAL_TOKENS.index(EOS_TOKEN)


def _llama(**kw) -> LlamaConfig:
    return LlamaConfig(
        architectures=["LlamaForCausalLM"], dtype="bfloat16", bos_token_id=_BOS_ID, eos_token_id=_EOS_ID, **kw
    )


def _qwen2(**kw) -> Qwen2Config:
    return Qwen2Config(
        architectures=["Qwen2ForCausalLM"], dtype="bfloat16", bos_token_id=_BOS_ID, eos_token_id=_EOS_ID, **kw
    )


def tiny() -> PretrainedConfig:
    return _llama(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def tiny_qwen2() -> PretrainedConfig:
    return _qwen2(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


def smollm2_135m() -> PretrainedConfig:
    return _llama(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )


def qwen2_5_7b() -> PretrainedConfig:
    return _qwen2(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        vocab_size=152064, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )


def llama_3_8b() -> PretrainedConfig:
    return _llama(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )


PRESETS: dict[str, Callable[[], PretrainedConfig]] = {
    "tiny": tiny,
    "tiny-qwen2": tiny_qwen2,
    "smollm2-135m": smollm2_135m,
    "qwen2.5-7b": qwen2_5_7b,
    "llama-3-8b": llama_3_8b,
}


def preset_config(name: str) -> PretrainedConfig:
    """A fresh config for preset `name`; an unknown name raises ValueError listing the presets."""
    try:
        factory = PRESETS[name]
    except KeyError:
        raise ValueError(
            f"preset={name!r}: unknown random-model preset; use one of {', '.join(sorted(PRESETS))} "
            f"(e.g. --model random:tiny)"
        ) from None
    return factory()
