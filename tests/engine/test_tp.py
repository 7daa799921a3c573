"""Tensor parallelism on the CPU: 2 gloo ranks running the sharded model give one process's logits."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _logits(model, tokens: list[int], num_kv_heads: int) -> torch.Tensor:
    """One prefill of `tokens`, then one decode of token 7, through a private paged cache; logits of both."""
    from engine.model import AttentionMetadata, LayerKV

    n, bs = len(tokens), 16
    layers = model.config.num_hidden_layers
    cache = torch.zeros(8, layers, 2, bs, num_kv_heads, model.head_dim)
    kv = [LayerKV(cache[:, l, 0], cache[:, l, 1]) for l in range(layers)]
    tables = torch.arange(8, dtype=torch.int32)[None]
    out = []
    for ids, pos in ((tokens, list(range(n))), ([7], [n])):
        meta = AttentionMetadata(slot_mapping=torch.tensor(pos), block_tables=tables,
                                 seq_lens=torch.tensor([pos[-1] + 1], dtype=torch.int32),
                                 query_start_loc=torch.tensor([0, len(ids)], dtype=torch.int32),
                                 max_query_len=len(ids), max_seq_len=pos[-1] + 1)
        with torch.inference_mode():
            h = model(torch.tensor(ids), torch.tensor(pos), kv, meta)
            out.append(model.compute_logits(h))
    return torch.cat(out)


def _load(model_dir):
    from engine.loader import load_weights, resolve_model
    from engine.model import LlamaForCausalLM

    resolved = resolve_model(str(model_dir))
    model = LlamaForCausalLM(resolved.config)
    model.tie_weights()
    load_weights(model, resolved)
    model.cos_sin_cache = model.cos_sin_cache.float()
    return model.eval()


def _worker(rank: int, world: int, store: str, model_dir: str, tokens: list[int], queue) -> None:
    torch.set_num_threads(1)
    # A file rendezvous: no port to race for.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        from engine.tp import shard_model

        model = shard_model(_load(model_dir), rank, world)
        model.fuse_projections()
        logits = _logits(model, tokens, model.config.num_key_value_heads // world)
        if rank == 0:
            queue.put(logits.numpy())  # by value: a shared-memory tensor dies with this process
        # Both ranks leave together: a rank tearing gloo down while its peer's pair thread still runs aborted that
        # peer once ("terminate called without an active exception", exit code -6) in a loaded full-suite run.
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_two_gloo_ranks_equal_one_process(request, fixture, tmp_path):
    model_dir = request.getfixturevalue(fixture)
    tokens = [(i * 13) % 500 + 3 for i in range(40)]
    ref = _logits(_load(model_dir), tokens, 2)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = str(tmp_path / "rendezvous")
    procs = [ctx.Process(target=_worker, args=(r, 2, store, str(model_dir), tokens, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = torch.from_numpy(queue.get(timeout=120))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_world_size_must_divide_heads(tiny_llama_dir):
    from engine.tp import shard_model

    with pytest.raises(ValueError, match="tensor_parallel_size=3: must divide num_attention_heads=4"):
        shard_model(_load(tiny_llama_dir), 0, 3)
