"""The router's core, shared by the public gRPC API (router/grpc_server.py) and the OpenAI HTTP API (router/http.py).

The life of a request in the router:
1. `generate()` validates it (model name, exactly one non-empty prompt, token ids inside the vocabulary, prompt and
   max_tokens within max_model_len) and tokenizes a text prompt; a RequestError naming the field is raised before the
   first delta. n > 1 fans out into n independent sub-requests `<id>-<i>` (the prefill prefix cache shares their
   prompt), merged into one stream of deltas tagged with their index.
2. Per sub-request, unless the first token is certainly the last (max_tokens = 1, or a full context): a decode
   instance is picked by the policy and asked to reserve blocks for the prompt (Decode RPC, first answer Reserved).
   When its polled load leaves room, the prompt goes to prefill (step 3) at the same time, naming it, so that the
   reservation's round trip is not on the way to the first token. RESOURCE_EXHAUSTED or an unreachable instance:
   that prefill is cancelled and the next instances are tried, reservation first; none left: RESOURCE_EXHAUSTED
   (`_reserve_and_prefill`).
3. A prefill instance is picked and sent the prompt with the router-issued request id, the decode target's address
   and the transfer deadline (Prefill RPC). Its first answer is the first token, which is yielded once the
   reservation stands: the client does not wait for the KV transfer.
4. If the first token ended the request (a stop token, max_tokens = 1) the decode reservation is cancelled.
   Otherwise the rest comes from the decode instance's stream, while the prefill stream is drained in the
   background (TransferDone, or an error that cancels the decode side too).
5. Closing the iterator (or cancelling the task that consumes it) cancels both RPCs of every sub-request; cancelled
   RPCs abort the request on both services, which frees its blocks. A failure after the first delta raises
   RequestError ("unavailable" or "internal") from the iterator.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import grpc

from engine.sampling_params import SamplingParams
from protos.tandem.v1 import decode_pb2, prefill_pb2
from router.instances import Instance, InstancePool
from serving.config import KvTransferConfig
from serving.convert import finish_from_proto, logprobs_from_proto, sampling_to_proto
from serving.hops import hop
from serving.metrics import Metrics

log = logging.getLogger("tandem.router.core")


@dataclass
class RouterConfig:
    prefill_addrs: list[str]
    """Prefill instances, host:port."""
    decode_addrs: list[str]
    """Decode instances, host:port (reachable from the prefill instances too: they send the KV there)."""
    policy: str = InstancePool.policy
    """round_robin | least_loaded | cache_aware (see router/instances.py)."""
    model: str = "smollm2"
    """The model spec the instances serve (for the tokenizer and the context length)."""
    served_model_name: str | None = None
    """Name clients use (default: the model's own name)."""
    max_model_len: int | None = None
    """Context length (default: the model's); must match the instances'."""
    kv_transfer_timeout_s: float = KvTransferConfig.timeout_s
    """Deadline of one KV transfer, from the decode reservation to the commit."""
    poll_interval_s: float = InstancePool.poll_interval_s
    """Seconds between health polls of each instance."""

    def __post_init__(self) -> None:
        if self.kv_transfer_timeout_s <= 0:
            raise ValueError(f"kv_transfer_timeout_s={self.kv_transfer_timeout_s}: must be > 0")


@dataclass
class GenerateRequest:
    request_id: str
    model: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams


@dataclass
class GenerateDelta:
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


class RequestError(Exception):
    """A request that cannot be served; code in {"invalid_argument", "not_found", "resource_exhausted",
    "unavailable", "internal"}, field names the offending request field (or None)."""

    def __init__(self, code: str, field: str | None, message: str):
        super().__init__(message)
        self.code, self.field, self.message = code, field, message


_FIELD_IN_MESSAGE = re.compile(r"^(?:[\w.]+: )?(\w+)[=:]")
_CODES = {grpc.StatusCode.INVALID_ARGUMENT: "invalid_argument", grpc.StatusCode.RESOURCE_EXHAUSTED:
          "resource_exhausted", grpc.StatusCode.UNAVAILABLE: "unavailable",
          grpc.StatusCode.DEADLINE_EXCEEDED: "unavailable"}


def _rpc_error(e: grpc.aio.AioRpcError, inst: Instance | None) -> RequestError:
    details = e.details() or e.code().name
    where = f"{inst.role} {inst.address}: " if inst is not None else ""
    code = _CODES.get(e.code(), "internal")
    m = _FIELD_IN_MESSAGE.match(details) if code == "invalid_argument" else None
    return RequestError(code, m.group(1) if m else None, where + details)


def _max_model_len(hf_config) -> int:
    limit = hf_config.max_position_embeddings
    sliding = getattr(hf_config, "sliding_window", None) if getattr(hf_config, "use_sliding_window", True) else None
    return min(limit, sliding) if sliding else limit


class RouterCore:
    def __init__(self, cfg: RouterConfig, tokenizer, served_name: str, max_model_len: int, vocab_size: int):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.served_name = served_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.prefill = InstancePool("prefill", list(cfg.prefill_addrs), cfg.policy, cfg.poll_interval_s)
        self.decode = InstancePool("decode", list(cfg.decode_addrs), cfg.policy, cfg.poll_interval_s)
        self.metrics = Metrics(served_name, "router")
        self._running = 0

    @classmethod
    async def create(cls, cfg: RouterConfig) -> "RouterCore":
        from engine.loader import load_tokenizer, resolve_model

        resolved = await asyncio.to_thread(resolve_model, cfg.model)
        tokenizer = await asyncio.to_thread(load_tokenizer, resolved)
        limit = _max_model_len(resolved.config)
        if cfg.max_model_len is not None and not 1 <= cfg.max_model_len <= limit:
            raise ValueError(f"max_model_len={cfg.max_model_len}: must be in [1, {limit}] (the model's context)")
        core = cls(cfg, tokenizer, cfg.served_model_name or resolved.name, cfg.max_model_len or limit,
                   resolved.config.vocab_size)
        await asyncio.gather(core.prefill.start(), core.decode.start())
        return core

    def models(self) -> list[str]:
        return [self.served_name]

    def ready(self) -> bool:
        return bool(self.prefill.healthy()) and bool(self.decode.healthy())

    async def close(self) -> None:
        await asyncio.gather(self.prefill.close(), self.decode.close())

    async def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text).input_ids)

    # ---- validation -------------------------------------------------------------------------------------------
    def _prompt_ids(self, req: GenerateRequest) -> list[int]:
        if req.model not in self.models():
            raise RequestError("not_found", "model",
                               f"model={req.model!r}: not served here; served: {', '.join(self.models())}")
        if (req.prompt is None) == (req.prompt_token_ids is None):
            raise RequestError("invalid_argument", "prompt", "prompt: give exactly one of prompt and prompt_token_ids")
        if req.prompt is not None:
            if not req.prompt:
                raise RequestError("invalid_argument", "prompt", "prompt: must not be empty")
            ids = list(self.tokenizer(req.prompt).input_ids)
            field = "prompt"
        else:
            ids = list(req.prompt_token_ids)
            field = "prompt_token_ids"
            bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise RequestError("invalid_argument", field, f"prompt_token_ids: token id {bad!r} is outside the "
                                                              f"vocabulary [0, {self.vocab_size})")
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
        hop(req.request_id, "router.in")
        prompt = self._prompt_ids(req)
        hop(req.request_id, "router.tokenized")
        n = req.params.n
        if not self.ready():
            raise RequestError("unavailable", None, "no healthy prefill or decode instance")
        t0 = time.monotonic()
        queue: asyncio.Queue = asyncio.Queue()
        subs = []
        for i in range(n):
            params = req.params if n == 1 else replace(
                req.params, n=1, seed=None if req.params.seed is None else req.params.seed + i)
            sub_id = req.request_id if n == 1 else f"{req.request_id}-{i}"
            subs.append(asyncio.create_task(self._run_one(sub_id, i, prompt, params, queue)))
        self._running += 1
        self.metrics.num_requests_running.set(self._running)
        self.metrics.prompt_tokens.inc(len(prompt))
        first = True
        last_time = t0
        reason = "abort"
        try:
            remaining = n
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                now = time.monotonic()
                if first:
                    hop(req.request_id, "router.first_out")
                    self.metrics.time_to_first_token_seconds.observe(now - t0)
                    first = False
                elif item.token_ids:
                    self.metrics.inter_token_latency_seconds.observe(now - last_time)
                last_time = now
                self.metrics.generation_tokens.inc(len(item.token_ids))
                if item.finish_reason is not None:
                    remaining -= 1
                    reason = item.finish_reason
                yield item
            self.metrics.e2e_request_latency_seconds.observe(time.monotonic() - t0)
        finally:
            self.metrics.finished(reason)
            for t in subs:
                t.cancel()
            await asyncio.gather(*subs, return_exceptions=True)
            self._running -= 1
            self.metrics.num_requests_running.set(self._running)

    async def _run_one(self, rid: str, index: int, prompt: list[int], params: SamplingParams,
                       queue: asyncio.Queue) -> None:
        try:
            await self._serve_one(rid, index, prompt, params, queue)
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # the consumer went away
                raise
            queue.put_nowait(RequestError("internal", None, f"request {rid}: an internal call was cancelled"))
        except RequestError as e:
            queue.put_nowait(e)
        except grpc.aio.AioRpcError as e:
            queue.put_nowait(RequestError(_CODES.get(e.code(), "internal"), None, e.details() or e.code().name))
        except Exception as e:  # noqa: BLE001 - one request fails, not the router
            log.exception("request %s failed", rid)
            queue.put_nowait(RequestError("internal", None, f"{type(e).__name__}: {e}"))

    def _room_likely(self, inst: Instance, prompt: list[int]) -> bool:
        """Whether inst's polled load leaves room for the prompt's blocks twice over (the poll is up to
        poll_interval_s old): only then does the prompt go to prefill before the reservation answers, since a
        refusal wastes that prefill."""
        load = inst.load
        if load is None or not load.block_size or not load.num_total_blocks:
            return True
        need = -(-(len(prompt) + 1) // load.block_size)
        return load.num_total_blocks - load.num_used_blocks >= 2 * need

    async def _open_decode(self, inst: Instance, rid: str, prompt: list[int], params_msg, timeout_ms: int,
                           exhausted: list[str]):
        """Opens a Decode call on inst and reads its Reserved answer. Returns the call, or None when inst has no
        room (its address goes to `exhausted`) or is unreachable (it leaves the rotation)."""
        hop(rid, "router.reserve_sent")
        call = inst.stub.Decode(decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt,
                                                         params=params_msg, kv_transfer_timeout_ms=timeout_ms))
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                log.info("decode %s has no room for %s; trying the next", inst.address, rid)
                exhausted.append(inst.address)
                return None
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self.decode.mark_down(inst, e.details() or "unavailable")
                return None
            raise _rpc_error(e, inst) from None
        except BaseException:
            call.cancel()
            raise
        hop(rid, "router.reserved")
        if first is grpc.aio.EOF or not first.HasField("reserved"):
            call.cancel()
            raise RequestError("internal", None, f"decode {inst.address}: no Reserved answer")
        return call

    async def _reserve(self, rid: str, prompt: list[int], params_msg, timeout_ms: int, order: list[Instance],
                       exhausted: list[str]):
        """Opens a Decode call on the first instance of `order` with room; returns (call, instance)."""
        for inst in order:
            call = await self._open_decode(inst, rid, prompt, params_msg, timeout_ms, exhausted)
            if call is not None:
                return call, inst
        if exhausted:
            raise RequestError("resource_exhausted", None,
                               f"no decode instance has room for {len(prompt)} prompt tokens "
                               f"(tried {', '.join(exhausted)})")
        raise RequestError("unavailable", None, "no healthy decode instance")

    async def _first_token(self, rid: str, prompt: list[int], params_msg, decode_address: str, timeout_ms: int):
        """Sends the prompt to the first reachable prefill instance; returns (call, instance, FirstToken)."""
        for inst in self.prefill.ordered(prompt):
            hop(rid, "router.prefill_sent")
            call = inst.stub.Prefill(prefill_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=prompt, params=params_msg, decode_address=decode_address,
                kv_transfer_timeout_ms=timeout_ms))
            self.prefill.sent(inst, prompt)
            inst.inflight += 1
            inst.inflight_tokens += len(prompt)
            try:
                resp = await call.read()
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE and "kv transfer" not in (e.details() or ""):
                    self.prefill.mark_down(inst, e.details() or "unavailable")
                    continue
                raise _rpc_error(e, inst) from None
            except BaseException:
                call.cancel()
                raise
            finally:
                inst.inflight -= 1
                inst.inflight_tokens -= len(prompt)
            hop(rid, "router.first_token")
            if resp is grpc.aio.EOF or not resp.HasField("first_token"):
                call.cancel()
                raise RequestError("internal", None, f"prefill {inst.address}: no FirstToken answer")
            return call, inst, resp.first_token
        raise RequestError("unavailable", None, "no healthy prefill instance")

    async def _reserve_and_prefill(self, rid: str, prompt: list[int], params_msg, timeout_ms: int):
        """A decode reservation and the prefill that transfers its KV there: (Decode call, decode instance, Prefill
        call, prefill instance, FirstToken). On an error, every call it opened is cancelled (freeing what it held).

        When the policy's first decode instance likely has room, the prompt goes to prefill (naming that instance)
        at once, while the instance reserves: the reservation's round trip overlaps the prefill instead of
        preceding it (the decode instance holds a transfer that opens first until its reservation is made). If
        that instance refuses (RESOURCE_EXHAUSTED) or is unreachable, the prefill is cancelled and the other
        instances are tried one by one, reservation first, as sub-request `<rid>.2` (the cancelled prefill may
        still hold `rid` for a moment)."""
        order = self.decode.ordered()
        exhausted: list[str] = []
        if order and self._room_likely(order[0], prompt):
            dinst = order.pop(0)
            # Tasks start in order: the Prefill call (the first token's path) goes out before the Decode call.
            prefill = asyncio.create_task(self._first_token(rid, prompt, params_msg, dinst.address, timeout_ms))
            reserve = asyncio.create_task(self._open_decode(dinst, rid, prompt, params_msg, timeout_ms, exhausted))
            try:
                dcall = await reserve
            except BaseException:
                await _cancel(reserve)
                await _cancel(prefill)
                raise
            if dcall is not None:
                try:
                    pcall, pinst, ft = await prefill
                except BaseException:
                    dcall.cancel()
                    await _cancel(prefill)
                    raise
                return dcall, dinst, pcall, pinst, ft
            await _cancel(prefill)
            rid = f"{rid}.2"
        dcall, dinst = await self._reserve(rid, prompt, params_msg, timeout_ms, order, exhausted)
        try:
            pcall, pinst, ft = await self._first_token(rid, prompt, params_msg, dinst.address, timeout_ms)
        except BaseException:
            dcall.cancel()
            raise
        return dcall, dinst, pcall, pinst, ft

    async def _serve_one(self, rid: str, index: int, prompt: list[int], params: SamplingParams,
                         queue: asyncio.Queue) -> None:
        if params.max_tokens is None:  # "up to the context": resolved here, the wire has no None
            params = replace(params, max_tokens=self.max_model_len - len(prompt))
        params_msg = sampling_to_proto(params)
        timeout_ms = int(self.cfg.kv_transfer_timeout_s * 1000)
        needs_decode = params.max_tokens != 1 and len(prompt) + 1 < self.max_model_len
        dcall = pcall = drain = None
        dinst = None
        try:
            if needs_decode:
                dcall, dinst, pcall, pinst, ft = await self._reserve_and_prefill(rid, prompt, params_msg, timeout_ms)
                dinst.inflight += 1
            else:
                pcall, pinst, ft = await self._first_token(rid, prompt, params_msg, "", timeout_ms)
            d = ft.delta
            reason = finish_from_proto(d.finish_reason)
            if dcall is None and reason is None:  # cannot happen: prefill ends a request without a decode target
                reason = "length"
            queue.put_nowait(GenerateDelta(index, list(d.token_ids), d.text, logprobs_from_proto(d.logprobs), reason,
                                           len(prompt), 1))
            if reason is not None:
                return
            drain = asyncio.create_task(self._drain(pcall, pinst, dcall))
            completion = 1
            while (resp := await dcall.read()) is not grpc.aio.EOF:  # read(): the first answer was read() too
                if not resp.HasField("delta"):
                    continue
                d = resp.delta
                completion += len(d.token_ids)
                reason = finish_from_proto(d.finish_reason)
                queue.put_nowait(GenerateDelta(index, list(d.token_ids), d.text, logprobs_from_proto(d.logprobs),
                                               reason, len(prompt), completion))
                if reason is not None:
                    return
            raise RequestError("internal", None, f"decode {dinst.address}: stream ended before the request finished")
        except grpc.aio.AioRpcError as e:
            if drain is not None and drain.done() and drain.exception() is not None:
                raise drain.exception() from None
            raise _rpc_error(e, dinst) from None
        except asyncio.CancelledError:
            if drain is not None and drain.done() and not drain.cancelled() and drain.exception() is not None:
                raise drain.exception() from None
            raise
        finally:
            if dinst is not None:
                dinst.inflight -= 1
            for call in (dcall, pcall):
                if call is not None:
                    call.cancel()
            if drain is not None:
                drain.cancel()

    async def _drain(self, pcall, pinst: Instance, dcall) -> None:
        """Reads the prefill stream to its end (TransferDone); a failure there cancels the decode stream."""
        try:
            while (resp := await pcall.read()) is not grpc.aio.EOF:
                if resp.HasField("transfer_done"):
                    td = resp.transfer_done
                    log.debug("kv transfer %d bytes, %.4fs (tail %.4fs)", td.transfer_bytes, td.transfer_seconds,
                              td.tail_seconds)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED:
                return
            err = _rpc_error(e, pinst)
            dcall.cancel()
            raise err from None


async def _cancel(task: asyncio.Task) -> None:
    """Cancels a task that opens a call (`_first_token`, `_open_decode`) and the call it may have returned already:
    the instance then frees what the call holds."""
    task.cancel()
    result = (await asyncio.gather(task, return_exceptions=True))[0]
    call = result[0] if isinstance(result, tuple) else result
    if isinstance(call, grpc.aio.Call):
        call.cancel()
