"""Greedy parity with SmolLM2 on the CPU: bench/parity.py's 21 prompts (English, Chinese, code, chat), Tandem
against transformers token for token; and against vLLM where a vLLM venv is found ($VLLM_PYTHON or ../vllm-venv:
CI has none, so that test skips)."""
from __future__ import annotations

import pytest

from bench.parity import hf_greedy, prompt_ids, tandem_greedy
from bench.vllm_backend import default_python

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    from engine.loader import load_tokenizer, resolve_model

    labels, ids = prompt_ids(load_tokenizer(resolve_model("smollm2")))
    assert len(ids) == 21
    return ids


@pytest.fixture(scope="module")
def tandem(prompts):
    return tandem_greedy(prompts, MAX_TOKENS)


@pytest.mark.slow
def test_tandem_matches_transformers(smollm2_dir, prompts, tandem):
    assert tandem == hf_greedy(smollm2_dir, prompts, MAX_TOKENS)


@pytest.mark.slow
@pytest.mark.skipif(default_python() is None, reason="no vLLM venv ($VLLM_PYTHON or ../vllm-venv): vLLM is optional")
def test_tandem_matches_vllm(smollm2_dir, prompts, tandem):
    from bench.vllm_backend import run_vllm_offline

    tokens, _, _ = run_vllm_offline(default_python(), smollm2_dir, prompts, MAX_TOKENS)
    assert tandem == tokens
