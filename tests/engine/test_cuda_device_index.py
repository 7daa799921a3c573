"""An engine on a second GPU (`--device cuda:1`) runs there and decodes what one on cuda:0 does: Triton launches,
CUDA graph replays and events follow the thread's current device, which the runner sets (engine/model_runner.py
use_device). Skipped with fewer than two GPUs."""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]


def test_an_engine_on_cuda_1_matches_cuda_0_with_graphs_and_async_scheduling():
    from engine import LLM, SamplingParams

    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 500, (n,), generator=gen).tolist()} for n in (3, 40, 130)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    out = {}
    for dev in ("cuda:0", "cuda:1"):
        torch.cuda.set_device(0)  # the caller's thread starts elsewhere: the engine must move itself
        llm = LLM("random:tiny", device=dev, dtype="float32", kv_cache_memory=0.0625, max_num_batched_tokens=64,
                  max_model_len=512, enforce_eager=False, async_scheduling=True)
        assert llm.engine.kv_cache.device == torch.device(dev)
        out[dev] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
    assert out["cuda:1"] == out["cuda:0"]
    assert all(len(t) == 16 for t in out["cuda:0"])
