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
5. A failure of an instance rather than of the request (a decode or prefill instance gone, a transfer failed, the
   health poll lost the decode instance) ends the attempt, not the stream: router/migration.py moves it, and the
   next attempt (steps 1-3 again, as `<id>.m<n>`) carries the tokens already sent (prior_output_token_ids) and
   continues the same client stream. With no prefill instance healthy, an attempt asks a decode instance to
   prefill locally (`_attempt_local`) instead.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace

import grpc

from engine.args import EngineArgs
from engine.config import SchedulerConfig
from engine.sampling_params import SamplingParams
from engine.tokenizer import tokenizer_fingerprint
from engine.utils import cdiv
from protos.tandem.v1 import decode_pb2, prefill_pb2
from router.backend import Backend, NoRoom, RequestError, invalid_argument
from router.instances import Expected, Instance, InstancePool
from router.migration import Lost, Migration, Stream, lost_or_error
from serving import tracing
from serving.config import KvTransferConfig
from serving.convert import sampling_to_proto
from serving.discovery import DiscoveryConfig, Resolver
from serving.hops import hop
from serving.metrics import Metrics
from serving.tls import TlsConfig

log = logging.getLogger("tandem.router.disaggregated")


@dataclass
class RouterConfig:
    prefill_addrs: list[str]
    """Prefill instances, host:port (a host that is a DNS name: one instance per address, serving/discovery.py)."""
    decode_addrs: list[str]
    """Decode instances, host:port (reachable from the prefill instances too: they send the KV there)."""
    policy: str = InstancePool.policy
    """round_robin | least_loaded | cache_aware (see router/instances.py)."""
    model: str = EngineArgs.model
    """The model spec the instances serve (for the tokenizer and the context length)."""
    tokenizer: str | None = EngineArgs.tokenizer
    """Tokenizer directory used instead of the model's (--tokenizer): must be the one the instances were given, as
    they detokenize the ids this router tokenizes (an instance whose tokenizer differs gets no requests:
    router/instances.py, "Identity")."""
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
    migration_limit: int = 3
    """How many times one sub-request may move to another instance after the one serving it failed
    (router/migration.py); past it the client gets the error. 0: never moved."""
    migration_timeout_s: float = 30.0
    """How long a moving sub-request may wait for a healthy decode instance to take it, in seconds."""
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    """How names among the addresses resolve, and how often again."""
    resolver: Resolver | None = None
    """Resolves those names (default: the discovery config's; tests pass their own)."""

    def __post_init__(self) -> None:
        if self.kv_transfer_timeout_s <= 0:
            raise ValueError(f"kv_transfer_timeout_s={self.kv_transfer_timeout_s}: must be > 0")
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit={self.migration_limit}: must be >= 0 (0: never move a request)")
        if self.migration_timeout_s <= 0:
            raise ValueError(f"migration_timeout_s={self.migration_timeout_s}: must be > 0")


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
        metrics = Metrics(served_name, "router")
        # What every instance must serve too (router/instances.py, "Identity"): the tokenizer is hashed once, here.
        expected = Expected(served_name, vocab_size, tokenizer_fingerprint(tokenizer), max_model_len)
        self.prefill, self.decode = (
            InstancePool(role, list(addrs), cfg.policy, cfg.poll_interval_s, tls=cfg.tls, discovery=cfg.discovery,
                         resolver=cfg.resolver, metrics=metrics, expected=expected)
            for role, addrs in (("prefill", cfg.prefill_addrs), ("decode", cfg.decode_addrs)))
        self.migration = Migration(cfg.migration_limit, cfg.migration_timeout_s, metrics,
                                   self.decode.wait_healthy, lambda: bool(self.decode.healthy()))

    @classmethod
    async def create(cls, cfg: RouterConfig) -> "DisaggregatedBackend":
        """Loads the model's tokenizer (cfg.tokenizer's when given) and config (no weights), resolves the names among
        the addresses and opens the channels; start() polls them."""
        from engine.loader import load_tokenizer, resolve_model

        resolved = await asyncio.to_thread(resolve_model, cfg.model)
        tokenizer = await asyncio.to_thread(load_tokenizer, resolved, cfg.tokenizer)
        limit = _max_model_len(resolved.config)
        if cfg.max_model_len is not None and not 1 <= cfg.max_model_len <= limit:
            raise ValueError(f"max_model_len={cfg.max_model_len}: must be in [1, {limit}] (the model's context)")
        backend = cls(cfg, tokenizer, cfg.served_model_name or resolved.name, cfg.max_model_len or limit,
                      resolved.config.vocab_size)
        await asyncio.gather(backend.prefill.resolve(), backend.decode.resolve())
        return backend

    async def start(self) -> None:
        await asyncio.gather(self.prefill.start(), self.decode.start())

    def ready(self) -> bool:
        """A decode instance is healthy, and a prefill instance is (or was once: while none is, decode instances
        prefill locally)."""
        return bool(self.decode.healthy()) and (bool(self.prefill.healthy()) or self.prefill.ever_healthy)

    def default_max_concurrent(self) -> int:
        # (the decode instances at start: names resolving to more later do not raise it; --max-concurrent-requests)
        return SchedulerConfig.max_num_seqs * max(1, len(self.decode.instances))

    async def close(self) -> None:
        await asyncio.gather(self.prefill.close(), self.decode.close())

    async def serve_one(self, rid: str, index: int, prompt: list[int], params: SamplingParams,
                        queue: asyncio.Queue) -> None:
        if params.max_tokens is None:  # "up to the context": resolved here, the wire has no None
            params = replace(params, max_tokens=self.max_model_len - len(prompt))
        try:
            await self.migration.serve(Stream(rid, index, prompt, params, queue), self._attempt)
        except grpc.aio.AioRpcError as e:  # one that _attempt did not name an instance for
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
                           exhausted: list[str], prior: list[int]):
        """Opens a Decode call on inst and reads its Reserved answer. Returns the call, or None when inst has no
        room (its address goes to `exhausted`) or is unreachable (it leaves the rotation)."""
        hop(rid, "router.reserve_sent")
        call = inst.stub.Decode(decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt,
                                                         params=params_msg, kv_transfer_timeout_ms=timeout_ms,
                                                         prior_output_token_ids=prior),
                               metadata=tracing.metadata())
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
                       exhausted: list[str], prior: list[int]):
        """Opens a Decode call on the first instance of `order` with room; returns (call, instance)."""
        for inst in order:
            if inst.leaving:  # gone from DNS since the order was made
                continue
            call = await self._open_decode(inst, rid, prompt, params_msg, timeout_ms, exhausted, prior)
            if call is not None:
                return call, inst
        if exhausted:
            raise NoRoom(f"no decode instance has room for {len(prompt)} prompt tokens (tried {', '.join(exhausted)})")
        raise RequestError("unavailable", None, "no healthy decode instance")

    async def _first_token(self, rid: str, prompt: list[int], params_msg, decode_address: str, timeout_ms: int,
                           prior: list[int]):
        """Sends the prompt (and the prior tokens of a moved stream) to the policy's prefill instance; returns
        (call, instance, FirstToken). An instance that fails raises Lost (a new attempt gets a new reservation
        too: this one's transfer may have been open)."""
        order = self.prefill.ordered(prompt)
        if not order:
            raise RequestError("unavailable", None, "no healthy prefill instance")
        inst = order[0]
        hop(rid, "router.prefill_sent")
        call = inst.stub.Prefill(prefill_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, params=params_msg, decode_address=decode_address,
            kv_transfer_timeout_ms=timeout_ms, prior_output_token_ids=prior), metadata=tracing.metadata())
        work = len(prompt) + len(prior)
        self.prefill.sent(inst, prompt)
        inst.inflight += 1
        inst.inflight_tokens += work
        try:
            resp = await call.read()
        except grpc.aio.AioRpcError as e:
            raise self._lost(e, inst) from None
        except BaseException:
            call.cancel()
            raise
        finally:
            inst.inflight -= 1
            inst.inflight_tokens -= work
        hop(rid, "router.first_token")
        if resp is grpc.aio.EOF or not resp.HasField("first_token"):
            call.cancel()
            raise RequestError("internal", None, f"prefill {inst.address}: no FirstToken answer")
        return call, inst, resp.first_token

    def _lost(self, e: grpc.aio.AioRpcError, inst: Instance) -> Exception:
        """What a failed call to inst raises: Lost (taking inst out of rotation, until a poll finds it again, when it
        is unreachable or ended the call itself) when another instance may finish the stream, else the
        RequestError for the client."""
        lost = lost_or_error(e, inst.role, f"{inst.role} {inst.address}: ")
        if lost is None:
            return _rpc_error(e, inst)
        if lost.reason == f"{inst.role}_unavailable":
            (self.prefill if inst.role == "prefill" else self.decode).mark_down(inst, e.details() or e.code().name)
        return lost

    async def _reserve_and_prefill(self, rid: str, prompt: list[int], params_msg, timeout_ms: int,
                                   prior: list[int]):
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
        if order and self._room_likely(order[0], prompt + prior):
            dinst = order.pop(0)
            # Tasks start in order: the Prefill call (the first token's path) goes out before the Decode call.
            prefill = asyncio.create_task(self._first_token(rid, prompt, params_msg, dinst.address, timeout_ms,
                                                            prior))
            reserve = asyncio.create_task(self._open_decode(dinst, rid, prompt, params_msg, timeout_ms, exhausted,
                                                            prior))
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
        dcall, dinst = await self._reserve(rid, prompt, params_msg, timeout_ms, order, exhausted, prior)
        try:
            pcall, pinst, ft = await self._first_token(rid, prompt, params_msg, dinst.address, timeout_ms, prior)
        except BaseException:
            dcall.cancel()
            raise
        return dcall, dinst, pcall, pinst, ft

    async def _attempt(self, s: Stream, rid: str) -> None:
        """One attempt at the rest of stream s, as request id rid: a reservation, a prefill, the decode stream
        (steps 1-3 of the module docstring). Returns once the stream finished; raises Lost when an instance
        failed it (router/migration.py moves it), RequestError when the request did."""
        prior = list(s.sent)
        k = len(prior)
        params_msg = sampling_to_proto(s.params)
        s.kv_transfer_s = None  # (this attempt's, if it has one)
        if not self.prefill.healthy():
            return await self._attempt_local(s, rid, prior, params_msg)
        timeout_ms = int(self.cfg.kv_transfer_timeout_s * 1000)
        needs_decode = s.params.max_tokens != k + 1 and len(s.prompt) + k + 1 < self.max_model_len
        dcall = pcall = drain = None
        dinst = None
        try:
            if needs_decode:
                dcall, dinst, pcall, pinst, ft = await self._reserve_and_prefill(rid, s.prompt, params_msg,
                                                                                 timeout_ms, prior)
            else:
                pcall, pinst, ft = await self._first_token(rid, s.prompt, params_msg, "", timeout_ms, prior)
            # (without a decode target the prefill's token is the last: "length" if it said nothing)
            if s.put(ft.delta, None if dcall is not None else "length", ft.num_cached_tokens) is not None:
                return
            drain = asyncio.create_task(self._drain(pcall, pinst, dcall))
            await self._follow(s, dinst, dcall, drain)
        finally:
            for call in (dcall, pcall):
                if call is not None:
                    call.cancel()
            if drain is not None:
                drain.cancel()

    async def _attempt_local(self, s: Stream, rid: str, prior: list[int], params_msg) -> None:
        """An attempt without a prefill instance: the policy's decode instance prefills the prompt (and the prior
        tokens) itself and streams every token."""
        for dinst in self.decode.ordered():
            if dinst.leaving:
                continue
            hop(rid, "router.local_prefill_sent")
            call = dinst.stub.Decode(decode_pb2.DecodeRequest(
                request_id=rid, prompt_token_ids=s.prompt, params=params_msg, prior_output_token_ids=prior,
                prefill_locally=True), metadata=tracing.metadata())
            try:
                return await self._follow(s, dinst, call, None)
            except Lost:
                if len(s.sent) == len(prior) and not dinst.healthy:  # unreachable before any token: the next one
                    continue
                raise
            finally:
                call.cancel()
        raise RequestError("unavailable", None, "no healthy decode instance")

    async def _follow(self, s: Stream, dinst: Instance, dcall, drain: asyncio.Task | None) -> None:
        """Puts dcall's deltas on s until the finish. A broken stream, one that ends early, or dinst lost by the
        health poll raises Lost; a failed prefill drain (which cancels dcall) raises its own error."""
        lost_why: list[str] = []

        def lost(why: str) -> None:  # the health poll lost dinst
            lost_why.append(why)
            dcall.cancel()

        def drained():
            if drain is not None and drain.done() and not drain.cancelled() and drain.exception() is not None:
                return drain.exception()
            return None

        dinst.inflight += 1
        dinst.streams.add(lost)
        try:
            while (resp := await dcall.read()) is not grpc.aio.EOF:  # read(): the first answer was read() too
                if not resp.HasField("delta"):
                    continue
                if resp.delta.finish_reason and drain is not None:
                    s.kv_transfer_s = await _transfer_seconds(drain)
                if s.put(resp.delta) is not None:
                    return
            raise Lost("decode_unavailable", RequestError(
                "unavailable", None, f"decode {dinst.address}: stream ended before the request finished"))
        except grpc.aio.AioRpcError as e:
            if (err := drained()) is not None:
                raise err from None
            raise self._lost(e, dinst) from None
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # the consumer went away
                raise
            if (err := drained()) is not None:
                raise err from None
            if lost_why:
                raise Lost("decode_unhealthy", RequestError(
                    "unavailable", None, f"decode {dinst.address}: {lost_why[0]}")) from None
            raise
        finally:
            dinst.streams.discard(lost)
            dinst.inflight -= 1

    async def _drain(self, pcall, pinst: Instance, dcall) -> float | None:
        """Reads the prefill stream to its end (TransferDone); returns the transfer's seconds. A failure there cancels
        the decode stream."""
        seconds = None
        try:
            while (resp := await pcall.read()) is not grpc.aio.EOF:
                if resp.HasField("transfer_done"):
                    td = resp.transfer_done
                    seconds = td.transfer_seconds
                    log.debug("kv transfer %d bytes, %.4fs (tail %.4fs)", td.transfer_bytes, td.transfer_seconds,
                              td.tail_seconds)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED:
                return None
            err = self._lost(e, pinst)
            dcall.cancel()
            raise err from None
        return seconds


async def _transfer_seconds(drain: asyncio.Task) -> float | None:
    """The KV transfer's seconds, once the prefill stream (drain) has ended; None if it failed. Read before a
    sub-request's last delta goes out: decode committed the KV before that delta, and the prefill's TransferDone
    follows decode's ack of the commit, so the wait is a hop at most (and usually none)."""
    await asyncio.wait({drain})
    if drain.cancelled() or drain.exception() is not None:
        return None
    return drain.result()


async def _cancel(task: asyncio.Task) -> None:
    """Cancels a task that opens a call (`_first_token`, `_open_decode`) and the call it may have returned already:
    the instance then frees what the call holds."""
    task.cancel()
    result = (await asyncio.gather(task, return_exceptions=True))[0]
    call = result[0] if isinstance(result, tuple) else result
    if isinstance(call, grpc.aio.Call):
        call.cancel()
