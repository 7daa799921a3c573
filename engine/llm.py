"""The offline API, mirroring vLLM's: `LLM(model=...).generate(prompts, sampling_params)` and `LLM.chat(messages)`."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from engine.args import EngineArgs
from engine.llm_engine import LLMEngine, gc_frozen
from engine.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0


PromptType = str | list[int] | dict[str, Any]


class LLM:
    """`LLM(model, **engine_args)`: any EngineArgs field (vLLM's names) is accepted as a keyword."""

    def __init__(self, model: str, **engine_args: Any):
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_args))
        self.engine.stream_text = False
        self._ids = itertools.count()

    def close(self) -> None:
        """Stops the engine's tensor-parallel workers, if any (also done at interpreter exit)."""
        self.engine.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | list[PromptType] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 prompt_token_ids: list[list[int]] | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """prompts: a string, a list of strings, {"prompt_token_ids": [...]} dicts, or (like vLLM's old API)
        prompt_token_ids=[[...], ...]. Returns one RequestOutput per prompt, in order."""
        if prompt_token_ids is not None:
            items: list[PromptType] = [{"prompt_token_ids": ids} for ids in prompt_token_ids]
        elif isinstance(prompts, (str, dict)):
            items = [prompts]
        elif prompts and isinstance(prompts[0], int):
            items = [{"prompt_token_ids": prompts}]
        else:
            items = list(prompts or [])
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
        if len(params) != len(items):
            raise ValueError(f"sampling_params: {len(params)} given for {len(items)} prompts")

        results: dict[str, RequestOutput] = {}
        order = []
        for item, p in zip(items, params):
            rid = str(next(self._ids))
            text = item if isinstance(item, str) else item.get("prompt")
            prompt = item if isinstance(item, str) else item.get("prompt_token_ids", text)
            ids = self.engine.add_request(rid, prompt, p)
            results[rid] = RequestOutput(rid, text, ids, [CompletionOutput(i) for i in range(p.n)])
            order.append(rid)
        with gc_frozen():
            self._run(results)
        return [results[r] for r in order]

    def _run(self, results: dict[str, RequestOutput]) -> None:
        """Steps the engine until every request is finished, gathering the outputs into results."""
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                ro = results[out.request_id]
                co = ro.outputs[out.index]
                co.token_ids.extend(out.new_token_ids)
                co.text += out.new_text
                if out.new_logprobs is not None:
                    co.logprobs = (co.logprobs or []) + out.new_logprobs
                    co.cumulative_logprob = (co.cumulative_logprob or 0.0) + sum(
                        lp.get(t, 0.0) for lp, t in zip(out.new_logprobs, out.new_token_ids))
                if out.finished:
                    co.finish_reason, co.stop_reason = out.finish_reason, out.stop_reason
                ro.num_cached_tokens = max(ro.num_cached_tokens, out.num_cached_tokens)
                ro.finished = all(c.finish_reason is not None for c in ro.outputs)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             add_generation_prompt: bool = True, use_tqdm: bool = False) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=add_generation_prompt)
                   for c in conversations]
        # The template already holds the special tokens: tokenize without adding BOS again.
        token_ids = [{"prompt": p, "prompt_token_ids": tok(p, add_special_tokens=False).input_ids} for p in prompts]
        return self.generate(token_ids, sampling_params)
