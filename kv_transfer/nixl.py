"""The NIXL transport, for KV transfers between hosts: registering a KV cache with a NIXL agent, adding a peer's, and
READing blocks out of it (NIXL's UCX backend: RDMA where the NIC allows, else shared memory or TCP; host memory or
GPU memory).

Decode pulls, as on the CUDA IPC path, so the state machine (receiver.py, sender.py) is the same:
1. The prefill process creates one agent (`NixlCache`), registers its whole KV cache once, and offers the agent's
   metadata and the cache's region in its handshake (`KvHandshakeRequest.nixl`).
2. The decode process creates its agent on the first such handshake (`NixlPeers`), registers its own cache, and adds
   the prefill's agent (one per prefill process, by agent name; a new handshake from it replaces it).
3. Each transfer's open names that prefill cache again (checked against the handshake's), and KvBlocksReady runs
   carry the prefill's block ids; the decode checks them against the registered cache's size and READs them into
   the reserved blocks (`NixlReceiver.write`, on the engine thread): one descriptor per run of ids consecutive on
   both sides (transfers of ~100k descriptors are a known bottleneck), waited for before the engine thread goes on.
   The engine thread is also where reservations are freed, so a read never lands in a freed block; a read that
   outlives its deadline is released (cancelled) first, and one NIXL cannot release is waited for.
4. The ack tells the prefill its blocks were read: it frees them then.

Trust: the prefill's cache is registered as one region, so an agent holding its metadata may read any block of it
(other requests' KV), and the UCX backend does not authenticate peers. NIXL is for trusted peers inside one mesh
(vLLM's NixlConnector makes the same assumption); the decode never writes outside the reservation it granted (its
own descriptors come from the reservation), and NIXL refuses a remote descriptor outside the peer's registered
memory. `--kv-transfer nixl` forces this path, on one host too; `auto` offers it for a CUDA cache only and the
decode takes it between hosts only (CUDA IPC on one host).

Tensor-parallel instances (engine/sharded_kv.py): each rank registers its own cache (its KV heads of every block)
with an agent of its own, in its own process (`rank_offer`, run on every rank through the engine's collective_rpc),
and the prefill's handshake offers them all in rank order (`nixl_ranks`, `RankCaches`). A decode instance of as many
ranks adds, on each rank, the prefill rank of the same number (`rank_add`) and reads each run rank to rank
(`rank_read`): every rank moves its own heads, whole blocks of its own cache, and the run is done when every rank's
read is. Sizes that differ take gRPC bytes (whole blocks through rank 0): a rank's heads would then be a strided part
of another size's blocks, one descriptor per token and layer.

nixl is optional (`nixl-cu12` from PyPI, installed --no-deps beside torch): imported on first use (`import_error`).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import grpc
import torch

from engine.collectives import RankError
from engine.sharded_kv import ShardedKvCache
from kv_transfer.base import NIXL, BlockReceiver, BlockRun, Transport
from kv_transfer.cuda_ipc import CudaIpcSender
from kv_transfer.layout import block_rows
from protos.tandem.v1 import kv_transfer_pb2
from serving.errors import ServiceError, shown

log = logging.getLogger("tandem.kv.nixl")

PACKAGE = "nixl-cu12"
READ_TIMEOUT_S = 30.0  # at most, per run (the transfer's own deadline is usually shorter)
# Prefill agents a decode process keeps (NixlPeers._make_room): far more than a deployment's prefill processes,
# a bound on what restarted ones leave behind.
MAX_PEERS = 64
_POLL_S = 0.0005
_api = None


def import_error() -> str | None:
    """None when nixl can be used here, else why not (in words, naming the package)."""
    global _api
    if _api is None:
        try:
            from nixl_cu12 import _api as api  # noqa: PLC0415 - optional dependency, imported on first use
        except Exception as exc:  # noqa: BLE001 - ImportError, or its native libraries failing to load
            return f"the {PACKAGE} package cannot be imported ({type(exc).__name__}: {exc})"
        _api = api
    return None


def _new_agent(name: str):
    reason = import_error()
    if reason is not None:
        raise RuntimeError(reason)
    agent = _api.nixl_agent(name, _api.nixl_agent_config(backends=["UCX"]))
    if "UCX" not in agent.backends:
        raise RuntimeError(f"{PACKAGE}: the UCX backend did not initialise (plugins: {agent.plugin_list})")
    return agent


def _region(kv_cache: torch.Tensor) -> tuple[str, int, int, int]:
    """(mem_type, base address, bytes, device id) of an engine's KV cache."""
    rows = block_rows(kv_cache)
    if kv_cache.device.type == "cuda":
        return "VRAM", rows.data_ptr(), rows.numel(), kv_cache.device.index
    return "DRAM", rows.data_ptr(), rows.numel(), 0


