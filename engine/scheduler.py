"""Token-budget scheduling: chunked prefill and decode through one code path.

Every request has num_computed_tokens catching up with num_tokens. Each step the scheduler hands out a token budget:
running requests first (a decode needs 1 token, an unfinished prefill the rest of its prompt, clipped to the budget),
then waiting ones in arrival order, which first reuse their longest cached prefix. When the pool cannot hold a running
request's next tokens, the most recently admitted request is preempted: its blocks are freed and it is recomputed
later from its tokens, or, with a host KV tier (--swap-space), its blocks are copied to the host and back when it is
admitted again (`_should_swap` says which). A single request always fits in an empty pool (checked when the engine
starts), so the loop cannot deadlock.

Admission keeps a watermark so that admitted requests rarely preempt each other (SGLang's new_token_ratio): a waiting
request is admitted only while the free blocks, less what the running and reserved requests are expected to grow
into, still hold its own expected blocks. A request's expected blocks are its tokens so far plus new_token_ratio x
the output it may still produce. The ratio starts at `SchedulerConfig.new_token_ratio`, decays towards a seventh of
it while steps run without preemption (requests often stop well before max_tokens), and is raised on a preemption
to at least the share of max_tokens the running requests have used. With nothing running or reserved, the first
waiting request is admitted whenever it fits. The decode service's reservations go through the same check
(`can_reserve`), behind the preempted requests waiting for their blocks back.

A scheduled step is accounted for at once (vLLM v1's rule): num_computed_tokens advances when the step is scheduled,
and a request whose step reaches its last token owes one sampled token (num_inflight_tokens) until the engine reads
it. So the next step can be scheduled while this one runs on the GPU (async scheduling): a decode's input is then the
token still in flight, which the model runner takes from the previous step's sampled tokens on the device.
"""
from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.utils import cdiv

