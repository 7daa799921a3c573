"""The router's disaggregated backend: every sub-request is prefilled on a prefill instance, which sends its KV to
a decode instance that generates the rest (RouterCore, router/core.py, has validated, tokenized and fanned it out).

The life of a sub-request in here (`serve_one`):
1. Unless the first token is certainly the last (max_tokens = 1, or a full context): a decode instance is picked
   by the policy (router/instances.py) and asked to reserve blocks for the prompt (Decode RPC, first answer
   Reserved). When its polled load leaves room, the prompt goes to prefill (step 2) at the same time, naming it, so
   that the reservation's round trip is not on the way to the first token. RESOURCE_EXHAUSTED or an unreachable
   instance: that prefill is cancelled and the next instances are tried, reservation first; none left: NoRoom
   when some refused for room (`_reserve_and_prefill`; the core waits for room and tries again, router/admission.py),
   "unavailable" when none was reachable. An instance that refused sends no prompt to prefill before its
   reservation until its next poll.
2. A prefill instance is picked and sent the prompt with the router-issued request id, the decode target's address
   and the transfer deadline (Prefill RPC). Its first answer is the first token, which is queued once the
   reservation stands: the client does not wait for the KV transfer.
3. If the first token ended the request (a stop token, max_tokens = 1) the decode reservation is cancelled.
   Otherwise the rest comes from the decode instance's stream, while the prefill stream is drained in the
   background (TransferDone, or an error that cancels the decode side too).
4. Cancelling `serve_one` (the core's consumer went away) cancels both RPCs; cancelled RPCs abort the request on
   both services, which frees its blocks. A failure raises RequestError ("unavailable" or "internal", or the
   instance's own code and message).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace

import grpc

from engine.args import EngineArgs
from engine.config import SchedulerConfig
from engine.sampling_params import SamplingParams
from engine.utils import cdiv
from protos.tandem.v1 import decode_pb2, prefill_pb2
from router.backend import Backend, GenerateDelta, NoRoom, RequestError, invalid_argument
from router.instances import Instance, InstancePool
from serving.config import KvTransferConfig
from serving.convert import finish_from_proto, logprobs_from_proto, sampling_to_proto
from serving.hops import hop
from serving.tls import TlsConfig

log = logging.getLogger("tandem.router.disaggregated")


@dataclass
class RouterConfig:
    prefill_addrs: list[str]
    """Prefill instances, host:port."""
    decode_addrs: list[str]
    """Decode instances, host:port (reachable from the prefill instances too: they send the KV there)."""
    policy: str = InstancePool.policy
    """round_robin | least_loaded | cache_aware (see router/instances.py)."""
    model: str = EngineArgs.model
    """The model spec the instances serve (for the tokenizer and the context length)."""
    served_model_name: str | None = EngineArgs.served_model_name
    """Name clients use (default: the model's own name)."""
    max_model_len: int | None = EngineArgs.max_model_len
    """Context length (default: the model's); must match the instances'."""
    kv_transfer_timeout_s: float = KvTransferConfig.timeout_s
    """Deadline of one KV transfer, from the decode reservation to the commit."""
    poll_interval_s: float = InstancePool.poll_interval_s
    """Seconds between health polls of each instance."""
    tls: TlsConfig | None = None
    """This router's identity for mutual TLS to the instances (None: plaintext)."""

    def __post_init__(self) -> None:
        if self.kv_transfer_timeout_s <= 0:
            raise ValueError(f"kv_transfer_timeout_s={self.kv_transfer_timeout_s}: must be > 0")


_CODES = {grpc.StatusCode.INVALID_ARGUMENT: "invalid_argument", grpc.StatusCode.RESOURCE_EXHAUSTED:
          "resource_exhausted", grpc.StatusCode.UNAVAILABLE: "unavailable",
          grpc.StatusCode.DEADLINE_EXCEEDED: "unavailable"}


def _rpc_error(e: grpc.aio.AioRpcError, inst: Instance | None) -> RequestError:
    details = e.details() or e.code().name
    where = f"{inst.role} {inst.address}: " if inst is not None else ""
    code = _CODES.get(e.code(), "internal")
    if code == "invalid_argument":
        return invalid_argument(details, where)
    return RequestError(code, None, where + details)


def _max_model_len(hf_config) -> int:
    limit = hf_config.max_position_embeddings
    sliding = getattr(hf_config, "sliding_window", None) if getattr(hf_config, "use_sliding_window", True) else None
    return min(limit, sliding) if sliding else limit


class DisaggregatedBackend(Backend):
    """Sub-requests served by prefill and decode instances, picked per request by the pools' policy."""

    def __init__(self, cfg: RouterConfig, tokenizer, served_name: str, max_model_len: int, vocab_size: int):
        super().__init__(tokenizer, served_name, max_model_len, vocab_size)
        self.cfg = cfg
        self.prefill = InstancePool("prefill", list(cfg.prefill_addrs), cfg.policy, cfg.poll_interval_s, tls=cfg.tls)
        self.decode = InstancePool("decode", list(cfg.decode_addrs), cfg.policy, cfg.poll_interval_s, tls=cfg.tls)

    @classmethod
    async def create(cls, cfg: RouterConfig) -> "DisaggregatedBackend":
        """Loads the model's tokenizer and config (no weights) and opens the channels; start() polls them."""
        from engine.loader import load_tokenizer, resolve_model

        resolved = await asyncio.to_thread(resolve_model, cfg.model)
        tokenizer = await asyncio.to_thread(load_tokenizer, resolved)
        limit = _max_model_len(resolved.config)
        if cfg.max_model_len is not None and not 1 <= cfg.max_model_len <= limit:
            raise ValueError(f"max_model_len={cfg.max_model_len}: must be in [1, {limit}] (the model's context)")
        return cls(cfg, tokenizer, cfg.served_model_name or resolved.name, cfg.max_model_len or limit,
                   resolved.config.vocab_size)

    async def start(self) -> None:
        await asyncio.gather(self.prefill.start(), self.decode.start())

    def ready(self) -> bool:
        return bool(self.prefill.healthy()) and bool(self.decode.healthy())

    def default_max_concurrent(self) -> int:
        return SchedulerConfig.max_num_seqs * len(self.decode.instances)

    async def close(self) -> None:
        await asyncio.gather(self.prefill.close(), self.decode.close())

    async def serve_one(self, rid: str, index: int, prompt: list[int], params: SamplingParams,
                        queue: asyncio.Queue) -> None:
        try:
            await self._serve_one(rid, index, prompt, params, queue)
        except grpc.aio.AioRpcError as e:  # one that _serve_one did not name an instance for
            raise RequestError(_CODES.get(e.code(), "internal"), None, e.details() or e.code().name) from None

    def _room_likely(self, inst: Instance, prompt: list[int]) -> bool:
        """Whether inst's polled load leaves room for the prompt's blocks twice over (the poll is up to
        poll_interval_s old) and it has refused no reservation since: only then does the prompt go to prefill
        before the reservation answers, since a refusal wastes that prefill."""
        if inst.refused:
            return False
        load = inst.load
        if load is None or not load.block_size or not load.num_total_blocks:
            return True
        need = cdiv(len(prompt) + 1, load.block_size)
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
                log.debug("decode %s has no room for %s; trying the next", inst.address, rid)
                exhausted.append(inst.address)
                inst.refused = True
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
            raise NoRoom(f"no decode instance has room for {len(prompt)} prompt tokens (tried {', '.join(exhausted)})")
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
