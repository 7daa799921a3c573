"""engine/loader.py: spec resolution, weight loading checked against transformers, GGUF cache, random init."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from engine import loader
from engine.loader import ResolvedModel, load_tokenizer, load_weights, resolve_model
from engine.tokenizer import synthetic_tokenizer

PROMPT_IDS = torch.tensor([[1, 7, 300, 42, 256, 99, 511, 3, 8, 200, 17, 64]])


def _reference_and_fresh(model_dir: Path, dtype=torch.float32):
    """The checkpoint as transformers loads it, and a same-config model with different random weights."""
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(1234)
    fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype).eval()
    return ref, fresh


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(PROMPT_IDS).logits


def _copy_dir_with(tmp_path: Path, src: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A model dir with src's config and tokenizer but the given tensors as its checkpoint."""
    out = tmp_path / "ckpt"
    out.mkdir()
    for f in src.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# --- resolve_model -----------------------------------------------------------------------------------------------


def test_resolve_random_preset():
    r = resolve_model("random:qwen2.5-7b")
    assert (r.spec, r.name, r.weights_dir, r.tokenizer_dir, r.random_seed) == (
        "random:qwen2.5-7b", "random:qwen2.5-7b", None, None, 0
    )
    assert r.config.architectures == ["Qwen2ForCausalLM"] and r.config.hidden_size == 3584


def test_resolve_hf_dir(tiny_llama_dir):
    r = resolve_model(str(tiny_llama_dir))
    assert r.name == tiny_llama_dir.name
    assert r.weights_dir == tiny_llama_dir and r.tokenizer_dir == tiny_llama_dir and r.random_seed is None
    assert r.config.architectures == ["LlamaForCausalLM"] and r.config.num_hidden_layers == 3


@pytest.mark.parametrize("spec", ["", "gpt-9", "random:nope", "/nonexistent/dir", "smollm3"])
def test_resolve_unknown_names_spec_and_forms(spec):
    with pytest.raises(ValueError) as e:
        resolve_model(spec)
    assert repr(spec) in str(e.value) and "random:<preset>" in str(e.value) and ".gguf" in str(e.value)


def test_resolve_dir_errors(tmp_path, tiny_llama_dir):
    no_config = tmp_path / "a"
    no_config.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(no_config))

    no_weights = tmp_path / "b"
    no_weights.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", no_weights / "config.json")
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        resolve_model(str(no_weights))

    gpt2 = tmp_path / "c"
    gpt2.mkdir()
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=8, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(gpt2)
    with pytest.raises(ValueError, match=r"architectures=\['GPT2LMHeadModel'\] is not supported"):
        resolve_model(str(gpt2))
    assert cfg["architectures"] == ["LlamaForCausalLM"]


# --- load_weights against transformers ----------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_llama3_dir", "tiny_mistral_dir"])
def test_load_weights_reproduces_transformers_logits(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    ref, fresh = _reference_and_fresh(model_dir)
    assert not torch.equal(_logits(ref), _logits(fresh))  # the fresh model really starts elsewhere
    load_weights(fresh, resolve_model(str(model_dir)))
    assert torch.equal(_logits(ref), _logits(fresh))
    for name, p in ref.named_parameters():
        assert torch.equal(p, fresh.get_parameter(name)), name


def test_qwen2_biases_are_loaded_and_nonzero(tiny_qwen2_dir):
    ref, fresh = _reference_and_fresh(tiny_qwen2_dir)
    load_weights(fresh, resolve_model(str(tiny_qwen2_dir)))
    bias = fresh.get_parameter("model.layers.0.self_attn.q_proj.bias")
    assert bias.abs().min() > 0 and torch.equal(bias, ref.get_parameter("model.layers.0.self_attn.q_proj.bias"))


def test_load_sharded_with_and_without_index(tmp_path, tiny_qwen2_dir):
    ref = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    sharded = tmp_path / "sharded"
    ref.save_pretrained(sharded, max_shard_size="40KB")
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) > 3 and (sharded / "model.safetensors.index.json").is_file()
    for with_index in (True, False):
        if not with_index:
            (sharded / "model.safetensors.index.json").unlink()
        _, fresh = _reference_and_fresh(tiny_qwen2_dir)
        load_weights(fresh, resolve_model(str(sharded)))
        assert torch.equal(_logits(ref), _logits(fresh))


def test_load_casts_to_param_dtype(tiny_llama_dir):
    ref, fresh = _reference_and_fresh(tiny_llama_dir, dtype=torch.bfloat16)
    load_weights(fresh, resolve_model(str(tiny_llama_dir)))
    for name, p in ref.named_parameters():
        q = fresh.get_parameter(name)
        assert q.dtype == torch.bfloat16 and torch.equal(q, p.to(torch.bfloat16)), name


