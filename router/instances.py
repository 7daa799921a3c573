"""The router's view of its prefill and decode instances: channels, health polling, and the picking policies.

Every `poll_interval_s` each instance gets a grpc.health.v1 Check for its service and a GetLoad; an instance that
fails either (or that a request found unreachable, `mark_down`) leaves the rotation until a poll succeeds again.
An instance that answers NOT_SERVING (draining) only stops getting new requests; one that fails `LOST_AFTER_POLLS`
polls in a row without answering at all is lost: the streams this router has on it are told (`Instance.streams`)
and move elsewhere (router/migration.py). A restarted instance is back in rotation at the first poll after it
answers (the channels' reconnect backoff is capped below the poll interval: serving/rpc.py).

Policies (`--policy`):
- round_robin: healthy instances in turn.
- least_loaded: decode instances by KV-cache usage (polled, in 10 % steps), then by requests this router has in
  flight there; prefill instances by prompt tokens this router has in flight there, then by polled queued tokens.
  The in-flight counts are exact and immediate (this router sends the requests); the polled numbers are at most one
  poll interval old and also cover other routers' requests.
- cache_aware: prefill instances by the prompt tokens each would have to compute before this prompt's first token:
  its queue (in flight from this router + polled queued tokens, as least_loaded) plus this prompt minus the leading
  blocks it likely holds in its prefix cache (router/prefix_index.py: the blocks of the prompts sent there). Prompts
  that share a prefix (a system prompt, a conversation's earlier turns) go where it is cached unless that instance is
  busier than the tokens saved; unrelated prompts spread as under least_loaded. Decode instances as least_loaded.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from engine.args import EngineArgs
from protos.tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from router.prefix_index import PrefixIndex, block_hashes
from serving import health as health_codec
from serving.rpc import channel
from serving.tls import TlsConfig

log = logging.getLogger("tandem.router.instances")

POLICIES = ("round_robin", "least_loaded", "cache_aware")
DEFAULT_BLOCK_SIZE = EngineArgs.block_size  # the engines' default, until an instance's GetLoad says its own
DEFAULT_INDEX_BLOCKS = 1 << 16  # an instance's prefix index before its GetLoad says how many blocks it has
_SERVICES = {"prefill": prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name,
             "decode": decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name}
_STUBS = {"prefill": prefill_pb2_grpc.PrefillStub, "decode": decode_pb2_grpc.DecodeStub}
# Polls in a row that get no answer (an RPC error: refused, reset, timed out) before the streams on an instance move:
# one poll that times out on a busy host moves nothing; a hung or partitioned instance loses its streams after about
# two poll intervals plus the poll timeout. (A killed one breaks its streams at once: they move without waiting.)
LOST_AFTER_POLLS = 2
# An instance that stays down (or never answered) is logged again this often, not at every poll.
DOWN_LOG_EVERY_S = 30.0


@dataclass(eq=False)
class Instance:
    role: str
    address: str
    channel: grpc.aio.Channel
    stub: object
    health: object  # grpc.health.v1 Check, as a callable (serving/health.py)
    healthy: bool = False
    load: common_pb2.InstanceLoad | None = None
    inflight: int = 0  # this router's requests there
    inflight_tokens: int = 0  # their prompt tokens (prefill)
    refused: bool = False  # decode: refused a reservation for room since the last poll
    last_error: str = ""
    failed_polls: int = 0  # polls in a row that got no answer
    down_logged: float | None = None  # monotonic: when its being down was last logged
    # This router's streams on the instance: each callback is called (with why) when the instance is lost.
    streams: set[Callable[[str], None]] = field(default_factory=set)
    prefixes: PrefixIndex = field(default_factory=lambda: PrefixIndex(DEFAULT_INDEX_BLOCKS))  # cache_aware

    @property
    def block_size(self) -> int:
        return (self.load.block_size if self.load is not None else 0) or DEFAULT_BLOCK_SIZE

    def queued_tokens(self) -> int:
        """Prompt tokens ahead of a new one here: this router's in flight, or the polled queue when larger."""
        polled = self.load or common_pb2.InstanceLoad()
        return max(self.inflight_tokens, polled.num_queued_tokens)

    def score(self) -> tuple:
        polled = self.load or common_pb2.InstanceLoad()
        if self.role == "decode":
            return round(polled.kv_cache_usage * 10), self.inflight
        return self.inflight_tokens, polled.num_queued_tokens


