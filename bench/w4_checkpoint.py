"""A random AutoAWQ (GEMM) checkpoint of a preset's exact shape, for speed runs of 4-bit weights.

  python bench/w4_checkpoint.py --preset qwen2.5-7b --out /tmp/qwen2.5-7b-awq
  python bench/throughput.py --model /tmp/qwen2.5-7b-awq --quantization awq --dtype float16 ...

Speed does not depend on the values, and a hub checkpoint cannot be fetched here, so every decoder linear is
written as random 4-bit words (qweight int32 [K, N/8], qzeros int32 [K/G, N/8]) with float16 scales [K/G, N]:
any int32 word is eight valid 4-bit values, whatever AWQ's order. Embeddings, norms, biases and lm_head stay in 16
bits, as AutoAWQ leaves them. The tensors are drawn on the GPU when there is one (a 7B checkpoint in seconds) and
written one decoder layer per shard. Correctness of the 4-bit path is tested on checkpoints quantized by the
formats' specifications (tests/engine/test_quant_w4.py), not here.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LINEARS = {  # module -> (outputs, inputs) as functions of the config
    "self_attn.q_proj": lambda c, hd: (c.num_attention_heads * hd, c.hidden_size),
    "self_attn.k_proj": lambda c, hd: (c.num_key_value_heads * hd, c.hidden_size),
    "self_attn.v_proj": lambda c, hd: (c.num_key_value_heads * hd, c.hidden_size),
    "self_attn.o_proj": lambda c, hd: (c.hidden_size, c.num_attention_heads * hd),
    "mlp.gate_proj": lambda c, hd: (c.intermediate_size, c.hidden_size),
    "mlp.up_proj": lambda c, hd: (c.intermediate_size, c.hidden_size),
    "mlp.down_proj": lambda c, hd: (c.hidden_size, c.intermediate_size),
}


def write(preset: str, out: Path, group_size: int = 128, seed: int = 0, scale: float = 0.02) -> Path:
    from safetensors.torch import save_file

    from engine.presets import preset_config
    from engine.tokenizer import synthetic_tokenizer

    config = preset_config(preset)
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device).manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    bias = getattr(config, "attention_bias", None)
    if bias is None:  # Qwen2's q/k/v carry biases (its config has no attention_bias field)
        bias = config.model_type == "qwen2"

    def normal(*shape) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).half().cpu()

    def words(*shape) -> torch.Tensor:
        return torch.randint(-2**31, 2**31 - 1, shape, generator=gen, device=device, dtype=torch.int32).cpu()

    index, shards = {}, []

    def save(name: str, tensors: dict) -> None:
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        index.update({k: name for k in tensors})
        shards.append(name)

    head = {"model.embed_tokens.weight": normal(config.vocab_size, config.hidden_size),
            "model.norm.weight": torch.ones(config.hidden_size, dtype=torch.float16)}
    if not config.tie_word_embeddings:
        head["lm_head.weight"] = normal(config.vocab_size, config.hidden_size)
    save("model-head.safetensors", head)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": torch.ones(config.hidden_size, dtype=torch.float16),
             p + "post_attention_layernorm.weight": torch.ones(config.hidden_size, dtype=torch.float16)}
        for module, shape in LINEARS.items():
            n, k = shape(config, hd)
            if k % group_size or n % 8:
                raise ValueError(f"{module}: {n} outputs x {k} inputs do not split into groups of {group_size} and "
                                 "words of 8 outputs")
            t[p + module + ".qweight"] = words(k, n // 8)
            t[p + module + ".qzeros"] = words(k // group_size, n // 8)
            # scales of about scale / 8: a random 4-bit weight minus its zero point is in [-15, 15]
            t[p + module + ".scales"] = (torch.rand(k // group_size, n, generator=gen, device=device)
                                         * scale / 8 + scale / 16).half().cpu()
            if bias and module.split(".")[1] in ("q_proj", "k_proj", "v_proj"):
                t[p + module + ".bias"] = normal(n)
        save(f"model-layer-{i:03d}.safetensors", t)
    cfg = config.to_dict()
    cfg["torch_dtype"] = "float16"
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                                  "version": "gemm", "modules_to_not_convert": None}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=2))
    synthetic_tokenizer(config.vocab_size).save_pretrained(str(out))  # what random:<preset> models use
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--out", required=True)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    out = write(args.preset, Path(args.out), args.group_size, args.seed)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"w4_checkpoint: {args.preset} AWQ g{args.group_size} in {out}: {size / 2**30:.2f} GiB, "
          f"{time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
