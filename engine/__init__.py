"""Tandem's engine core: `from engine import LLM, SamplingParams` mirrors vLLM's offline API."""
from engine.args import EngineArgs
from engine.llm import LLM, CompletionOutput, RequestOutput
from engine.llm_engine import LLMEngine, StepOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "StepOutput", "RequestOutput", "CompletionOutput"]
