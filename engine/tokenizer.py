"""A synthetic byte-level tokenizer for random models of any vocabulary size.

Built in code from a `tokenizers` model, so no file comes from a hub. Token ids:

    0..255                     one token per byte (GPT-2 byte-to-unicode alphabet); encoding only ever emits these
    256..256+len(SPECIAL)-1    special tokens: bos, eos, chat markers, pad
    the rest, up to vocab_size filler tokens "<fN>" that decode to printable ASCII and are never produced by encoding

Encoding then decoding any UTF-8 text gives it back exactly (no normalizer, no merges, byte-level decoder).

`tokenizer_fingerprint` (any tokenizer, not only these) is what the workers report in GetLoad and the router compares
with its own: the router tokenizes what the workers detokenize, so both must have loaded the same vocabulary.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|im_end|>"
IM_START_TOKEN = "<|im_start|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, PAD_TOKEN]
SYNTHETIC_MARK = "tandem_synthetic_tokenizer"
NUM_BYTE_TOKENS = 256
MIN_VOCAB_SIZE = NUM_BYTE_TOKENS + len(SPECIAL_TOKENS)

# ChatML, the template of Qwen2 and SmolLM2; an assistant turn ends with the eos token.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@lru_cache(maxsize=None)
def _bytes_to_unicode() -> tuple[str, ...]:
    """GPT-2's printable stand-in character for each byte value (the ByteLevel alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return tuple(chr(table[b]) for b in range(256))


def synthetic_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with exactly `vocab_size` tokens (see the module docstring for the id layout)."""
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size!r}: the synthetic tokenizer needs an int >= {MIN_VOCAB_SIZE} "
            f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens); use a config with a larger vocab_size"
        )
    vocab: dict[str, int] = {ch: i for i, ch in enumerate(_bytes_to_unicode())}
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = NUM_BYTE_TOKENS + i
    for i in range(MIN_VOCAB_SIZE, vocab_size):
        vocab[f"<f{i}>"] = i  # ASCII '!'..'~' are their own ByteLevel stand-ins, so this decodes to "<fN>"
    assert len(vocab) == vocab_size
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # Specials are already in the vocab at their ids; registering them makes the encoder match them as one token.
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )
    fast.chat_template = CHAT_TEMPLATE
    # Saved into tokenizer_config.json. AutoTokenizer picks the class from config.json's model_type for some models
    # (a Qwen2 dir gets Qwen2Tokenizer, which adds an NFC normalizer and a 513th token), so engine.loader reads this
    # mark and loads the saved tokenizer.json as it is.
    fast.init_kwargs[SYNTHETIC_MARK] = True
    return fast


def is_synthetic(tokenizer_dir) -> bool:
    """Whether `tokenizer_dir` holds a tokenizer saved from synthetic_tokenizer()."""
    path = Path(tokenizer_dir) / "tokenizer_config.json"
    return path.is_file() and bool(json.loads(path.read_text()).get(SYNTHETIC_MARK, False))


def load_synthetic(tokenizer_dir) -> PreTrainedTokenizerFast:
    """Load a saved synthetic tokenizer exactly as saved (bypassing AutoTokenizer's choice of class)."""
    return PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir), local_files_only=True)


FINGERPRINT_VERSION = "v1"


def tokenizer_fingerprint(tokenizer) -> str:
    """A short stable hash of what makes token ids mean the same text: every token and its id (added tokens
    included), and the special tokens with their roles. "v1:" + 16 hex digits of a SHA-256. Computed once at
    startup (a 150k-token vocabulary takes a fraction of a second); the same tokenizer files give the same value in
    every process (the synthetic tokenizer of a `random:` model is built from its vocab_size alone), a tokenizer
    that maps any token differently another one. The chat template and the normalizer are left out: only the
    router, which renders and encodes, uses them; the ids it sends mean the same text to any worker with this
    fingerprint."""
    h = hashlib.sha256()
    vocab = sorted((i, t) for t, i in tokenizer.get_vocab().items())
    h.update("\0".join(f"{i}\1{t}" for i, t in vocab).encode("utf-8", "surrogatepass"))
    roles = sorted((role, str(tok)) for role, tok in tokenizer.special_tokens_map.items())
    special = sorted(str(t) for t in tokenizer.all_special_tokens)
    h.update(json.dumps({"roles": roles, "special": special}, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    return f"{FINGERPRINT_VERSION}:{h.hexdigest()[:16]}"