class NixlCache:
    """A process's agent with its KV cache registered (once: registration pins the memory)."""

    def __init__(self, kv_cache: torch.Tensor, name: str):
        self.agent = _new_agent(name)
        self.name = name
        self.block_bytes = block_rows(kv_cache).shape[1]
        self.mem_type, self.base, self.nbytes, self.device_id = _region(kv_cache)
        self.num_blocks = kv_cache.shape[0]
        self.registered = self.agent.register_memory([(self.base, self.nbytes, self.device_id, "")], self.mem_type)

    def offer(self, with_metadata: bool = True) -> kv_transfer_pb2.NixlCache:
        return kv_transfer_pb2.NixlCache(
            agent_name=self.name, agent_metadata=self.agent.get_agent_metadata() if with_metadata else b"",
            mem_type=self.mem_type, base_address=self.base, device_id=self.device_id, num_blocks=self.num_blocks)


def same_cache(a: kv_transfer_pb2.NixlCache, b: kv_transfer_pb2.NixlCache) -> str | None:
    """None when b describes the same region as a, else the first field that differs."""
    for f in ("agent_name", "mem_type", "base_address", "device_id", "num_blocks"):
        if getattr(a, f) != getattr(b, f):
            return f"open.nixl.{f}={shown(getattr(b, f))}: the handshake registered {shown(getattr(a, f))}"
    return None