def test_tied_checkpoint_ties_a_separate_lm_head(tiny_llama3_dir):
    ref, fresh = _reference_and_fresh(tiny_llama3_dir)
    # Our model may build lm_head as its own parameter; the loader must make it embed_tokens.
    fresh.lm_head.weight = torch.nn.Parameter(torch.randn_like(fresh.lm_head.weight))
    assert "lm_head.weight" not in load_file(str(tiny_llama3_dir / "model.safetensors"))
    load_weights(fresh, resolve_model(str(tiny_llama3_dir)))
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    assert torch.equal(_logits(ref), _logits(fresh))


def test_untied_checkpoint_unties_a_tied_model(tiny_llama_dir):
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    config.tie_word_embeddings = True
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    load_weights(fresh, resolve_model(str(tiny_llama_dir)))
    assert fresh.lm_head.weight is not fresh.model.embed_tokens.weight
    assert torch.equal(_logits(ref), _logits(fresh))


def test_tensor_in_two_shards_raises(tmp_path, tiny_llama_dir):
    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    d = _copy_dir_with(tmp_path, tiny_llama_dir, tensors)
    save_file({"model.norm.weight": tensors["model.norm.weight"]}, str(d / "extra.safetensors"))
    _, fresh = _reference_and_fresh(tiny_llama_dir)
    with pytest.raises(ValueError, match=r"duplicated=\['model.norm.weight in extra.safetensors and model.safetensors'\]"):
        load_weights(fresh, resolve_model(str(d)))


def test_untied_config_without_lm_head_ties(tmp_path, tiny_llama_dir):
    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    del tensors["lm_head.weight"]
    d = _copy_dir_with(tmp_path, tiny_llama_dir, tensors)
    _, fresh = _reference_and_fresh(tiny_llama_dir)
    load_weights(fresh, resolve_model(str(d)))
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    assert torch.equal(fresh.lm_head.weight, tensors["model.embed_tokens.weight"])


def test_rotary_inv_freq_in_checkpoint_is_ignored(tmp_path, tiny_llama_dir):
    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    d = _copy_dir_with(tmp_path, tiny_llama_dir, tensors)
    ref, fresh = _reference_and_fresh(tiny_llama_dir)
    load_weights(fresh, resolve_model(str(d)))
    assert torch.equal(_logits(ref), _logits(fresh))


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "missing=['model.layers.1.mlp.up_proj.weight']"),
        (lambda t: t.__setitem__("model.layers.9.mlp.extra", torch.ones(2)), "unexpected=['model.layers.9.mlp.extra']"),
        (
            lambda t: t.__setitem__("model.norm.weight", torch.ones(65)),
            "shape_mismatch=['model.norm.weight: checkpoint (65,) vs model (64,)']",
        ),
    ],
    ids=["missing", "unexpected", "shape"],
)
def test_mismatched_checkpoint_raises_naming_tensors(tmp_path, tiny_llama_dir, edit, expected):
    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    edit(tensors)
    d = _copy_dir_with(tmp_path, tiny_llama_dir, tensors)
    _, fresh = _reference_and_fresh(tiny_llama_dir)
    with pytest.raises(ValueError) as e:
        load_weights(fresh, resolve_model(str(d)))
    assert expected in str(e.value)


# --- random: weights ----------------------------------------------------------------------------------------------


def _random_model(preset: str, seed: int = 0):
    r = resolve_model(f"random:{preset}")
    r.random_seed = seed
    with torch.device("meta"):  # skip transformers' own (slow) init: load_weights does it
        model = AutoModelForCausalLM.from_config(r.config, dtype=torch.float32)
    model = model.to_empty(device="cpu")
    load_weights(model, r)
    return model


def test_random_init_is_deterministic_and_shaped():
    a, b, c = _random_model("tiny-qwen2"), _random_model("tiny-qwen2"), _random_model("tiny-qwen2", seed=1)
    for name, p in a.named_parameters():
        assert torch.equal(p, b.get_parameter(name)), name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert not torch.equal(p, c.get_parameter(name)), name
    assert a.get_parameter("model.layers.0.self_attn.k_proj.bias").abs().min() > 0
    w = a.get_parameter("model.layers.1.mlp.down_proj.weight")
    assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002


