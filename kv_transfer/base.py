"""The interfaces of a KV transfer: the states one goes through, a transport's two halves, and what the receiver
is handed by the service that owns the reservations.

- `KvPoll`: the state of one transfer, on either side (SGLang's KVPoll, same order). `TransferState` holds it and
  the states it went through; the sender (`sender.OutgoingTransfer`) and the receiver (`receiver.KvReceiver`) move
  it, log it, and count a failure by the state it happened in (`metrics.KvPathMetrics.failed`).
- `Transport`: one way of moving a run of blocks, named by its protobuf `KvTransferPath`: its sending half
  (`BlockSender`: the messages that ship a run) and its receiving half (`BlockReceiver`: how a received run lands in
  the reserved block ids, and what must complete before the commit). One module per transport (`grpc_bytes`,
  `cuda_ipc`, `nixl`); `registry` maps the path to it.
- `Reservations` / `Reservation`: what the decode service hands the receiver (it owns the reservations and the
  engine thread), so that kv_transfer/ never imports a service.
"""
from __future__ import annotations

import abc
import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from protos.tandem.v1 import kv_transfer_pb2

log = logging.getLogger("tandem.kv")

GRPC = kv_transfer_pb2.KV_TRANSFER_PATH_GRPC
CUDA_IPC = kv_transfer_pb2.KV_TRANSFER_PATH_CUDA_IPC
NIXL = kv_transfer_pb2.KV_TRANSFER_PATH_NIXL
AUTO = "auto"  # --kv-transfer: the path each decode instance's handshake allows


class KvPoll(enum.IntEnum):
    """Where one transfer stands (SGLang's KVPoll: the same states, in the same order)."""
    FAILED = 0
    BOOTSTRAPPING = 1  # sender: agreeing on the path; receiver: the open arrived, waiting for its reservation
    WAITING = 2  # the transfer is open (checked, on the receiver): no block run has moved yet
    TRANSFERRING = 3  # block runs are moving
    SUCCESS = 4  # committed (receiver) and acknowledged (sender)


@dataclass
class TransferState:
    """The KvPoll of one transfer and the states it went through, in order. States only move forward; FAILED and
    SUCCESS are final."""
    request_id: str
    role: str  # "send" | "receive"
    state: KvPoll = KvPoll.BOOTSTRAPPING
    seen: list[KvPoll] = field(default_factory=lambda: [KvPoll.BOOTSTRAPPING])

    @property
    def done(self) -> bool:
        return self.state in (KvPoll.SUCCESS, KvPoll.FAILED)

    def advance(self, to: KvPoll) -> None:
        """Moves to `to` (no-op when there already)."""
        if to == self.state:
            return
        assert not self.done and (to == KvPoll.FAILED or to > self.state), (self.request_id, self.state, to)
        log.debug("kv %s of %s: %s -> %s", self.role, self.request_id, self.state.name, to.name)
        self.state = to
        self.seen.append(to)


@dataclass
class BlockRun:
    """A received run of blocks, checked by its transport: positions first_block_index.. of the request's block
    table, `nbytes` of KV (counted and acknowledged), and what the transport's `write` needs (`payload`: the bytes on
    GRPC, the prefill's block ids on CUDA_IPC and NIXL)."""
    first_block_index: int
    num_blocks: int
    nbytes: int
    payload: Any


class BlockSender(abc.ABC):
    """The sending half of a transport, one per sending process (engine thread)."""

    @abc.abstractmethod
    def block_messages(self, kv_cache: torch.Tensor, first_block_index: int, block_ids: list[int],
                       blocks_per_message: int, encoded: bool) -> list:
        """The messages that ship blocks `block_ids` (positions first_block_index.. of the request's block table),
        complete in `kv_cache` once the current stream's work is done; a message carries at most
        blocks_per_message blocks' bytes. `encoded`: messages may be pre-encoded (grpc_bytes.KvBlocksOut)."""

    @abc.abstractmethod
    def payload(self, msg) -> tuple[int, int] | None:
        """(KV bytes, blocks) that `msg` moves when it is one of this transport's block messages, else None."""


class BlockReceiver(abc.ABC):
    """The receiving half of a transport, for one transfer. The receiver calls, in order: `open` once, then per
    block message `run` (loop) and `write` (engine thread, only while the reservation lives), then `before_commit`
    (engine thread, inside the commit)."""
    window_bytes: int = 0
    """Payload whose writes may be queued on the engine thread and not done yet; 0: each write is waited for
    before the next message is read."""

    async def open(self, op: kv_transfer_pb2.KvTransferOpen) -> None:
        """This path's checks of the open, and what it must prepare (errors: ServiceError naming the field)."""

    @abc.abstractmethod
    def run(self, msg) -> BlockRun:
        """One of this path's block messages as a BlockRun, its own fields checked (ServiceError naming the field)."""

    @abc.abstractmethod
    def write(self, kv_cache: torch.Tensor, block_ids: list[int], run: BlockRun, skip: int) -> None:
        """Engine thread: lands run's blocks after its `skip` leading ones (a prefix already held) in `block_ids`."""

    def before_commit(self) -> None:
        """Engine thread, inside the commit: waits for what the writes left in flight."""


@dataclass(frozen=True)
class Transport:
    """One way of moving runs of blocks, and its registry entry (registry.TRANSPORTS)."""
    path: int  # kv_transfer_pb2.KvTransferPath
    label: str  # the --kv-transfer value and the metrics' `path` label
    kind: str  # the KvTransferMessage field its block runs travel in
    sender: Callable[..., BlockSender]  # (layout) -> the sending half of a process
    receiver: Callable[..., BlockReceiver]  # (receiver.KvReceiver) -> the receiving half of one transfer


class Reservation(Protocol):
    """One request's reserved blocks, as the receiver of its transfer sees them (decode_svc's loop-side state)."""
    num_prompt_tokens: int
    block_ids: list[int]
    num_reused: int  # leading block_ids whose KV this engine already holds (a shared prefix): not written again
    transfer_open: bool  # set by the receiver: a second open for the reservation is refused
    committed: bool  # set by the receiver once the request is in the batch


class Reservations(Protocol):
    """What the receiver is handed by the decode service, which owns the reservations, the KV cache and the engine
    thread. The engine-thread calls run fn(kv_cache) in order with everything else queued there."""

    async def reservation(self, request_id: str) -> Reservation | None:
        """request_id's live reservation, once made (a transfer may open before it); None if there is none."""

    def is_live(self, request_id: str, r: Reservation) -> bool:
        """Loop side: r is still request_id's reservation and its deadline has not passed."""

    def write(self, request_id: str, fn: Callable[[torch.Tensor], None]) -> asyncio.Future:
        """Queues fn(kv_cache) (a write or a copy into the reserved blocks) on the engine thread, run only while the
        reservation lives (else ABORTED); its failure makes the commit refuse."""

    def commit(self, request_id: str, first_token_id: int, before: Callable[[], None]) -> asyncio.Future:
        """Queues the commit on the engine thread, after the writes queued before it: checks they all succeeded,
        runs before(), and puts the request in the batch; the future's result is its first StepOutput."""

    def on_engine(self, fn: Callable[[torch.Tensor], Any]) -> Awaitable[Any]:
        """Runs fn(kv_cache) on the engine thread (e.g. mapping a peer's cache), not tied to a reservation."""

    def committed(self, r: Reservation, out) -> None:
        """Loop side: the request is in the batch (out: the commit's StepOutput)."""

    def failed(self, request_id: str, err: Exception) -> None:
        """Loop side: the transfer failed (err: a ServiceError); the request's Decode call ends with it."""