def merged_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """(first src id, first dst id, count) of each run of blocks consecutive in both lists, in order."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class NixlPeers:
    """The decode process's agent, its cache registered, and the prefill agents it added (by name). Every agent call
    runs on the engine thread (`on_engine`): the agent is not thread-safe, and reads must be ordered with frees."""

    def __init__(self, name: str, on_engine: Callable[[Callable[[torch.Tensor], object]], Awaitable],
                 max_peers: int = MAX_PEERS):
        self.name = name
        self.on_engine = on_engine
        self.max_peers = max_peers
        self.local: NixlCache | None = None  # created on the first NIXL handshake
        self.peers: dict[str, kv_transfer_pb2.NixlCache] = {}  # agent name -> its cache (loop reads, atomic)
        self.last_used: dict[str, float] = {}  # agent name -> when it was added or last opened a transfer
        # A tensor-parallel decode: a prefill's rank 0 agent name -> every rank's, in rank order (add_ranks).
        self.rank_names: dict[str, list[str]] = {}

    async def add(self, offer: kv_transfer_pb2.NixlCache, block_bytes: int) -> None:
        await self.on_engine(lambda kv_cache: self._add(kv_cache, offer, block_bytes))

    def _add(self, kv_cache: torch.Tensor, offer: kv_transfer_pb2.NixlCache, block_bytes: int) -> None:
        if not offer.agent_name or not offer.agent_metadata:
            raise ValueError("nixl.agent_name and nixl.agent_metadata must be set")
        if offer.mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"nixl.mem_type={shown(offer.mem_type)}: must be DRAM or VRAM")
        if self.local is None:
            self.local = NixlCache(kv_cache, self.name)
        assert self.local.block_bytes == block_bytes, (self.local.block_bytes, block_bytes)
        if offer.agent_name in self.peers:  # the prefill asks again (its transfer failed): start afresh
            self._remove(offer.agent_name)
        self._make_room()
        added = self.local.agent.add_remote_agent(offer.agent_metadata)
        name = added.decode() if isinstance(added, bytes) else added
        if name != offer.agent_name:
            self.local.agent.remove_remote_agent(name)
            raise ValueError(f"nixl.agent_name={shown(offer.agent_name)}: its metadata names agent {shown(name)}")
        peer = kv_transfer_pb2.NixlCache()
        peer.CopyFrom(offer)
        peer.ClearField("agent_metadata")
        self.peers[name] = peer
        self.last_used[name] = time.monotonic()
        log.info("added nixl agent %s (%s, %d blocks) for KV reads", shown(name), offer.mem_type, offer.num_blocks)

    def _make_room(self) -> None:
        """Below max_peers agents, the least recently used go: every prefill process that ever shook hands (a
        restarted one comes back under a new name) would otherwise keep its agent, its metadata and UCX's
        connection here for good. A live prefill whose agent went is refused at its next open (FAILED_PRECONDITION)
        and shakes hands again."""
        while len(self.peers) >= self.max_peers:
            victim = min(self.peers, key=lambda n: self.last_used.get(n, 0.0))
            log.info("dropping nixl agent %s, the least recently used of %d (at most %d are kept)", shown(victim),
                     len(self.peers), self.max_peers)
            if victim in self.rank_names:
                self.forget(victim)  # each rank drops that prefill's rank agents as its own peers fill up
            else:
                self._remove(victim)

    def touch(self, name: str) -> None:
        """A transfer opened from agent `name` (event loop)."""
        if name in self.peers:
            self.last_used[name] = time.monotonic()

    async def add_ranks(self, offers, num_ranks: int) -> None:
        """A tensor-parallel decode of num_ranks ranks: each rank adds the prefill rank of its number (rank_add);
        rank 0's offer then stands for them all here."""
        bad = check_rank_offers(offers, num_ranks)
        if bad is not None:
            raise ValueError(bad)
        raw = [o.SerializeToString() for o in offers]
        await self.on_engine(lambda kv_cache: kv_cache.collective_rpc(rank_add, raw, self.name))
        peer = kv_transfer_pb2.NixlCache()
        peer.CopyFrom(offers[0])
        peer.ClearField("agent_metadata")
        if peer.agent_name not in self.peers:
            self._make_room()
        self.peers[peer.agent_name] = peer
        self.last_used[peer.agent_name] = time.monotonic()
        self.rank_names[peer.agent_name] = [o.agent_name for o in offers]
        log.info("added %d nixl agents (one per rank) of %s for KV reads", len(offers), shown(peer.agent_name))

    def forget(self, name: str) -> None:
        """A tensor-parallel prefill whose read failed: its next transfer must shake hands again."""
        self.peers.pop(name, None)
        self.rank_names.pop(name, None)
        self.last_used.pop(name, None)

    def _remove(self, name: str) -> None:
        self.last_used.pop(name, None)
        if self.peers.pop(name, None) is not None:
            try:
                self.local.agent.remove_remote_agent(name)
            except Exception as exc:  # noqa: BLE001 - already gone on the NIXL side
                log.warning("removing nixl agent %s: %s", shown(name), exc)

    def read(self, kv_cache: torch.Tensor, dst_ids: list[int], peer: kv_transfer_pb2.NixlCache, src_ids: list[int],
             deadline: float) -> None:
        """Engine thread: kv_cache[dst_ids] = the peer's blocks src_ids, complete on return (or raises)."""
        local, bb = self.local, self.local.block_bytes
        runs = merged_runs(src_ids, dst_ids)
        dst = local.agent.get_xfer_descs([(local.base + d * bb, n * bb, local.device_id) for _, d, n in runs],
                                         local.mem_type)
        src = local.agent.get_xfer_descs([(peer.base_address + s * bb, n * bb, peer.device_id) for s, _, n in runs],
                                         peer.mem_type)
        try:
            handle = local.agent.initialize_xfer("READ", dst, src, peer.agent_name)
        except Exception as exc:  # noqa: BLE001 - nixlBind's errors: a peer's region or ids NIXL cannot read
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"ready.block_ids: NIXL refused the read of {len(src_ids)} blocks from "
                               f"{shown(peer.agent_name)} (outside its registered memory?): {exc}") from None
        try:
            state = local.agent.transfer(handle)
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(_POLL_S)
                state = local.agent.check_xfer_state(handle)
        finally:
            self._release(handle, peer.agent_name)
        if state == "PROC":
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, f"nixl read of {len(src_ids)} blocks from "
                                                                  f"{shown(peer.agent_name)} missed its deadline")
        if state != "DONE":
            self._remove(peer.agent_name)  # the peer is gone or broken: its next transfer must shake hands again
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"nixl read of {len(src_ids)} blocks from "
                                                            f"{shown(peer.agent_name)} failed ({state})")

    def _release(self, handle, peer: str) -> None:
        """Releases a transfer (cancelling it when still in progress). One that NIXL cannot release may still write
        into our blocks: wait for it to end before the engine thread may free them."""
        while True:
            try:
                self.local.agent.release_xfer_handle(handle)
                return
            except Exception as exc:  # noqa: BLE001
                if self.local.agent.check_xfer_state(handle) != "PROC":
                    log.error("releasing a nixl read from %s failed: %s", shown(peer), exc)
                    return
                log.warning("a nixl read from %s cannot be released while in progress; waiting for it", shown(peer))
                time.sleep(0.01)