def test_random_init_ties_when_config_ties():
    model = _random_model("smollm2-135m")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_random_init_bf16_is_fast():
    r = resolve_model("random:smollm2-135m")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(r.config, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    t0 = time.process_time()  # this process's CPU time: other processes' load does not count
    load_weights(model, r)
    elapsed = time.process_time() - t0
    p = model.get_parameter("model.layers.29.self_attn.q_proj.weight")
    assert p.dtype == torch.bfloat16 and p.std().item() > 0.015
    assert elapsed < 10.0, f"random init of 135M params took {elapsed:.1f} s of CPU"


# --- tokenizers ---------------------------------------------------------------------------------------------------


def test_load_tokenizer_random_is_synthetic_of_vocab_size():
    tok = load_tokenizer(resolve_model("random:tiny"))
    assert len(tok) == 512 and tok.decode(tok.encode("héllo 🎉")) == "héllo 🎉"


def test_load_tokenizer_from_dir(tiny_qwen2_dir):
    # AutoTokenizer alone would pick Qwen2Tokenizer from config.json (NFC normalizer, a 513th token).
    tok = load_tokenizer(resolve_model(str(tiny_qwen2_dir)))
    assert len(tok) == 512 and tok.eos_token == "<|im_end|>" and tok.chat_template
    text = "he\u0301llo <|endoftext|>"  # decomposed é: NFC would change it
    assert tok.decode(tok.encode(text)) == text


def test_load_tokenizer_missing_files_raises(tmp_path, tiny_llama_dir):
    d = tmp_path / "m"
    d.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama_dir / name, d / name)
    r = resolve_model(str(d))
    assert r.tokenizer_dir is None
    with pytest.raises(ValueError, match="no tokenizer files"):
        load_tokenizer(r)


def test_load_tokenizer_override_is_loaded_in_place_of_the_models(tmp_path):
    synthetic_tokenizer(300).save_pretrained(tmp_path)
    tok = load_tokenizer(resolve_model("random:tiny"), str(tmp_path))
    assert len(tok) == 300 and tok.decode(tok.encode("héllo")) == "héllo"


def test_load_tokenizer_override_real_bpe_for_a_random_model(smollm2_dir):
    tok = load_tokenizer(resolve_model("random:qwen2.5-7b"), str(smollm2_dir))  # 49152 tokens, logits 152064 wide
    assert len(tok) == 49152 and (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.decode(tok.encode("The capital of France is Paris.")) == "The capital of France is Paris."


def test_load_tokenizer_override_larger_than_the_vocab_raises(tmp_path):
    synthetic_tokenizer(600).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"600 tokens, more than the vocab_size 512 of model='random:tiny'"):
        load_tokenizer(resolve_model("random:tiny"), str(tmp_path))


def test_load_tokenizer_override_without_files_raises(tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer=.*tokenizer\.json and tokenizer_config\.json"):
        load_tokenizer(resolve_model("random:tiny"), str(tmp_path))


# --- GGUF conversion cache ----------------------------------------------------------------------------------------


def test_smollm2_resolves_to_converted_cache(smollm2_dir):
    r = resolve_model("smollm2")
    assert r.name == "smollm2" and r.weights_dir == smollm2_dir == r.tokenizer_dir
    c = r.config
    assert c.architectures == ["LlamaForCausalLM"]
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (576, 30, 9, 3)
    assert (c.intermediate_size, c.vocab_size, c.tie_word_embeddings) == (1536, 49152, True)
    assert not hasattr(c, "quantization_config")
    names = set(load_file(str(smollm2_dir / "model.safetensors")).keys())
    assert "lm_head.weight" not in names and len(names) == 1 + 30 * 9 + 1
    tok = load_tokenizer(r)
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token_id) == ("<|im_end|>", 2, 1)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(tok.encode("The capital of France is Paris.")) == "The capital of France is Paris."


def test_smollm2_loads_into_transformers_and_knows_paris(smollm2_dir):
    r = resolve_model("smollm2")
    tok = load_tokenizer(r)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(r.config, dtype=torch.float32)
    model = model.to_empty(device="cpu")
    model.model.rotary_emb.__init__(r.config)  # buffers are not weights: rebuild inv_freq after to_empty
    load_weights(model, r)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True,
        return_tensors="pt", return_dict=True,
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A file standing for a GGUF, a private cache dir, and a slow fake converter that counts its calls."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF fake")
    calls = []

    def fake_convert(gguf, out):
        calls.append(gguf)
        time.sleep(0.3)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(loader, "_convert_gguf_into", fake_convert)
    return src, calls


