"""The router's core, shared by the public gRPC API (router/grpc_server.py) and the OpenAI HTTP API (router/http.py),
over a backend that serves each sub-request (router/backend.py): prefill and decode instances
(router/disaggregated.py) or one engine in this process (router/colocated.py).

The life of a request in the core:
1. `generate()` validates it (model name, exactly one non-empty prompt, token ids inside the vocabulary, prompt and
   max_tokens within max_model_len) and tokenizes a text prompt; a RequestError naming the field is raised before the
   first delta, as is "unavailable" when the backend is not ready.
2. Admission (router/admission.py): the request takes one slot per sub-request, waiting in a bounded FIFO queue
   when they are all taken; a full queue or a wait past --queue-timeout is refused "resource_exhausted" with a
   Retry-After (HTTP 429), before the first delta.
3. n > 1 fans out into n independent sub-requests `<id>-<i>` (seed + i each; a prefix cache shares their prompt).
   Each runs as a task in `backend.serve_one`, which puts the sub-request's deltas, tagged with its index, on one
   queue; `generate()` yields them in arrival order (and records the router's metrics) until every sub-request
   has finished. A sub-request that no instance has room for (NoRoom, before its first delta) waits for room and is
   tried again as `<sub-id>.r<k>`, until the request's deadline; then it is refused like a wait past the limit.
4. A sub-request that fails puts its RequestError on the queue ("internal" for anything that is not one), and
   `generate()` raises it: that request ends, the router stays up. Each sub-request gives its slot back when it ends.
5. Closing the iterator (or cancelling the task that consumes it) cancels every sub-request's task; the backend then
   frees what the request holds (see its module for how).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import anyio

from engine.sampling_params import SamplingParams
from router.admission import Admission, AdmissionConfig, Ticket
from router.backend import Backend, GenerateDelta, NoRoom, RequestError
from router.disaggregated import DisaggregatedBackend, RouterConfig
from router.metrics import RequestMetrics
from router.timings import SubTimer
from serving import tracing
from serving.hops import hop
from serving.logs import request_scope
from serving.metrics import Metrics
from serving.tracing import SpanAttributes as A

__all__ = ["AdmissionConfig", "GenerateDelta", "GenerateRequest", "NOT_READY", "RequestError", "RouterConfig",
           "RouterCore", "RouterLimits"]

log = logging.getLogger("tandem.router.core")

NOT_READY = "no healthy prefill or decode instance"
"""Why a backend that is not ready refuses requests (HTTP /health gives the same reason)."""
SHUTTING_DOWN = "the router is shutting down; send the request to another router"


@dataclass(frozen=True)
class RouterLimits:
    """What one request may ask of the router, checked before any work (tokenizing included)."""
    max_sub_requests: int = 256
    """Completions one request may fan out into: its prompts times n."""
    max_prompt_bytes: int = 4 << 20
    """UTF-8 bytes of one text prompt (or chat) before it is tokenized."""

    def __post_init__(self) -> None:
        for name in ("max_sub_requests", "max_prompt_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")


# Text prompts longer than this are tokenized in a worker thread: the event loop serves /health and the other
# requests meanwhile (a megabyte of text takes the tokenizer seconds). Shorter ones go inline: a thread hop costs
# more than they take.
_INLINE_TOKENIZE_CHARS = 16 << 10


def check_text(field: str, text: str, max_bytes: int) -> None:
    """RequestError unless text is valid Unicode (no lone UTF-16 surrogate) of at most max_bytes UTF-8 bytes."""
    if len(text) > max_bytes:  # (a character is at least one byte)
        raise RequestError("invalid_argument", field, f"{field}: {len(text)} characters, more than the "
                                                      f"{max_bytes} bytes a prompt may have (--max-prompt-bytes)")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise RequestError("invalid_argument", field, f"{field}: not valid text: a lone UTF-16 surrogate "
                                                      f"({text[e.start]!r}) at character {e.start}") from None
    if size > max_bytes:
        raise RequestError("invalid_argument", field, f"{field}: {size} bytes, more than the {max_bytes} a "
                                                      "prompt may have (--max-prompt-bytes)")


async def tokenize_off_loop(tokenizer, text: str, **kwargs) -> list[int]:
    """tokenizer(text).input_ids, in a worker thread when the text is long."""
    if len(text) <= _INLINE_TOKENIZE_CHARS:
        return list(tokenizer(text, **kwargs)["input_ids"])
    return list((await asyncio.to_thread(tokenizer, text, **kwargs))["input_ids"])


@dataclass
class GenerateRequest:
    request_id: str
    model: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    trace_headers: dict[str, str] | None = None
    """The client's `traceparent`/`tracestate` (HTTP headers or gRPC metadata): the parent of the request's span."""
    return_timings: bool = False
    """Put each sub-request's timing breakdown (router/timings.py) on its last delta."""


