"""The prefill service's core: one engine thread, the requests in flight, and their KV transfers.

The life of a request inside a prefill instance:
1. `prefill()` validates the sampling parameters, picks the transfer path to the decode target the router named
   (`OutgoingTransfer.negotiate`, kv_transfer/sender.py: CUDA IPC on the same host, NIXL between hosts, else gRPC bytes; one handshake
   per decode instance) and queues
   the prompt in the engine with max_tokens=1 and kv_hold=True (the engine keeps the blocks after the first token).
   A resumed request (the router moved its stream off a failed instance) comes with the k output tokens it already
   sent: the engine prefills prompt + those tokens (the prompt often from its prefix cache), with max_tokens=k+1,
   and the KV transferred covers prompt + prior tokens; everything below says "prompt" for both.
   It queues it without waiting (`submit`: an error comes back through the request's `first` future) and does
   nothing else until the first output: the event loop stays off the GIL while the engine thread steps.
2. The engine thread runs chunked prefill, batching chunks of many prompts under the token budget. After each step
   the `_after_step` hook (still in the engine thread) ships the blocks that became full (`KvSender.block_messages`,
   which asks the path's transport in kv_transfer/: `grpc_bytes`, their bytes, staged in pinned memory by copies
   queued on the engine's stream and encoded once; or `cuda_ipc` / `nixl`, their ids: the engine only reports steps
   whose device work is complete) and the loop queues the messages. The first chunk's blocks open the KV transfer stream
   (Decode.TransferKv, a KvTransferOpen describing the cache layout and the path: `OutgoingTransfer.run`, started by
   `_start_sender`): the transfer of chunk k overlaps the compute of chunk k+1. The step that finishes the prompt
   also samples the first token; the hook then sends the last, partial block too.
3. The first token is streamed back to the router at once (FirstToken): the engine thread hands it over before it
   reads the prompt's last blocks, and long before the transfer completes. A prompt of one chunk opens its
   transfer only now, after the FirstToken went out.
4. If the request ended with that token (a stop token, max_tokens=1, a full context) there is nothing for decode
   to do: a transfer already open is cancelled (decode frees its reservation when the router cancels the Decode
   call). Otherwise a KvTransferCommit with the first token closes the stream, and once decode acknowledges,
   TransferDone ends the RPC.
5. Whatever happens (ack, transfer error, deadline, client cancellation), `finally` aborts the request in the engine,
   which frees the held blocks (`engine.abort` -> `release_kv`). Nothing else holds blocks.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from engine.llm_engine import stop_holdback
from engine.utils import cdiv
from kv_transfer.metrics import KvPathMetrics
from kv_transfer.sender import KvSender, OutgoingTransfer
from prefill_svc.allowlist import DecodeAllowlist
from protos.tandem.v1 import common_pb2, decode_pb2_grpc, prefill_pb2
from serving.config import KvTransferConfig
from serving.convert import delta_to_proto, sampling_from_proto_off_loop
from serving.discovery import DiscoveryConfig, Resolver
from serving.errors import ServiceError
from serving.hops import hop
from serving.metrics import Metrics
from serving.rpc import channel
from serving.tls import TlsConfig
from serving.worker_core import MAX_ID_CHARS, WorkerCore

log = logging.getLogger("tandem.prefill")


def handoff_text(first_text: str, params) -> str:
    """The first token's text as an unfinished request shows it. Prefill's engine request ends at the first token
    (max_tokens = 1 + the prior outputs), so it releases all of its text, decoded whole: a character the token
    leaves incomplete shows as U+FFFD. Decode's `commit_prefilled` sees the same token in a running request, whose
    incremental detokenizer holds such a character back until a later token completes it, and which, with stop
    strings, holds back `stop_holdback` characters more (they could start a stop string). Prefill must hold back the
    same characters, or they would reach the client twice (tests/prefill_svc/test_resumed_requests.py: the streamed
    text equals the offline engine's)."""
    text = first_text.rstrip("\ufffd")
    return text[:max(0, len(text) - stop_holdback(params))]


@dataclass
class _Tx:
    """Engine-thread state of one outgoing transfer."""
    num_prompt_tokens: int
    path: int  # kv_transfer_pb2.KvTransferPath
    sent_blocks: int = 0


@dataclass
class _Req:
    """Loop-side state of one request."""
    request_id: str
    num_prompt_tokens: int
    arrival: float
    first: asyncio.Future
    tx: asyncio.Queue | None = None
    blocks_queued: asyncio.Future | None = None  # set once every block message of the prompt is in tx
    transfer: OutgoingTransfer | None = None  # once a decode target was named
    sender: asyncio.Task | None = None  # the transfer (OutgoingTransfer.run), once started


class PrefillCore(WorkerCore):
    role = "prefill"

    def __init__(self, engine, metrics: Metrics, default_kv_timeout_s: float = KvTransferConfig.timeout_s,
                 kv_transfer: str = KvTransferConfig.transport, tls: TlsConfig | None = None,
                 decode_allowlist: list[str] | None = None, max_kv_timeout_s: float = KvTransferConfig.max_timeout_s,
                 discovery: DiscoveryConfig = DiscoveryConfig(), resolver: Resolver | None = None):
        super().__init__(engine, metrics, default_kv_timeout_s, max_kv_timeout_s)
        # The decode instances this prefill may send KV to (None: any the caller names): prefill_svc/allowlist.py.
        self.decode_allowlist = (None if decode_allowlist is None else
                                 DecodeAllowlist(decode_allowlist, discovery, resolver))
        self.sender = KvSender(engine.transfer_kv, kv_transfer)  # validates kv_transfer
        self.path_metrics = KvPathMetrics(metrics, self.model_name, "prefill")
        self._tx: dict[str, _Tx] = {}  # engine thread only
        self._reqs: dict[str, _Req] = {}  # event loop only
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.tls = tls  # mutual TLS to the decode instances (serving/tls.py), or plaintext

    async def start(self) -> None:
        await super().start()
        if self.decode_allowlist is not None:
            await self.decode_allowlist.start()

    async def close(self) -> None:
        await super().close()
        if self.decode_allowlist is not None:
            await self.decode_allowlist.close()
        for ch in self._channels.values():
            await ch.close()

    # ---- engine thread ----------------------------------------------------------------------------------------
    def _add(self, engine, rid: str, prompt: list[int], params, path: int | None, prior: list[int]) -> None:
        """Queued without a future (`submit`): the loop is not woken while the step that follows runs; an error
        reaches the request's `first` future."""
        hop(rid, "prefill.added")
        try:
            engine.add_request(rid, prompt, params, kv_hold=True, prior_output_token_ids=prior)
        except Exception as exc:  # noqa: BLE001 - e.g. a prompt the engine refuses: that request fails
            self.worker.loop.call_soon_threadsafe(self._fail_first, rid, exc)
            return
        if path is not None:
            self._tx[rid] = _Tx(len(prompt) + len(prior), path)

    def _end(self, engine, rid: str) -> None:
        self._tx.pop(rid, None)
        engine.abort(rid)  # frees the held blocks (or the running request's) and forgets it

    def _after_step(self, engine, outs) -> tuple[list, object]:
        payloads = []
        for out in outs:
            if out.new_token_ids:
                hop(out.request_id, "prefill.step_start", self.worker.step_start_ns)
                hop(out.request_id, "prefill.step_end", self.worker.step_end_ns)
            tx = self._tx.get(out.request_id)
            if tx is None:
                continue
            if out.finished and out.finish_reason == "abort":
                self._tx.pop(out.request_id, None)
                continue
            final = out.finished
            n = tx.num_prompt_tokens
            upto = cdiv(n, self.block_size) if final else min(out.num_computed_tokens, n) // self.block_size
            if upto > tx.sent_blocks:
                ids = engine.get_block_ids(out.request_id)[tx.sent_blocks:upto]
                for msg in self.sender.block_messages(engine.transfer_kv, tx.path, tx.sent_blocks, ids, encoded=True):
                    payloads.append((out.request_id, msg))
                tx.sent_blocks = upto
            if final:
                del self._tx[out.request_id]
                payloads.append((out.request_id, None))  # the last block message: the commit may follow
        return payloads, engine.stats()

    def _queued_tokens(self, stats) -> int:
        return stats.num_queued_tokens

    # ---- event loop -------------------------------------------------------------------------------------------
    def _fail_first(self, rid: str, exc: BaseException) -> None:
        r = self._reqs.get(rid)
        if r is not None and not r.first.done():
            r.first.set_exception(exc)

    def _start_sender(self, r: _Req) -> None:
        """Starts r's transfer (open, then the queued block messages) unless it runs already; its failure before
        the first token fails the request."""
        if r.sender is not None:
            return
        r.sender = asyncio.create_task(self._send(r))

        def settled(task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is not None and not r.first.done():
                r.first.set_exception(task.exception())
        r.sender.add_done_callback(settled)

    def _on_step(self, outs, extra) -> None:
        payloads, stats = extra if extra else ([], None)
        for rid, msg in payloads:
            r = self._reqs.get(rid)
            if r is None or r.tx is None:
                continue
            if msg is None:
                if not r.blocks_queued.done():
                    r.blocks_queued.set_result(None)
            else:
                r.tx.put_nowait(msg)
                if not r.first.done():  # a chunk of a longer prompt: its transfer overlaps the next chunks
                    self._start_sender(r)
        for out in outs:
            r = self._reqs.get(out.request_id)
            if r is not None and (out.new_token_ids or out.finished) and not r.first.done():
                hop(out.request_id, "prefill.first_loop")
                r.first.set_result(out)
        if stats is not None:
            self.metrics.observe_step(stats)

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            name = None if self.decode_allowlist is None else self.decode_allowlist.server_name(address)
            ch = self._channels[address] = channel(address, self.tls, server_name=name)
        return ch

    async def check_decode_address(self, address: str) -> None:
        if len(address) > MAX_ID_CHARS:
            raise ValueError(f"decode_address: {len(address)} characters, must be at most {MAX_ID_CHARS}")
        if self.decode_allowlist is not None:
            await self.decode_allowlist.check(address)

    async def prefill(self, request_id: str, prompt: list[int], params_msg: common_pb2.SamplingParams,
                      decode_address: str, kv_timeout_s: float | None, prior: list[int] = (), trace_context=None):
        """Yields PrefillResponse messages: FirstToken, then TransferDone when a decode target took the KV.
        prior: the output tokens a resumed request already sent (FirstToken is the one after them). trace_context:
        the parent of the transfer's span (serving/tracing.py)."""
        self.check_request_id(request_id)
        if decode_address:
            await self.check_decode_address(decode_address)
        kv_timeout_s = self.kv_timeout(kv_timeout_s)
        if request_id in self._reqs:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request_id={request_id!r}: already in flight")
        params = await sampling_from_proto_off_loop(params_msg, n=1)  # validates the request's own parameters
        prior = list(prior)
        self.check_prior(prompt, prior, params)
        k = len(prior)  # the engine request ends at the token after the prior ones, which all count
        first_params = await sampling_from_proto_off_loop(params_msg, n=1, max_tokens=k + 1,
                                                          min_tokens=min(params.min_tokens, k + 1))
        hop(request_id, "prefill.in")
        loop = asyncio.get_running_loop()
        kv_tokens = len(prompt) + k  # what the KV covers (the first new token has none yet)
        r = _Req(request_id, kv_tokens, time.monotonic(), loop.create_future())
        self._reqs[request_id] = r
        try:
            if decode_address:
                r.tx = asyncio.Queue()
                r.blocks_queued = loop.create_future()
                r.transfer = OutgoingTransfer(self.sender, request_id, kv_tokens, decode_address, kv_timeout_s,
                                              self.path_metrics, trace_context)
                await r.transfer.negotiate(decode_pb2_grpc.DecodeStub(self._channel(decode_address)))
            # Nothing else runs on this loop for the request until its first token (or its first chunk's blocks):
            # the engine thread's step does not share the GIL with loop work (submit, not call; the transfer opens
            # after the step).
            self.worker.submit(self._add, request_id, prompt, first_params, r.transfer.path if r.transfer else None,
                               prior)
            out = await r.first  # raises when the engine refused the prompt or the transfer failed before
            if out.finish_reason == "abort":
                raise ServiceError(grpc.StatusCode.INTERNAL, "the engine aborted the request (model step failed)")
            t_first = time.monotonic()
            self.metrics.time_to_first_token_seconds.observe(t_first - r.arrival)
            self.metrics.prompt_tokens.inc(kv_tokens)
            done = (out.finish_reason != "length" or params.max_tokens == k + 1
                    or kv_tokens + 1 >= self.max_model_len)
            delta = delta_to_proto(out)
            if not done:  # the request goes on in decode: the first token is not the last
                delta.finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED
                delta.text = handoff_text(out.new_text, params)
            hop(request_id, "prefill.yield")
            yield prefill_pb2.PrefillResponse(first_token=prefill_pb2.FirstToken(
                delta=delta, num_prompt_tokens=len(prompt), num_cached_tokens=out.num_cached_tokens))
            if r.tx is None or done:
                return
            self._start_sender(r)
            # The engine thread hands over the first token before it reads the prompt's last blocks (the first
            # token must not wait for them): the commit goes after them.
            await r.blocks_queued
            r.tx.put_nowait(self.sender.commit_message(out.new_token_ids[0], out.num_cached_tokens))
            seconds = await r.sender
            tail = time.monotonic() - t_first
            self.metrics.kv_transfer_tail_seconds.observe(tail)
            yield prefill_pb2.PrefillResponse(transfer_done=prefill_pb2.TransferDone(
                transfer_bytes=r.transfer.sent_bytes, num_blocks=r.transfer.sent_blocks, transfer_seconds=seconds,
                tail_seconds=tail, path=r.transfer.path))
        finally:
            self._reqs.pop(request_id, None)
            if r.sender is not None and not r.sender.done():
                r.sender.cancel()
            self.worker.submit(self._end, request_id)

    async def _send(self, r: _Req) -> float:
        """Streams r's transfer to its decode target; returns its duration in seconds once decode acknowledged."""
        return await r.transfer.run(self._channel(r.transfer.address), r.tx)
