"""`tandem router --colocated`: the router's backend that runs one engine in this process for both phases, prefill
and decode, of every request: the non-disaggregated baseline (vLLM's or SGLang's single-engine serving) that Tandem's
prefill/decode split is measured against, behind the same OpenAI HTTP and gRPC front (bench/gpu_serve.sh).

The life of a sub-request in here (RouterCore, router/core.py, has validated, tokenized and fanned it out, as for
the disaggregated backend):
1. `serve_one` adds the prompt to the engine (`engine.add_request`, in the engine's own thread, serving's
   EngineThread); the engine's scheduler mixes its prefill chunks with the running requests' decode steps under one
   token budget (chunked prefill): no KV leaves the engine, and prefill and decode share every step.
2. Each step's outputs come back to the event loop (`_on_step`) and go to the request's stream as GenerateDeltas,
   the first token included, logprobs in the disaggregated backend's order, until the request finishes.
3. Cancelling `serve_one` (a client gone, an error, or the end) aborts the request in the engine, which frees its
   blocks.
"""
from __future__ import annotations

import asyncio
import logging

from engine.args import EngineArgs
from engine.sampling_params import SamplingParams
from router.backend import Backend, GenerateDelta, RequestError, invalid_argument
from serving.convert import ordered_logprobs
from serving.engine_thread import EngineThread
from serving.metrics import Metrics

log = logging.getLogger("tandem.router.colocated")


def _add(engine, rid: str, prompt: list[int], params: SamplingParams) -> None:
    engine.add_request(rid, prompt, params)


def _stats(engine, _outs):
    """After each step, in the engine thread: its stats for the metrics (EngineThread's after_step hook)."""
    return engine.stats()


def _abort(engine, rid: str) -> None:
    engine.abort(rid)  # no-op once the request finished and was forgotten


class ColocatedBackend(Backend):
    """Sub-requests run in an in-process engine instead of on prefill and decode instances."""

    def __init__(self, engine):
        super().__init__(engine.tokenizer, engine.model_name, engine.max_model_len,
                         engine.resolved.config.vocab_size)
        self.engine = engine  # owned by self.worker's thread once start() ran; read-only constants above
        # The engine's own series (running, waiting, KV usage, prefix cache, preemptions, tokens per step, cache
        # config) under role "colocated", and no request-level ones: the router's core records those once per
        # request. Its num_requests_running counts its in-flight requests, waiting ones included.
        self.engine_metrics = Metrics(self.served_name, "colocated")
        self.engine_metrics.observe_cache_config(engine.config.cache, engine.kv.num_blocks)
        self._streams: dict[str, asyncio.Queue] = {}  # request id -> its StepOutputs (event loop only)
        self.worker: EngineThread | None = None

    @classmethod
    async def from_engine_args(cls, args: EngineArgs) -> "ColocatedBackend":
        """Builds the engine (weights, KV cache) off the event loop; start() starts its thread."""
        from engine import LLMEngine

        return cls(await asyncio.to_thread(LLMEngine.from_engine_args, args))

    async def start(self) -> None:
        self.worker = EngineThread(self.engine, asyncio.get_running_loop(), self._on_step, _stats,
                                   name="colocated-engine")
        self.worker.start()

    def ready(self) -> bool:
        return self.worker is not None

    def default_max_concurrent(self) -> int:
        return self.engine.config.scheduler.max_num_seqs

    async def close(self) -> None:
        if self.worker is None:
            return
        for rid in list(self._streams):
            self.worker.submit(_abort, rid)
        await asyncio.to_thread(self.worker.stop)
        self.worker = None
        await asyncio.to_thread(self.engine.close)  # its tensor-parallel workers, if any

    def _on_step(self, outs, stats) -> None:
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)
        if stats is not None:
            self.engine_metrics.observe_step(stats)

    async def serve_one(self, rid: str, index: int, prompt: list[int], params: SamplingParams,
                        queue: asyncio.Queue) -> None:
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = stream
        try:
            try:
                await self.worker.call(_add, rid, prompt, params)
            except ValueError as e:  # the engine's own checks; the router's ran first, so this is rare
                raise invalid_argument(str(e)) from None
            while True:
                out = await stream.get()
                if out.finish_reason == "abort":
                    raise RequestError("internal", None, f"request {rid}: the engine aborted it (a model step failed)")
                logprobs = None
                if out.new_logprobs:
                    logprobs = ordered_logprobs(out.new_logprobs, out.new_token_ids) or None
                queue.put_nowait(GenerateDelta(index, list(out.new_token_ids), out.new_text, logprobs,
                                               out.finish_reason, len(prompt), out.num_output_tokens,
                                               out.stop_reason if out.finished else None, out.num_cached_tokens))
                if out.finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if self.worker is not None:
                self.worker.submit(_abort, rid)