def test_gguf_conversion_runs_once_under_concurrency(fake_gguf):
    src, calls = fake_gguf
    results = []
    threads = [threading.Thread(target=lambda: results.append(loader.convert_gguf(src, "m"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 4
    final = results[0]
    assert final.parent == loader.cache_root() and final.name.startswith("m-") and (final / "config.json").is_file()
    assert sorted(p.name for p in final.parent.iterdir()) == sorted([final.name, final.name + ".lock"])
    assert loader.convert_gguf(src, "m") == final and len(calls) == 1


def test_gguf_cache_key_follows_the_file(fake_gguf):
    src, calls = fake_gguf
    first = loader.convert_gguf(src, "m")
    src.write_bytes(b"GGUF fake, changed")
    second = loader.convert_gguf(src, "m")
    assert first != second and len(calls) == 2


def test_failed_gguf_conversion_leaves_nothing(fake_gguf, monkeypatch):
    src, _ = fake_gguf

    def broken(gguf, out):
        (out / "partial").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setattr(loader, "_convert_gguf_into", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        loader.convert_gguf(src, "m")
    assert [p.name for p in loader.cache_root().iterdir() if not p.name.endswith(".lock")] == []


def test_resolved_model_is_a_plain_dataclass():
    r = ResolvedModel("x", "x", resolve_model("random:tiny").config, None, None, 3)
    assert r.random_seed == 3


# --- the synthetic tokenizer (engine/tokenizer.py), as load_tokenizer gives it for random: models ------------------


def test_synthetic_tokenizer_layout():
    from engine.tokenizer import MIN_VOCAB_SIZE, synthetic_tokenizer

    tok = synthetic_tokenizer(1000)
    assert len(tok) == 1000 and MIN_VOCAB_SIZE == 260
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 259)
    assert tok.convert_tokens_to_ids("<|im_start|>") == 258
    assert tok.encode("AZ\n") == [65, 90, 10]  # a byte's id is the byte
    assert tok.decode([300, 999]) == "<f300><f999>"  # fillers decode to printable text
    assert tok.encode("a<|im_end|>") == [97, 257]  # specials in text are single tokens, as in HF tokenizers
    assert tok.decode([97, 257], skip_special_tokens=True) == "a"


def test_synthetic_tokenizer_round_trips_any_utf8():
    import random

    from engine.tokenizer import synthetic_tokenizer

    tok = synthetic_tokenizer(MIN := 260)
    rng = random.Random(0)
    fixed = ["", " ", "  leading and trailing  ", "\x00\x01\t\r\n", "e\u0301 vs \u00e9", "ﬁ", "日本語", "🎉👩‍👩‍👧",
             "\ud7ff\ue000\U0010ffff", "<f300> <|bos| > <|im_start"]
    randoms = ["".join(chr(rng.choice([rng.randrange(0x20, 0x7f), rng.randrange(0x80, 0xd800),
                                       rng.randrange(0xe000, 0x110000)])) for _ in range(rng.randrange(1, 40)))
               for _ in range(200)]
    for text in fixed + randoms:
        ids = tok.encode(text)
        assert all(i < 256 for i in ids) and len(ids) == len(text.encode("utf-8")), repr(text)
        assert tok.decode(ids) == text, repr(text)
    assert len(tok) == MIN


def test_synthetic_tokenizer_chat_template():
    from engine.tokenizer import synthetic_tokenizer

    tok = synthetic_tokenizer(512)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, tokenize=False).endswith("Hi<|im_end|>\n")


@pytest.mark.parametrize("vocab_size", [259, 0, "512", None])
def test_synthetic_tokenizer_too_small_vocab(vocab_size):
    from engine.tokenizer import synthetic_tokenizer

    with pytest.raises(ValueError, match=rf"vocab_size={vocab_size!r}: .*>= 260"):
        synthetic_tokenizer(vocab_size)


def test_synthetic_tokenizer_of_a_7b_vocab_builds_quickly():
    from engine.tokenizer import synthetic_tokenizer

    t0 = time.process_time()  # this process's CPU time: other processes' load does not count
    tok = synthetic_tokenizer(152064)
    assert len(tok) == 152064 and tok.decode([152063]) == "<f152063>"
    assert time.process_time() - t0 < 5.0


def test_resolve_a_gguf_path_uses_the_converted_dir(fake_gguf, monkeypatch, tiny_llama_dir):
    src, calls = fake_gguf
    monkeypatch.setattr(loader, "_convert_gguf_into", lambda gguf, out: (calls.append(gguf), shutil.copytree(
        tiny_llama_dir, out, dirs_exist_ok=True)))
    r = resolve_model(str(src))
    assert r.name == "m" and r.weights_dir == r.tokenizer_dir == loader.gguf_cache_dir(src, "m")
    assert r.config.architectures == ["LlamaForCausalLM"] and r.random_seed is None and calls == [src]
