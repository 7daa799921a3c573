"""Tandem's engine core: the model, its KV cache, the scheduler and the sampler of one engine (tensor-parallel workers
included), stepped by LLMEngine: requests in, per-step token deltas out. `from engine import LLM, SamplingParams`
mirrors vLLM's offline API; the prefill and decode services run an LLMEngine each.

What it may import: the standard library, torch, numpy, transformers (and the tokenizers and safetensors it brings),
kernels/, and its own modules. Never a service (prefill_svc/, decode_svc/), serving/, kv_transfer/, router/, protos/
or the CLI: they sit above the engine and import it, so imports point down.
"""
from engine.args import EngineArgs
from engine.llm import LLM, CompletionOutput, RequestOutput
from engine.llm_engine import LLMEngine, StepOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "StepOutput", "RequestOutput", "CompletionOutput"]