# ---- tensor-parallel instances: one agent per rank, each moving its own KV heads -------------------------------
# These run in each rank's process (through ModelRunner.collective_rpc, on the engine thread of rank 0 and in the
# serving loop of the workers), so their state is the process's own.
_rank_cache: NixlCache | None = None  # a prefill rank's registered cache
_rank_peers: NixlPeers | None = None  # a decode rank's agent and the prefill ranks it added


def rank_offer(runner, name: str) -> bytes:
    """A prefill rank: its cache registered (once) with an agent of its own; returns the serialized NixlCache."""
    global _rank_cache
    if _rank_cache is None:
        _rank_cache = NixlCache(runner.kv_cache, f"{name}-rank{runner.rank}")
    return _rank_cache.offer().SerializeToString()


def rank_add(runner, offers: list[bytes], name: str) -> None:
    """A decode rank: adds the agent of the prefill rank with its own number (registering its cache the first
    time)."""
    global _rank_peers
    if _rank_peers is None:
        _rank_peers = NixlPeers(f"{name}-rank{runner.rank}", on_engine=None)
    _rank_peers._add(runner.kv_cache, kv_transfer_pb2.NixlCache.FromString(offers[runner.rank]),
                     block_rows(runner.kv_cache).shape[1])


def rank_read(runner, dst_ids: list[int], peer_names: list[str], src_ids: list[int], timeout_s: float) -> None:
    """A decode rank: its heads of the prefill's blocks src_ids into its blocks dst_ids (NixlPeers.read)."""
    peer = _rank_peers.peers.get(peer_names[runner.rank]) if _rank_peers is not None else None
    if peer is None:
        raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"nixl agent {shown(peer_names[runner.rank])} is not added here (or its last read failed)")
    _rank_peers.read(runner.kv_cache, dst_ids, peer, src_ids, time.monotonic() + timeout_s)


