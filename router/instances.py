"""The router's view of its prefill and decode instances: channels, health polling, and the picking policies.

Every `poll_interval_s` each instance gets a grpc.health.v1 Check for its service and a GetLoad; an instance that
fails either (or that a request found unreachable, `mark_down`) leaves the rotation until a poll succeeds again.
An instance that answers NOT_SERVING (draining) only stops getting new requests; one that fails `LOST_AFTER_POLLS`
polls in a row without answering at all is lost: the streams this router has on it are told (`Instance.streams`)
and move elsewhere (router/migration.py). A restarted instance is back in rotation at the first poll after it
answers (the channels' reconnect backoff is capped below the poll interval: serving/rpc.py). Each change of an
instance's state (up, unreachable, not serving, mismatched) is logged once, the first poll's included.

Identity (`Expected`): the router tokenizes the prompts and the workers detokenize the ids, so each GetLoad is also
compared with what this router serves: the model's vocab_size and the tokenizer's fingerprint (engine/tokenizer.py:
its vocabulary and special tokens), which decide what the ids mean, and the served model name and max_model_len,
which are only said (a warning once per change). An instance that differs in the first two is
mismatched: out of the rotation, as an unhealthy one (no request goes there), with an error naming its address,
the field, both values and the flag to fix (said again every DOWN_LOG_EVERY_S while it lasts, and at once when the
difference changes), and tandem:router_instances{state="mismatched"}; it is back at the first poll that matches
(the worker restarted with the right flags). A field an older instance does not report (0 or "") is not checked,
said once per instance.

Discovery (serving/discovery.py): an entry whose host is a name stands for one instance per address it resolves to,
looked up again every `discovery.refresh_interval_s`. An address that appears joins as a new instance, in rotation
after its first good poll; one that vanishes leaves the rotation at once (no new requests), but its channel stays
open and polled while this router has calls there: the requests in flight finish on it (a pod being drained), or
move if it is lost, as above; then its channel closes. An address that comes back before that rejoins as it was.

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
from serving.discovery import Discovery, DiscoveryConfig, Resolver, entry_host, is_ip
from serving.metrics import Metrics
from serving.rpc import channel
from serving.tls import TlsConfig

log = logging.getLogger("tandem.router.instances")
DOWN_LOG_EVERY_S = 30.0  # an instance that stays down is logged again this often

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


@dataclass(frozen=True)
class Expected:
    """What this router serves, which every instance's GetLoad must report too (a zero or empty field here: not
    checked)."""
    model: str = ""  # served model name
    vocab_size: int = 0  # the model's (the logits' width)
    tokenizer_fingerprint: str = ""  # engine.tokenizer.tokenizer_fingerprint of the router's tokenizer
    max_model_len: int = 0


# The fields that decide what the token ids mean: an instance that differs in one gets no requests. The others
# (the served name, max_model_len) are said, not enforced: a worker with a shorter context refuses a longer request
# itself, and a name set on the router alone (what clients see) is a common, harmless setup.
MUST_MATCH = ("vocab_size", "tokenizer_fingerprint")
# The flag that sets each field, on the router and the workers alike (the fix when they differ).
FIX_FLAGS = {"model": "--served-model-name (or --model)", "vocab_size": "--model",
             "tokenizer_fingerprint": "--tokenizer (or --model)", "max_model_len": "--max-model-len"}


@dataclass(frozen=True)
class Mismatch:
    field: str
    theirs: object
    ours: object

    def __str__(self) -> str:
        return (f"its {self.field} is {self.theirs!r}, this router's {self.ours!r} (give the router and the "
                f"workers the same {FIX_FLAGS[self.field]})")


def compare(expected: Expected, load: common_pb2.InstanceLoad) -> tuple[list[Mismatch], list[str]]:
    """The fields in which `load` differs from `expected`, and those it does not report (0 or "": an older
    instance; a fingerprint of another FINGERPRINT_VERSION counts as not reported): those are not checked."""
    from engine.tokenizer import FINGERPRINT_VERSION

    found, unreported = [], []
    for name in FIX_FLAGS:
        ours, theirs = getattr(expected, name), getattr(load, name)
        if not ours:
            continue
        if name == "tokenizer_fingerprint" and theirs and not theirs.startswith(FINGERPRINT_VERSION + ":"):
            theirs = ""
        if not theirs:
            unreported.append(name)
        elif theirs != ours:
            found.append(Mismatch(name, theirs, ours))
    return found, unreported


@dataclass(eq=False)
class Instance:
    role: str
    address: str  # ip:port (or the entry as given, when its host is an IP): what prefill is told to send KV to
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
    entry: str = ""  # the --prefill/--decode entry it came from (a name, or the address itself)
    state: str = ""  # what the log said last: "up", "unreachable", "not serving", "mismatched" ("": nothing yet)
    leaving: bool = False  # its address vanished from DNS: out of rotation, kept while calls are open there
    reported_at: float = 0.0  # monotonic: when its state was last logged
    mismatch: str = ""  # how its last GetLoad differs from what this router serves ("": it does not)
    unreported_said: bool = False  # the fields it does not report were logged
    soft_mismatch: str = ""  # how it differs in the fields not in MUST_MATCH (said once per change)
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
    addresses: list[str]  # host:port entries; a host that is a name stands for the addresses it resolves to
    policy: str = "round_robin"
    poll_interval_s: float = 1.0
    poll_timeout_s: float = 2.0
    tls: TlsConfig | None = None  # mutual TLS to the instances (serving/tls.py), or plaintext
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    resolver: Resolver | None = None  # how names resolve (default: the discovery config's)
    metrics: Metrics | None = None  # tandem:router_instances, when given
    expected: Expected | None = None  # what every instance must serve (None: not checked)
    # How long the channel of an instance that left DNS waits for the calls still open on it, once this router
    # tracks none there (gRPC closes it as soon as they end): a prefill stream's tail (to TransferDone), a
    # reservation whose stream is about to start. Past it they are cancelled.
    close_grace_s: float = 600.0
    instances: list[Instance] = field(init=False)  # the rotation (healthy or not)

    def __post_init__(self) -> None:
        if self.role not in _STUBS:
            raise ValueError(f"role={self.role!r}: must be prefill or decode")
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r}: must be one of {', '.join(POLICIES)}")
        if not self.addresses:
            raise ValueError(f"{self.role}_addrs: at least one host:port is needed")
        self.instances = []
        self.leaving: list[Instance] = []  # vanished from DNS, calls still open there
        self._closing: dict[asyncio.Task, grpc.aio.Channel] = {}
        self._rr = itertools.count()
        self._task: asyncio.Task | None = None
        self._up: list[asyncio.Future] = []  # wait_healthy's waiters, woken when an instance turns healthy
        self.ever_healthy = False  # some instance answered a poll once
        self.names = Discovery(self.role, list(self.addresses), self.discovery, self.resolver, self._membership)
        self._membership(self.names.addresses)  # the IP literals' instances, before any lookup

    def _open(self, address: str, entry: str) -> Instance:
        host = entry_host(entry)
        # TLS checks a resolved address's certificate against the name it came from (pods' certificates name
        # their service, not their addresses).
        ch = channel(address, self.tls, server_name=None if is_ip(host) else host)
        return Instance(self.role, address, ch, _STUBS[self.role](ch), health_codec.check_callable(ch), entry=entry)

    def _membership(self, found: dict[str, str]) -> None:
        """The rotation becomes the instances of `found` (address -> entry): new addresses join (in rotation
        after their first good poll), vanished ones leave it (kept, polled, while calls are open there)."""
        current = {i.address: i for i in self.instances}
        for inst in [i for a, i in current.items() if a not in found]:
            self.instances.remove(inst)
            inst.leaving = True
            self.leaving.append(inst)
            log.info("%s %s (%s) left DNS: out of rotation%s", self.role, inst.address, inst.entry,
                     f"; its {inst.inflight} call(s) in flight finish there" if inst.inflight else "")
        back = {i.address: i for i in self.leaving if i.address in found}
        for address, entry in found.items():
            if address in current:
                continue
            if address in back:
                inst = back[address]
                self.leaving.remove(inst)
                inst.leaving = False
                log.info("%s %s (%s) is back in DNS", self.role, address, entry)
            else:
                inst = self._open(address, entry)
                if entry != address:
                    log.info("%s %s (%s) joins: in rotation after its first good health poll", self.role, address,
                             entry)
            self.instances.append(inst)
        self._reap()
        self._publish()

    def _reap(self) -> None:
        """Closes the channels of the instances that left and have nothing of this router's in flight."""
        for inst in [i for i in self.leaving if not i.inflight and not i.streams]:
            self.leaving.remove(inst)
            task = asyncio.get_running_loop().create_task(inst.channel.close(self.close_grace_s))
            self._closing[task] = inst.channel
            task.add_done_callback(self._closing.pop)

    def _publish(self) -> None:
        if self.metrics is None:
            return
        up = sum(i.healthy for i in self.instances)
        mismatched = sum(not i.healthy and bool(i.mismatch) for i in self.instances)
        self.metrics.set_router_instances(self.role, healthy=up, unhealthy=len(self.instances) - up - mismatched,
                                          mismatched=mismatched, leaving=len(self.leaving))

    async def start(self) -> None:
        """Resolves the names (unless `resolve` did), polls every instance once, then both go on in the
        background."""
        await self.names.start()
        await self.poll_once()
        self._task = asyncio.create_task(self._poll_forever())

    async def resolve(self) -> None:
        """The first lookup of the names (the instances they give are there, not polled yet)."""
        await self.names.refresh()

    async def close(self) -> None:
        await self.names.close()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for inst in self.instances + self.leaving:
            await inst.channel.close()
        self.instances, self.leaving = [], []
        for task, ch in list(self._closing.items()):  # this router stops: its calls there end now
            task.cancel()
            await ch.close()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self.poll_once()
            except Exception:  # noqa: BLE001 - polling must go on
                log.exception("health poll failed")

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(i) for i in self.instances + self.leaving))
        self._reap()
        self._publish()

    def _report(self, inst: Instance, state: str, detail: str = "") -> None:
        """Logs inst's state when it changed since the last report, and a state other than up again every
        DOWN_LOG_EVERY_S (an instance that stays down, or never answered, is said now and then, so an operator sees
        why nothing runs there)."""
        now = time.monotonic()
        if state == inst.state and (state == "up" or now - inst.reported_at < DOWN_LOG_EVERY_S):
            return
        inst.state, inst.reported_at = state, now
        where = f"{self.role} {inst.address}" + (f" ({inst.entry})" if inst.entry != inst.address else "")
        if state == "up":
            log.info("%s is up", where)
        elif state == "mismatched":
            log.error("%s serves another model or tokenizer than this router, so it gets no requests until a poll "
                      "finds it matching: %s", where, detail)
        else:
            log.warning("%s is %s: %s", where, state, detail)

    async def _poll(self, inst: Instance) -> None:
        try:
            status = await inst.health(_SERVICES[self.role], timeout=self.poll_timeout_s)
            if status != health_codec.SERVING:
                raise RuntimeError(f"health status {status} (1 = SERVING)")
            inst.load = await inst.stub.GetLoad(common_pb2.GetLoadRequest(), timeout=self.poll_timeout_s)
        except Exception as e:  # noqa: BLE001
            unanswered = isinstance(e, grpc.aio.AioRpcError)
            msg = e.code().name if unanswered else str(e)
            polls = inst.failed_polls + 1 if unanswered else 1
            self._report(inst, "unreachable" if unanswered else "not serving", f"{msg} ({polls} polls in a row)")
            inst.healthy, inst.last_error, inst.mismatch = False, msg, ""
            inst.failed_polls = inst.failed_polls + 1 if unanswered else 0
            if inst.failed_polls >= LOST_AFTER_POLLS and inst.streams:
                log.warning("%s %s: %d polls unanswered (%s); moving its %d stream(s)", self.role, inst.address,
                            inst.failed_polls, msg, len(inst.streams))
                for lost in list(inst.streams):
                    lost(f"{inst.failed_polls} health polls unanswered ({msg})")
            return
        if self._mismatched(inst):
            return
        self._report(inst, "up")
        inst.healthy, inst.last_error, inst.mismatch, inst.refused, inst.failed_polls = True, "", "", False, 0
        if inst.leaving:
            return
        self.ever_healthy = True
        waiters, self._up = self._up, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    def _mismatched(self, inst: Instance) -> bool:
        """Whether inst's fresh GetLoad differs from what this router serves; if so it leaves the rotation (it
        answered: its streams stay where they are), said once per change of the difference."""
        if self.expected is None:
            return False
        found, unreported = compare(self.expected, inst.load)
        if unreported and not inst.unreported_said:
            inst.unreported_said = True
            log.warning("%s %s does not report its %s (an older Tandem?): not checked against this router's",
                        self.role, inst.address, ", ".join(unreported))
        soft = "; ".join(str(m) for m in found if m.field not in MUST_MATCH)
        if soft != inst.soft_mismatch:
            inst.soft_mismatch = soft
            if soft:
                log.warning("%s %s differs from this router (requests still go there): %s", self.role,
                            inst.address, soft)
        found = [m for m in found if m.field in MUST_MATCH]
        if not found:
            return False
        detail = "; ".join(map(str, found))
        if detail != inst.mismatch:
            inst.state = ""  # a new difference is said at once
        self._report(inst, "mismatched", detail)
        inst.healthy, inst.last_error, inst.mismatch, inst.failed_polls = False, "mismatched: " + detail, detail, 0
        return True

    def mark_down(self, inst: Instance, reason: str) -> None:
        if inst.healthy:
            log.warning("%s %s taken out of rotation: %s", self.role, inst.address, reason)
            inst.state = "unreachable"  # (logged: the next poll that finds it so says nothing new)
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