# The watermark's schedule, SGLang's defaults: from its start value the ratio decays linearly to
# _MIN_RATIO_FACTOR x it over _DECAY_STEPS steps without a preemption; after one it is at least the share of
# max_tokens the running requests have used, each counted _PREEMPT_MARGIN_TOKENS ahead (RETRACT_DECODE_STEPS).
_MIN_RATIO_FACTOR = 0.14
_DECAY_STEPS = 600
_PREEMPT_MARGIN_TOKENS = 20


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, num_new_tokens), in batch order
    preempted: list[Request] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)  # per scheduled request: the step ends on its last token

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Decode side: requests whose blocks are reserved for a KV transfer (LLMEngine.reserve_prefilled), not yet
        # running; their growth counts against admission.
        self.reserved: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_swaps = 0  # preemptions whose request was swapped out instead of recomputed
        self.init_ratio = config.new_token_ratio
        self.min_ratio = self.init_ratio * _MIN_RATIO_FACTOR
        self.ratio_decay = (self.init_ratio - self.min_ratio) / _DECAY_STEPS
        self.new_token_ratio = self.init_ratio

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """A request whose blocks are already allocated (decode side, after a KV transfer)."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.grammar_pending:  # decode side: committed before its grammar compiled
                i += 1
                continue
            num_out, inflight = len(req.output_token_ids), req.num_inflight_tokens
            # An input may be the one token in flight (the model runner takes it from the last step's samples).
            num_new = len(req.prompt_token_ids) + num_out + (inflight > 0) - req.num_computed_tokens
            if num_new > budget:
                num_new = budget
            if num_new <= 0 or num_out + inflight >= req.max_tokens:
                # Async scheduling: the next input is not sampled yet, or the token in flight is its last
                # (max_tokens): nothing to do until the engine reads it.
                i += 1
                continue
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append((req, num_new))
                budget -= num_new
                i += 1
                continue
            break

        # Admit waiting requests only when nothing had to be preempted this step, and while the watermark holds.
        room = None  # headroom(), once a request is checked against it; less each admitted request's need
        compiling = []  # waiting requests whose grammar is still compiling: they keep their place in the queue
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            if req.grammar_pending:
                compiling.append(self.waiting.popleft())
                continue
            assert req.num_inflight_tokens == 0, req  # the step that preempted it admitted nobody
            if req.swapped_blocks is not None:  # its KV is on the host: back in, then on from where it was
                if self.init_ratio and (self.running or self.reserved):
                    if room is None:
                        room = self.headroom()
                    need = self.need(req)
                    if need > room:
                        break
                    room -= need
                num_new = min(req.num_tokens - req.num_computed_tokens, budget)
                if not self.kv.swap_in(req, num_new):
                    break
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                out.scheduled.append((req, num_new))
                budget -= num_new
                continue
            hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            if self.init_ratio and (self.running or self.reserved):
                if room is None:
                    room = self.headroom()
                need = self.need(req, hits)
                if need > room:
                    break
                room -= need
            num_new = min(req.num_tokens - num_hit_tokens, budget)
            if not self.kv.allocate_slots(req, num_new, hits):
                break
            self.waiting.popleft()
            if req.status == RequestStatus.WAITING:
                req.num_cached_tokens = num_hit_tokens
            req.num_computed_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append((req, num_new))
            budget -= num_new
        if compiling:
            self.waiting.extendleft(reversed(compiling))

        samples_list = out.samples
        for req, n in out.scheduled:
            req.num_computed_tokens += n
            samples = req.num_computed_tokens == (len(req.prompt_token_ids) + len(req.output_token_ids)
                                                  + req.num_inflight_tokens)
            req.num_inflight_tokens += samples
            samples_list.append(samples)
        if self.init_ratio:
            if out.preempted:
                self._raise_ratio()
            elif out.scheduled:
                self.new_token_ratio = max(self.min_ratio, self.new_token_ratio - self.ratio_decay)
        return out

    # ---- the admission watermark ----------------------------------------------------------------------------
    def expected_blocks(self, req: Request) -> int:
        """Blocks req is expected to hold at its end: its tokens so far and new_token_ratio x the output it may
        still produce."""
        out = len(req.output_token_ids) + req.num_inflight_tokens
        tokens = len(req.prompt_token_ids) + out + math.ceil(self.new_token_ratio * max(0, req.max_tokens - out))
        return cdiv(tokens, self.kv.block_size)

    def headroom(self) -> int:
        """Free blocks less what the running and reserved requests are expected to take still."""
        held = self.kv.req_to_blocks
        growth = 0
        for r in itertools.chain(self.running, self.reserved.values()):
            g = self.expected_blocks(r) - len(held.get(r.request_id, ()))
            if g > 0:
                growth += g
        return self.kv.pool.num_free_blocks - growth

    def need(self, req: Request, hits: Sequence[int] = ()) -> int:
        """Free blocks admitting req (which holds none) takes, now and as it grows: its expected blocks, less the
        prefix hits `hits` that other requests hold already."""
        ref_cnt = self.kv.pool.ref_cnt
        return self.expected_blocks(req) - sum(1 for b in hits if ref_cnt[b] > 0)

    def can_reserve(self, req: Request, hits: Sequence[int] = ()) -> bool:
        """Whether a decode reservation for req (its prefix hits `hits`) keeps the watermark, behind the preempted
        requests waiting to come back (they hold no blocks: all they are expected to take is counted). With nothing
        running, reserved or waiting, any reservation that fits is granted (the caller allocates)."""
        if not self.init_ratio or not (self.running or self.reserved or self.waiting):
            return True
        waiting = sum(self.expected_blocks(r) for r in self.waiting)
        return self.need(req, hits) <= self.headroom() - waiting

    def _raise_ratio(self) -> None:
        """A step preempted: admitted requests outgrew the estimate. The ratio goes back to at least its start
        value, and to the share of max_tokens the running requests have used when that is higher."""
        used = sum(len(r.output_token_ids) + r.num_inflight_tokens + _PREEMPT_MARGIN_TOKENS for r in self.running)
        total = sum(r.max_tokens for r in self.running)
        observed = used / total if total else 1.0
        self.new_token_ratio = min(1.0, max(self.init_ratio, self.new_token_ratio, observed))

    def _preempt(self, req: Request) -> None:
        if self._should_swap(req) and self.kv.swap_out(req):
            self.num_swaps += 1  # its computed tokens stay computed: their KV waits on the host
        else:
            self.kv.free(req)
            req.num_computed_tokens = 0  # a token in flight still arrives, as the last of its tokens
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _should_swap(self, req: Request) -> bool:
        """Swap rather than recompute (SchedulerConfig.preemption_mode). Under auto, a request holding at least one
        full block of computed KV is swapped: a token's KV crosses the host link twice (2 x 2 x layers x KV heads x
        head_dim bytes), while recomputing it is a row of the whole model (2 x parameters FLOPs), and with grouped
        KV heads the copy is the cheaper by several times (measured on the H200, bench/RESULTS.md: swapping
        requests of 512-768 tokens beat recomputing them). A request with less than a block computed is
        recomputed: one small chunk of a step that runs anyway, no host block taken."""
        if self.kv.host is None or self.config.preemption_mode == "recompute":
            return False
        return self.config.preemption_mode == "swap" or req.num_computed_tokens >= self.kv.block_size

    def update_from_output(self, out: SchedulerOutput) -> None:
        """The step's sampled tokens are read (the engine appends them next): they are no longer in flight, and
        full blocks whose tokens are all known enter the prefix cache (KV a later step still writes is ordered
        before any reader of the block on the device)."""
        cache_blocks = self.kv.cache_blocks if self.kv.enable_caching else None
        for (req, _), samples in zip(out.scheduled, out.samples):
            if samples:
                req.num_inflight_tokens -= 1
            if cache_blocks is not None and not req.is_finished:
                cache_blocks(req, min(req.num_computed_tokens, len(req.prompt_token_ids) + len(req.output_token_ids)))

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Ends a request; frees its blocks unless it holds them for a KV transfer (kv_hold)."""
        assert status.finished
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        if not req.kv_hold:
            self.kv.free(req)
