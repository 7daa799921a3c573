"""Token-budget scheduling: chunked prefill and decode through one code path.

Every request has num_computed_tokens catching up with num_tokens. Each step the scheduler hands out a token budget:
running requests first (a decode needs 1 token, an unfinished prefill the rest of its prompt, clipped to the budget),
then waiting ones in arrival order, which first reuse their longest cached prefix. When the pool cannot hold a running
request's next tokens, the most recently admitted request is preempted: its blocks are freed and it is recomputed
later from its tokens. A single request always fits in an empty pool (checked when the engine starts), so the loop
cannot deadlock.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, num_new_tokens), in batch order
    preempted: list[Request] = field(default_factory=list)

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
        self.num_preemptions = 0

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
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            assert num_new > 0, req
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

        # Admit waiting requests only when nothing had to be preempted this step.
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            hits, num_hit_tokens = self.kv.get_computed_blocks(req)
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
        return out

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_from_output(self, out: SchedulerOutput) -> None:
        """The step ran: the scheduled tokens now have KV, and newly full blocks enter the prefix cache."""
        for req, n in out.scheduled:
            req.num_computed_tokens += n
            self.kv.cache_blocks(req, req.num_computed_tokens)

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