@dataclass
class InstancePool:
    role: str
    addresses: list[str]
    policy: str = "round_robin"
    poll_interval_s: float = 1.0
    poll_timeout_s: float = 2.0
    tls: TlsConfig | None = None  # mutual TLS to the instances (serving/tls.py), or plaintext
    instances: list[Instance] = field(init=False)

    def __post_init__(self) -> None:
        if self.role not in _STUBS:
            raise ValueError(f"role={self.role!r}: must be prefill or decode")
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r}: must be one of {', '.join(POLICIES)}")
        if not self.addresses:
            raise ValueError(f"{self.role}_addrs: at least one host:port is needed")
        self.instances = []
        for a in self.addresses:
            ch = channel(a, self.tls)
            self.instances.append(Instance(self.role, a, ch, _STUBS[self.role](ch), health_codec.check_callable(ch)))
        self._rr = itertools.count()
        self._task: asyncio.Task | None = None
        self._up: list[asyncio.Future] = []  # wait_healthy's waiters, woken when an instance turns healthy
        self.ever_healthy = False  # some instance answered a poll once

    async def start(self) -> None:
        await self.poll_once()
        self._task = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for inst in self.instances:
            await inst.channel.close()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self.poll_once()
            except Exception:  # noqa: BLE001 - polling must go on
                log.exception("health poll failed")

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(i) for i in self.instances))

    async def _poll(self, inst: Instance) -> None:
        try:
            status = await inst.health(_SERVICES[self.role], timeout=self.poll_timeout_s)
            if status != health_codec.SERVING:
                raise RuntimeError(f"health status {status} (1 = SERVING)")
            inst.load = await inst.stub.GetLoad(common_pb2.GetLoadRequest(), timeout=self.poll_timeout_s)
        except Exception as e:  # noqa: BLE001
            unanswered = isinstance(e, grpc.aio.AioRpcError)
            msg = e.code().name if unanswered else str(e)
            now = time.monotonic()
            if inst.healthy:
                log.warning("%s %s is down: %s", self.role, inst.address, msg)
                inst.down_logged = now
            elif inst.down_logged is None or now - inst.down_logged >= DOWN_LOG_EVERY_S:
                # (one that never answered, or stays down: said now and then, so an operator sees why nothing runs)
                log.warning("%s %s is unreachable: %s (%d polls in a row)", self.role, inst.address, msg,
                            inst.failed_polls + 1 if unanswered else 1)
                inst.down_logged = now
            inst.healthy, inst.last_error = False, msg
            inst.failed_polls = inst.failed_polls + 1 if unanswered else 0
            if inst.failed_polls >= LOST_AFTER_POLLS and inst.streams:
                log.warning("%s %s: %d polls unanswered (%s); moving its %d stream(s)", self.role, inst.address,
                            inst.failed_polls, msg, len(inst.streams))
                for lost in list(inst.streams):
                    lost(f"{inst.failed_polls} health polls unanswered ({msg})")
            return
        if not inst.healthy:
            log.info("%s %s is up", self.role, inst.address)
            inst.down_logged = None
        inst.healthy, inst.last_error, inst.refused, inst.failed_polls = True, "", False, 0
        self.ever_healthy = True
        waiters, self._up = self._up, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    def mark_down(self, inst: Instance, reason: str) -> None:
        if inst.healthy:
            log.warning("%s %s taken out of rotation: %s", self.role, inst.address, reason)
        inst.healthy, inst.last_error = False, reason

    def healthy(self) -> list[Instance]:
        return [i for i in self.instances if i.healthy]

    async def wait_healthy(self, timeout_s: float) -> bool:
        """Whether some instance is healthy, waiting up to timeout_s for a poll to find one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.healthy():
            left = deadline - loop.time()
            if left <= 0:
                return False
            up = loop.create_future()
            self._up.append(up)
            try:
                await asyncio.wait_for(up, left)
            except TimeoutError:
                pass
        return True

    def ordered(self, prompt: list[int] | None = None) -> list[Instance]:
        """Healthy instances, the policy's first choice first (the others are fallbacks, in order). prompt: the
        request's prompt token ids (cache_aware prefill)."""
        up = self.healthy()
        if not up:
            return []
        if self.policy == "round_robin":
            k = next(self._rr) % len(up)
            return up[k:] + up[:k]
        if self.policy == "cache_aware" and self.role == "prefill" and prompt is not None:
            hashes: dict[int, list[int]] = {}  # block size -> the prompt's block hashes: once, not per instance
            return sorted(up, key=lambda i: (self.prefill_cost(i, prompt, hashes), i.inflight))
        return sorted(up, key=Instance.score)

    @staticmethod
    def prefill_cost(inst: Instance, prompt: list[int], hashes: dict[int, list[int]] | None = None) -> int:
        """Prompt tokens `inst` would compute before this prompt's first token: its queue, plus the prompt less the
        leading blocks it likely has cached (at least the last token is always computed). hashes: the prompt's
        block hashes by block size, filled as needed (shared across the instances of one pick)."""
        bs = inst.block_size
        if hashes is None:
            hashes = {}
        if bs not in hashes:
            hashes[bs] = block_hashes(prompt, bs)
        cached = inst.prefixes.match(hashes[bs]) * bs
        return inst.queued_tokens() + len(prompt) - min(cached, len(prompt) - 1)

    def sent(self, inst: Instance, prompt: list[int]) -> None:
        """A prompt went to `inst`: under cache_aware, its blocks are now likely in that instance's cache."""
        if self.policy != "cache_aware":
            return
        if inst.load is not None and inst.load.num_total_blocks:
            inst.prefixes.capacity_blocks = inst.load.num_total_blocks
        inst.prefixes.insert(block_hashes(prompt, inst.block_size))