class RouterCore:
    def __init__(self, backend: Backend, limits: RouterLimits = RouterLimits(),
                 admission: AdmissionConfig = AdmissionConfig()):
        self.backend = backend
        self.limits = limits
        self.tokenizer = backend.tokenizer
        self.served_name = backend.served_name
        self.max_model_len = backend.max_model_len
        self.vocab_size = backend.vocab_size
        self.metrics = Metrics(self.served_name, "router", self.max_model_len)
        self.admission = Admission(admission, admission.max_concurrent_requests or backend.default_max_concurrent(),
                                   self.metrics, self.served_name)
        self._running = 0
        self._queues: set[asyncio.Queue] = set()  # one per request in flight: drain() ends them through it
        self.draining = False

    @classmethod
    async def create(cls, cfg: RouterConfig, limits: RouterLimits = RouterLimits(),
                     admission: AdmissionConfig = AdmissionConfig()) -> "RouterCore":
        """A core over the prefill and decode instances of `cfg`, once their first health poll is back."""
        core = cls(await DisaggregatedBackend.create(cfg), limits, admission)
        await core.start()
        return core

    async def start(self) -> None:
        await self.backend.start()

    def models(self) -> list[str]:
        return [self.served_name]

    def ready(self) -> bool:
        return not self.draining and self.backend.ready()

    async def close(self) -> None:
        await self.backend.close()

    async def drain(self, grace_s: float, poll_s: float = 0.05) -> None:
        """Stops taking requests (they are refused "unavailable", health says not ready), lets the ones in flight
        finish for up to grace_s, then ends each with an "unavailable" error: an HTTP stream then closes with an
        error event and [DONE], a gRPC call with UNAVAILABLE, never a cut-off body."""
        self.draining = True
        self.admission.close(RequestError("unavailable", None, SHUTTING_DOWN))  # the queued ones: refused at once
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        if self._running:
            log.info("draining: %d request(s) in flight, up to %.0f s", self._running, grace_s)
        while self._running and loop.time() < deadline:
            await asyncio.sleep(poll_s)
        if self._running:
            log.warning("drain: %d request(s) still in flight after %.0f s: ending them", self._running, grace_s)
            for queue in list(self._queues):
                queue.put_nowait(RequestError("unavailable", None, SHUTTING_DOWN))

    async def tokenize(self, text: str, field: str = "text", **kwargs) -> list[int]:
        check_text(field, text, self.limits.max_prompt_bytes)
        return await tokenize_off_loop(self.tokenizer, text, **kwargs)

    # ---- validation -------------------------------------------------------------------------------------------
    def check_token_ids(self, ids: list[int], field: str = "prompt_token_ids") -> None:
        """RequestError for a token-id prompt that is empty, too long for max_model_len, or has an id outside the
        vocabulary (before anything decodes or sends them; the length first: a long list is refused unread)."""
        if not ids:
            raise RequestError("invalid_argument", field, f"{field}: must not be empty")
        if len(ids) >= self.max_model_len:
            raise RequestError("invalid_argument", field, f"{field}: {len(ids)} tokens, must be fewer than "
                                                          f"max_model_len={self.max_model_len}")
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError("invalid_argument", field, f"{field}: token id {bad!r} is outside the vocabulary "
                                                          f"[0, {self.vocab_size})")

    def check_fan_out(self, num_prompts: int, n: int) -> None:
        """RequestError when num_prompts x n completions exceed limits.max_sub_requests."""
        total, limit = num_prompts * n, self.limits.max_sub_requests
        if total > limit:
            what = f"{num_prompts} prompts x n={n} = {total}" if num_prompts > 1 else f"n={n}"
            raise RequestError("invalid_argument", "n", f"n: {what} completions, more than the {limit} one request "
                                                        "may ask for (--max-sub-requests)")

    async def _prompt_ids(self, req: GenerateRequest) -> list[int]:
        if req.model not in self.models():
            raise RequestError("not_found", "model",
                               f"model={req.model!r}: not served here; served: {', '.join(self.models())}")
        if (req.prompt is None) == (req.prompt_token_ids is None):
            raise RequestError("invalid_argument", "prompt", "prompt: give exactly one of prompt and prompt_token_ids")
        if req.prompt is not None:
            if not req.prompt:
                raise RequestError("invalid_argument", "prompt", "prompt: must not be empty")
            ids = await self.tokenize(req.prompt, "prompt")
            field = "prompt"
        else:
            ids = list(req.prompt_token_ids)
            field = "prompt_token_ids"
            self.check_token_ids(ids)
        if not ids:
            raise RequestError("invalid_argument", field, f"{field}: must not be empty")
        if len(ids) >= self.max_model_len:
            raise RequestError("invalid_argument", field, f"{field}: {len(ids)} tokens, must be fewer than "
                                                          f"max_model_len={self.max_model_len}")
        mt = req.params.max_tokens
        if mt is not None and len(ids) + mt > self.max_model_len:
            raise RequestError("invalid_argument", "max_tokens",
                               f"max_tokens={mt}: prompt ({len(ids)} tokens) + max_tokens must be <= "
                               f"max_model_len={self.max_model_len}")
        return ids

    # ---- generation -------------------------------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """The request's deltas (module docstring), inside its `llm_request` span (serving/tracing.py)."""
        p = req.params
        span = tracing.start_span("llm_request", tracing.parent_from(req.trace_headers), tracing.SpanKind.SERVER, {
            A.REQUEST_ID: req.request_id, A.MODEL: req.model, A.N: p.n, A.TEMPERATURE: p.temperature,
            A.TOP_P: p.top_p, **({A.MAX_TOKENS: p.max_tokens} if p.max_tokens is not None else {})})
        failure = None
        try:
            with request_scope(req.request_id):
                async with contextlib.aclosing(self._generate(req, span)) as deltas:
                    async for item in deltas:
                        yield item
        except BaseException as e:
            failure = None if isinstance(e, GeneratorExit) else e  # (closed early: the client is done with it)
            raise
        finally:
            tracing.end_span(span, failure)

    async def _generate(self, req: GenerateRequest, span) -> AsyncIterator[GenerateDelta]:
        arrival = time.monotonic()
        hop(req.request_id, "router.in")
        self.check_fan_out(1, req.params.n)
        prompt = await self._prompt_ids(req)
        hop(req.request_id, "router.tokenized")
        n = req.params.n
        if self.draining:
            raise RequestError("unavailable", None, SHUTTING_DOWN)
        if not self.ready():
            raise RequestError("unavailable", None, NOT_READY)
        span.set_attribute(A.PROMPT_TOKENS, len(prompt))
        t0 = time.monotonic()
        ticket = await self.admission.acquire(n)
        rm = RequestMetrics(self.metrics, t0, len(prompt), n, req.params.max_tokens or self.max_model_len - len(prompt))
        hop(req.request_id, "router.admitted")
        span.set_attribute(A.TIME_IN_QUEUE, time.monotonic() - t0)
        queue: asyncio.Queue = asyncio.Queue()
        subs = []
        timers = [SubTimer(arrival) for _ in range(n)]
        for i in range(n):
            params = req.params if n == 1 else replace(
                req.params, n=1, seed=None if req.params.seed is None else req.params.seed + i)
            sub_id = req.request_id if n == 1 else f"{req.request_id}-{i}"
            subs.append(asyncio.create_task(self._run_one(sub_id, i, prompt, params, queue, ticket, timers[i],
                                                          span)))
        self._running += 1
        self._queues.add(queue)
        self.metrics.num_requests_running.set(self._running)
        first = True
        reason = "abort"
        reasons, completion_tokens = [], 0
        try:
            remaining = n
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if first:
                    hop(req.request_id, "router.first_out")
                    span.add_event("first_token")
                    span.set_attribute(A.TIME_TO_FIRST_TOKEN, time.monotonic() - arrival)
                    first = False
                rm.delta(item)
                timers[item.index].delta(time.monotonic(), len(item.token_ids))
                if item.finish_reason is not None:
                    remaining -= 1
                    reason = item.finish_reason
                    reasons.append(reason)
                    completion_tokens += item.completion_tokens
                    if req.return_timings:
                        item.timings = timers[item.index].result(item.kv_transfer_s)
                yield item
            rm.done()
            span.set_attributes({A.COMPLETION_TOKENS: completion_tokens, A.FINISH_REASONS: reasons,
                                 A.E2E: time.monotonic() - arrival})
        finally:
            rm.finished(reason)
            for t in subs:
                t.cancel()
            try:
                # Shielded: a stream whose HTTP client went away is cancelled by anyio (starlette), again at every
                # await until it returns, which would skip the accounting below.
                with anyio.CancelScope(shield=True):
                    await asyncio.gather(*subs, return_exceptions=True)
            finally:
                ticket.close()
                self._queues.discard(queue)
                self._running -= 1
                self.metrics.num_requests_running.set(self._running)

    async def _run_one(self, rid: str, index: int, prompt: list[int], params: SamplingParams,
                       queue: asyncio.Queue, ticket: Ticket, timer: SubTimer, span) -> None:
        try:
            with tracing.current(span):  # (this task's own context: the backend's calls carry the span)
                await self._serve_one(rid, index, prompt, params, queue, ticket, timer)
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # the consumer went away
                raise
            queue.put_nowait(RequestError("internal", None, f"request {rid}: an internal call was cancelled"))
        except RequestError as e:
            queue.put_nowait(e)
        except Exception as e:  # noqa: BLE001 - one request fails, not the router
            log.exception("request %s failed", rid)
            queue.put_nowait(RequestError("internal", None, f"{type(e).__name__}: {e}"))
        finally:
            ticket.sub_done()

    async def _serve_one(self, rid: str, index: int, prompt: list[int], params: SamplingParams,
                         queue: asyncio.Queue, ticket: Ticket, timer: SubTimer) -> None:
        """backend.serve_one; while no instance has room for it (NoRoom, raised before its first delta), it waits
        for room (behind the sub-requests already waiting) and goes again as `<rid>.r<k>` (a cancelled attempt may
        still hold its id on an instance for a moment), until the request's deadline."""
        admission = self.admission
        if admission.waiting_for_room and not await admission.wait_for_room(ticket.deadline):
            raise admission.no_room(NoRoom("no decode instance had room"), ticket.since)
        sub_id, attempt = rid, 0
        while True:
            try:
                timer.dispatched()
                return await self.backend.serve_one(sub_id, index, prompt, params, queue)
            except NoRoom as e:
                if not await admission.wait_for_room(ticket.deadline, front=True):
                    raise admission.no_room(e, ticket.since) from None
            attempt += 1
            sub_id = f"{rid}.r{attempt}"