class RankCaches:
    """A tensor-parallel prefill's offer: every rank's cache registered with its own agent (rank_offer)."""

    def __init__(self, kv_cache, name: str):  # kv_cache: engine/sharded_kv.ShardedKvCache
        self.offers = [kv_transfer_pb2.NixlCache.FromString(raw) for raw in kv_cache.collective_rpc(rank_offer, name)]

    def offer(self, with_metadata: bool = True) -> kv_transfer_pb2.NixlCache:
        """Rank 0's (the open names it; the handshake carries all of them in nixl_ranks)."""
        out = kv_transfer_pb2.NixlCache()
        out.CopyFrom(self.offers[0])
        if not with_metadata:
            out.ClearField("agent_metadata")
        return out


def check_rank_offers(offers, num_ranks: int) -> str | None:
    """Why a handshake's per-rank caches cannot be read rank to rank by an instance of num_ranks ranks, or None."""
    if len(offers) != num_ranks:
        return (f"nixl_ranks: the prefill has {len(offers)} ranks and this decode instance {num_ranks}; NIXL reads "
                "each rank's KV heads rank to rank, which needs equal tensor-parallel sizes (gRPC bytes move whole "
                "blocks between any sizes)")
    if len({o.num_blocks for o in offers}) != 1 or len({o.agent_name for o in offers}) != len(offers):
        return "nixl_ranks: every rank's cache must hold as many blocks, each under an agent name of its own"
    return None


class NixlSender(CudaIpcSender):
    """Only the block ids, in one message (the decode instance reads the blocks), as on the CUDA IPC path."""


class NixlReceiver(BlockReceiver):
    """One transfer's KvBlocksReady runs, READ from the prefill's registered cache into the reserved blocks on the
    engine thread, each waited for there (window 0)."""

    def __init__(self, side):  # side: receiver.KvReceiver
        self.side = side
        self.block_bytes = side.layout.block_bytes
        self.peer: kv_transfer_pb2.NixlCache | None = None
        self.deadline = 0.0

    async def open(self, op: kv_transfer_pb2.KvTransferOpen) -> None:
        if not op.HasField("nixl"):
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "open.nixl: must be set on path=NIXL")
        peer = self.side.nixl.peers.get(op.nixl.agent_name)
        self.side.nixl.touch(op.nixl.agent_name)
        if peer is None:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"open.nixl.agent_name={shown(op.nixl.agent_name)}: no NIXL handshake from that agent "
                               "(or its last read failed): shake hands first")
        bad = same_cache(peer, op.nixl)
        if bad is not None:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, bad)
        self.peer = peer
        self.deadline = time.monotonic() + min(op.deadline_ms / 1000 or READ_TIMEOUT_S, READ_TIMEOUT_S)

    def run(self, msg: kv_transfer_pb2.KvTransferMessage) -> BlockRun:
        src_ids = list(msg.ready.block_ids)
        bad_id = next((i for i in src_ids if i >= self.peer.num_blocks), None)
        if bad_id is not None:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"ready.block_ids: {bad_id} is past the prefill cache's {self.peer.num_blocks} blocks")
        return BlockRun(msg.ready.first_block_index, len(src_ids), len(src_ids) * self.block_bytes, src_ids)

    def write(self, kv_cache: torch.Tensor, block_ids: list[int], run: BlockRun, skip: int) -> None:
        if isinstance(kv_cache, ShardedKvCache):  # every rank reads its own heads from the prefill rank of its number
            names = self.side.nixl.rank_names[self.peer.agent_name]
            try:
                kv_cache.collective_rpc(rank_read, block_ids, names, run.payload[skip:],
                                        max(0.0, self.deadline - time.monotonic()))
            except RankError as e:
                self.side.nixl.forget(self.peer.agent_name)  # its next transfer must shake hands again
                raise ServiceError(e.code or grpc.StatusCode.UNAVAILABLE, str(e)) from None
            return
        self.side.nixl.read(kv_cache, block_ids, self.peer, run.payload[skip:], self.deadline)


TRANSPORT = Transport(path=NIXL, label="nixl", kind="ready", sender=NixlSender, receiver=NixlReceiver)
