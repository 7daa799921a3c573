"""The step-level engine: requests in, per-step token deltas out.

The life of a request: `add_request` tokenizes the prompt, resolves max_tokens against the context length, and
queues one engine request per completion (n > 1 fans out into children sharing the prompt, which the prefix
cache then shares too). Each `step` asks the scheduler for a batch, runs it through the model runner, appends the
sampled tokens, detokenizes incrementally, applies the stop conditions (stop token ids, EOS, stop strings,
max_tokens, the context length) and returns what changed as `StepOutput`s. Finished requests give their blocks
back, except those added with kv_hold (the prefill service holds them until the KV transfer is acknowledged).

With async scheduling (the default on CUDA) a step schedules and launches the next batch before it reads the tokens
of the batch launched by the previous call, so the host's scheduling, input preparation, detokenization and stop
checks overlap the device's forward pass. A request that stops on a token still in flight has already been given one
more step: that step's token for it is dropped (finished requests are skipped), and its blocks are freed as usual
(the device runs the launched step before any later step that reuses them).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from engine.args import EngineArgs
from engine.collectives import WorkerError
from engine.config import EngineConfig
from engine.cpu_placement import apply_threads, pin_this_thread, usable_cores
from engine.host_kv import HostKVTier
from engine.kv_cache_manager import KVCacheManager
from engine.loader import load_tokenizer, resolve_model
from engine.model_runner import ModelRunner, StepHandle, warm_up_attention
from engine.quant import Fp8Linear
from engine.request import FINISH_REASONS, FINISHED, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sharded_kv import ShardedKvCache
from engine.structured_output import GrammarManager
from engine.tp_executor import TPDriver

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepOutput:
    request_id: str  # the id given to add_request
    index: int  # which of the n completions
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[dict[int, float]] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    stop_reason: int | str | None  # the stop token id or stop string that ended it
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_computed_tokens: int


def stop_holdback(params: SamplingParams) -> int:
    """Characters an unfinished request holds back from its text: they could be the start of a stop string."""
    return max(map(len, params.stop)) - 1 if params.stop else 0


def fast_decoder(tokenizer) -> Callable[[list[int], bool], str]:
    """`decode(ids, skip_special_tokens)` equal to `tokenizer.decode(ids, skip_special_tokens=...)`, without
    transformers' per-call Python (to_py_obj, kwargs, isinstance checks: most of a short call's time; measured:
    bench/RESULTS.md) where that is exact: a fast tokenizer whose decode and _decode are transformers' own and which
    does not clean up spaces, whose text is its Rust backend's decode as it is. Other tokenizers keep their own
    decode."""
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (isinstance(tokenizer, PreTrainedTokenizerFast) and backend is not None
            and cls.decode is PreTrainedTokenizerFast.decode and cls._decode is PreTrainedTokenizerFast._decode
            and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False):
        rust_decode = backend.decode
        return lambda ids, skip: rust_decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


@contextlib.contextmanager
def gc_frozen(collect: bool = False) -> Iterator[None]:
    """Leaves the objects alive on entry (the model, the tokenizer, torch's and transformers' module state: hundreds of
    thousands of objects) out of the garbage collector's full collections until exit (gc.freeze, as vLLM's engine core
    does after start-up). A full collection walking them stalls the step it falls in for many steps' worth of time;
    frozen, the same collections are cheap (measured: bench/host_overhead.py, bench/RESULTS.md). collect=True collects
    first, so that no garbage of the start-up stays frozen. Garbage made inside is collected as usual; on exit the
    frozen objects go back to the oldest generation. Does nothing when something else already froze the heap."""
    if gc.get_freeze_count():
        yield
        return
    if collect:
        gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@dataclass
class EngineStats:
    """What a service reports about its engine (load, metrics). Counters are totals since start."""
    num_running: int
    num_waiting: int
    num_reserved: int  # decode side: blocks reserved for transfers not yet committed
    num_used_blocks: int
    num_total_blocks: int
    num_queued_tokens: int  # tokens scheduled requests still have to compute
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    num_step_tokens: int = 0  # tokens the last step computed, prompt chunks and decodes (0 before the first)
    # The host KV tier (--swap-space; zeros without one). Counters in blocks, hits in tokens.
    num_host_blocks: int = 0
    num_host_used_blocks: int = 0
    num_swapped: int = 0  # preempted requests whose KV waits on the host
    num_swaps: int = 0  # preemptions that swapped (the others recomputed)
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    host_stored_blocks: int = 0  # prefix blocks evicted from the device and kept on the host
    host_prefix_hits: int = 0  # prefix-cache hit tokens copied back from the host (part of prefix_cache_hits)

    @property
    def kv_cache_usage(self) -> float:
        return self.num_used_blocks / self.num_total_blocks


@dataclass
class _Launched:
    sched: object  # SchedulerOutput
    handle: StepHandle
    num_computed: list[int]  # per scheduled request: its tokens with KV once this step has run


@dataclass
class StepStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_batched_tokens: int
    num_preempted: int
    step_seconds: float
    num_seqs: int


class LLMEngine:
    def __init__(self, config: EngineConfig, decode_graphs: bool = True):
        """decode_graphs=False: a prefill worker, whose requests end at their first token, captures no decode
        CUDA graphs (they would never replay)."""
        self.config = config
        apply_threads(config.device.cpu_threads, config.device.cpu_cores)
        self._pin_cores = usable_cores(config.device.cpu_cores)  # pinned by the first step, in its thread
        resolved = resolve_model(config.model.model)
        if resolved.random_seed is not None:
            resolved.random_seed = config.model.seed
        self.resolved = resolved
        self.model_name = config.model.served_model_name or resolved.name
        self.tokenizer = load_tokenizer(resolved, config.model.tokenizer)
        self._decode = fast_decoder(self.tokenizer)
        hf = resolved.config
        limit = hf.max_position_embeddings
        sliding = getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", True) else None
        if sliding:  # we attend to the full context: stay within the window where both agree
            limit = min(limit, sliding)
        max_model_len = config.model.max_model_len or limit
        if max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len}: must be <= {limit} (the model's context length)")
        self.max_model_len = max_model_len
        eos = self._eos_token_ids()
        self.eos_token_ids = eos
        # With tensor parallelism the driver spawns the workers first: they build their shards while the runner
        # builds rank 0's, and the runner sends each step through it.
        self.driver = TPDriver(config, resolved, eos) if config.parallel.tensor_parallel_size > 1 else None
        self._sharded_kv: ShardedKvCache | None = None
        self.runner = None  # (until built: a failed build leaves no graphs to release)
        try:
            self.runner = ModelRunner(config, resolved, eos, link=self.driver)
            self._start(config, decode_graphs)
        except BaseException:
            self._shutdown(graceful=False)
            raise

    def _start(self, config: EngineConfig, decode_graphs: bool) -> None:
        max_model_len = self.max_model_len
        bs = config.cache.block_size
        self.kv = KVCacheManager(self.runner.num_blocks, bs, config.cache.enable_prefix_caching,
                                 host=self._host_tier(config))
        if not self.kv.can_fit(max_model_len):
            raise ValueError(
                f"the KV cache holds {self.runner.num_blocks * bs} tokens ({self.runner.num_blocks} blocks), fewer "
                f"than max_model_len={max_model_len}: raise --kv-cache-memory / --gpu-memory-utilization or lower "
                f"--max-model-len")
        self.scheduler = Scheduler(config.scheduler, self.kv)
        # Structured outputs (engine/structured_output.py): compiles off this thread; the requests waiting for one
        self.grammars = GrammarManager(self.tokenizer, self.runner.hf_config.vocab_size, self.eos_token_ids)
        self._grammar_waiting: list[Request] = []
        if self.runner.device.type == "cuda":
            warm_up_attention(self.runner)
            if not config.model.enforce_eager:
                self.runner.enable_cuda_graphs(max_model_len, decode=decode_graphs)
        self.requests: dict[str, Request] = {}  # engine request id -> request (children of n > 1 included)
        self.children: dict[str, list[str]] = {}  # user request id -> engine request ids
        self.held: dict[str, Request] = {}  # finished kv_hold requests whose blocks are still allocated
        self.reserved = self.scheduler.reserved  # decode side: blocks reserved for a KV transfer (the scheduler counts them)
        self.stream_text = True  # text deltas every step; the offline LLM turns this off (text once, at the end)
        self._pending: list[StepOutput] = []  # outputs produced outside step() (aborts), returned by the next step
        self._launched: _Launched | None = None  # async scheduling: the step on the device whose tokens are unread
        a = config.scheduler.async_scheduling
        self.async_scheduling = self.runner.device.type == "cuda" if a is None else a
        # Tensor-parallel workers then receive each step's sampled tokens: the next step's inputs may be among them.
        self.runner.share_sampled_tokens = self.async_scheduling
        self.last_stats: StepStats | None = None
        self.step_log: list[StepStats] | None = None  # set to [] to keep every step's stats (benchmarks)
        fp8 = sum(isinstance(m, Fp8Linear) for m in self.runner.model.modules())
        log.info("engine ready: model=%s dtype=%s weights=%s kv_cache=%s device=%s tensor_parallel_size=%d "
                 "blocks=%d x %d tokens, max_model_len=%d", self.model_name, self.runner.dtype,
                 f"fp8 ({fp8} linears)" if fp8 else "16-bit" if self.runner.dtype != torch.float32 else "float32",
                 self.runner.kv_dtype, self.runner.device, self.runner.tp_size, self.runner.num_blocks, bs,
                 max_model_len)

    def close(self) -> None:
        """Stops the tensor-parallel workers, if any (also done at interpreter exit); no step runs afterwards."""
        self._shutdown()

    def _shutdown(self, graceful: bool = True) -> None:
        """graceful=False: the workers are killed (they may be inside a collective rank 0 will never join)."""
        grammars = getattr(self, "grammars", None)
        if grammars is not None:
            grammars.close()
        if self.driver is None:
            return
        if self.runner is not None:  # NCCL will not destroy a communicator that a live CUDA graph captured
            self.runner.release_cuda_graphs()
        self.driver.shutdown(graceful)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, decode_graphs: bool = True) -> "LLMEngine":
        return cls(args.create_engine_config(), decode_graphs=decode_graphs)

    def _eos_token_ids(self) -> list[int]:
        ids = set()
        for src in (self.resolved.config, getattr(self.tokenizer, "generation_config", None)):
            e = getattr(src, "eos_token_id", None)
            if isinstance(e, int):
                ids.add(e)
            elif isinstance(e, (list, tuple)):
                ids.update(e)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)

    @property
    def kv_cache(self):
        return self.runner.kv_cache

    @property
    def transfer_kv(self):
        """The KV cache as a KV transfer reads and writes it: the cache tensor itself, or with tensor parallelism a
        ShardedKvCache (every KV head of a block, moved through rank 0: engine/sharded_kv.py)."""
        if self.runner.tp_size == 1:
            return self.runner.kv_cache
        if self._sharded_kv is None:
            self._sharded_kv = ShardedKvCache(self.runner)
        return self._sharded_kv

    # ---- requests -------------------------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    def validate(self, prompt_token_ids: list[int], params: SamplingParams,
                 prior_output_token_ids: list[int] = ()) -> int:
        """Checks a prompt (and a resumed request's prior outputs) against the model and returns the resolved
        max_tokens, which counts the prior outputs."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt: must not be empty")
        if n >= self.max_model_len:
            raise ValueError(f"prompt: {n} tokens, must be fewer than max_model_len={self.max_model_len}")
        vocab = self.runner.hf_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")
        room = self.max_model_len - n
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(f"max_tokens={params.max_tokens}: prompt ({n} tokens) + max_tokens must be <= "
                             f"max_model_len={self.max_model_len}")
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if prior_output_token_ids:
            k = len(prior_output_token_ids)
            if params.n != 1:
                raise ValueError(f"n={params.n}: prior_output_token_ids belong to one completion; resume each "
                                 "completion as its own request (n=1, seed + its index)")
            bad = next((t for t in prior_output_token_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"prior_output_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")
            if k >= max_tokens:
                limit = (f"max_tokens={params.max_tokens}" if params.max_tokens is not None else
                         f"max_model_len={self.max_model_len} - the prompt's {n} tokens")
                raise ValueError(f"prior_output_token_ids: {k} tokens, must be fewer than {limit} (they count "
                                 "towards it and the request must have a token left to generate)")
        return max_tokens

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    kv_hold: bool = False, prior_output_token_ids: list[int] | None = None) -> list[int]:
        """Queues a request; returns its prompt token ids. Raises ValueError naming the field on bad input.

        prior_output_token_ids resumes a completion that generated these tokens elsewhere (a migrated stream, n=1):
        it continues as if it had never moved. Its KV is computed for prompt + prior outputs (the prompt part may
        hit the prefix cache); max_tokens, min_tokens, the penalties and the stop conditions count the prior
        outputs; with the seed it draws what the original would have (engine/sampler.py). Its outputs continue the
        original's: new_token_ids and new_logprobs hold only the new tokens, num_output_tokens counts the prior
        ones too, and the text deltas start where the original's stream of the same tokens left off (the text it
        held back for a stop string included). Prior outputs on which the original would already have stopped
        are a ValueError."""
        if request_id in self.children or request_id in self.reserved:
            raise ValueError(f"request_id={request_id!r}: already in use")
        prompt_token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        prior = list(prior_output_token_ids or ())
        max_tokens = self.validate(prompt_token_ids, params, prior)
        ids = []
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(rid, prompt_token_ids, params, max_tokens, parent_id=request_id, index=i, kv_hold=kv_hold)
            self._resume(req, prior)
            self._attach_grammar(req)  # (the same for every child: the first raises before any is queued)
            self.requests[rid] = req
            self.scheduler.add_request(req)
            ids.append(rid)
        self.children[request_id] = ids
        return prompt_token_ids

    def abort(self, request_id: str) -> None:
        """Ends a request wherever it is (waiting, running, held, reserved) and frees its blocks."""
        if request_id in self.reserved:
            req = self.reserved.pop(request_id)
            req.status = RequestStatus.FINISHED_ABORTED  # (before free: a finished request's block hashes go too)
            self.kv.free(req)
            return
        for rid in self.children.get(request_id, ()):
            req = self.requests.get(rid)
            if req is None:
                continue
            if not req.is_finished:
                req.kv_hold = False
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                self._pending.append(self._output(req, [], None))
                self._forget(req)
        self.release_kv(request_id)

    def release_kv(self, request_id: str) -> None:
        """Prefill side: the KV transfer is acknowledged (or failed): give the held blocks back."""
        for rid in self.children.get(request_id, [request_id]):
            req = self.held.pop(rid, None)
            if req is not None:
                self.kv.free(req)
                self._forget(req)

    def get_block_ids(self, request_id: str) -> list[int]:
        return list(self.kv.get_block_ids(request_id))

    def _host_tier(self, config: EngineConfig) -> HostKVTier | None:
        gib = config.cache.swap_space
        if not gib:
            return None
        n = HostKVTier.blocks_for(gib, self.runner.kv_bytes_per_block)
        if n < 1:
            raise ValueError(f"swap_space={gib} GiB holds no KV block of {self.runner.kv_bytes_per_block} bytes")
        log.info("host KV tier: %d blocks (%.2f GiB%s)", n, gib, ", pinned" if self.runner.device.type == "cuda" else "")
        replicate = None
        if self.driver is not None:  # every rank keeps its heads of the same host blocks
            self.driver.call("enable_host_kv", n)
            driver = self.driver
            replicate = lambda ops: driver.call("host_kv_copies", ops)  # noqa: E731
        return HostKVTier([self.runner.kv_cache], n, replicate)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or self._launched is not None

    def stats(self) -> EngineStats:
        """A snapshot built from counters and C-level copies: safe to call from another thread (one step stale)."""
        sched, kv = self.scheduler, self.kv
        reqs = list(sched.waiting) + list(sched.running)
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting), num_reserved=len(self.reserved),
            num_used_blocks=kv.num_blocks - kv.pool.num_free_blocks, num_total_blocks=kv.num_blocks,
            num_queued_tokens=sum(max(0, r.num_tokens - r.num_computed_tokens) for r in reqs),
            prefix_cache_queries=kv.prefix_queries, prefix_cache_hits=kv.prefix_hits,
            num_preemptions=sched.num_preemptions,
            num_step_tokens=self.last_stats.num_batched_tokens if self.last_stats is not None else 0,
            **self._host_stats())

    def _host_stats(self) -> dict:
        host = self.kv.host
        if host is None:
            return {}
        return dict(num_host_blocks=host.num_blocks, num_host_used_blocks=host.num_blocks - len(host.free),
                    num_swapped=sum(r.swapped_blocks is not None for r in list(self.scheduler.waiting)),
                    swapped_out_blocks=host.swapped_out, swapped_in_blocks=host.swapped_in,
                    host_stored_blocks=host.stored, host_prefix_hits=self.kv.host_hits,
                    num_swaps=self.scheduler.num_swaps)

    # ---- decode side of a KV transfer ------------------------------------------------------------------------
    def reserve_prefilled(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                          prior_output_token_ids: list[int] | None = None) -> list[int] | None:
        """Reserves blocks for a prompt whose KV will arrive from a prefill instance. None: no room now, either in the
        pool or under the scheduler's admission watermark (the blocks left would not cover the expected growth of
        the requests already admitted; engine/scheduler.py).
        prior_output_token_ids: a resumed request (add_request says how it behaves): the KV to arrive covers
        prompt + prior outputs, and commit_prefilled's token is the one after them.
        With prefix caching the prompt's leading full blocks that this engine already holds (an earlier transferred
        prompt's, registered at its commit) are shared, not reserved again: the first
        `reused_prefix_blocks(request_id)` of the returned ids already hold this prompt's KV, and a transfer must
        not write them (other requests may be reading them)."""
        if request_id in self.children or request_id in self.reserved:
            raise ValueError(f"request_id={request_id!r}: already in use")
        if params.n != 1:
            raise ValueError(f"n={params.n}: a transferred request carries one completion; fan out in the router")
        prior = list(prior_output_token_ids or ())
        max_tokens = self.validate(prompt_token_ids, params, prior)
        req = Request(request_id, prompt_token_ids, params, max_tokens)
        self._resume(req, prior)
        self._attach_grammar(req)
        hits, num_hit_tokens = self.kv.get_computed_blocks(req)
        if (not self.scheduler.can_reserve(req, hits)
                or not self.kv.allocate_slots(req, req.num_tokens - num_hit_tokens, hits)):
            req.status = RequestStatus.FINISHED_ABORTED  # (so that free drops its block hashes too)
            self.kv.free(req)
            return None
        req.num_cached_tokens = num_hit_tokens
        req.status = RequestStatus.RESERVED
        self.reserved[request_id] = req
        return list(self.kv.get_block_ids(request_id))

    def reused_prefix_blocks(self, request_id: str) -> int:
        """Of a reservation's blocks, how many leading ones this engine already held (see reserve_prefilled)."""
        return self.reserved[request_id].num_cached_tokens // self.kv.block_size

    def commit_prefilled(self, request_id: str, first_token_id: int) -> StepOutput:
        """The prompt's KV has arrived: the request joins the batch with its first token already emitted (by the
        prefill instance, which drew it, seeded, for the same position as this engine would have).
        Returns the first token's output (not returned again by step); it may already be finished."""
        req = self.reserved.pop(request_id)
        req.num_computed_tokens = req.num_tokens  # the prompt and any prior outputs
        req.num_cached_tokens = 0
        self.kv.cache_blocks(req, req.num_computed_tokens)
        self.requests[request_id] = req
        self.children[request_id] = [request_id]
        self.scheduler.add_running(req)
        out = self._append_token(req, first_token_id, None)
        if out.finished:
            self._forget(req)
        return out

    # ---- stepping -------------------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Returns the outputs of a step whose device work is complete (its KV blocks may be read), plus aborts.
        With async scheduling the next step is already running on the device when this returns."""
        if self._pin_cores is not None:
            pin_this_thread(self._pin_cores)
            self._pin_cores = None
        outputs, self._pending = self._pending, []
        t0 = time.perf_counter()
        if self._grammar_waiting:
            outputs += self._activate_grammars()
        prev, self._launched = self._launched, None
        if prev is not None and prev.handle.needs_sync:
            outputs += self._read_step(prev)
            prev = None
        sched = self.scheduler.schedule()
        unread = [prev] if prev is not None else []

        def read_prev(fill=None) -> None:
            """The previous step's tokens, read and applied (once): after this step's launch, or, when the step has
            grammar rows, from its sampler (fill: what fills their mask, run once the matchers took the tokens)."""
            if unread:
                outputs.extend(self._read_step(unread.pop(), fill))
            elif fill is not None:
                fill()

        if not sched.is_empty:
            tables = self.kv.block_tables([req.request_id for req, _ in sched.scheduled])
            try:
                # A grammar row's mask is filled with this step's forward pass already queued: the previous step's
                # tokens are read there (before_mask), not before the launch, so the matchers' work and the fill
                # overlap the device's.
                handle = self.runner.execute(sched, tables, prev.handle if prev is not None else None,
                                             before_mask=read_prev)
            except WorkerError:  # the tensor-parallel group is gone: no later step can run either
                raise
            except Exception:
                log.exception("model step failed; aborting the %d requests of this batch", len(sched.scheduled))
                outputs += self._abort_batch(sched)
            else:
                self._launched = _Launched(sched, handle, [r.num_computed_tokens for r, _ in sched.scheduled])
        read_prev()
        if not self.async_scheduling and self._launched is not None:
            launched, self._launched = self._launched, None
            outputs += self._read_step(launched)
        if sched.is_empty and prev is None and self._grammar_waiting and not outputs:
            # Nothing to run until a grammar compiles: wait for one a moment rather than spin the engine thread.
            concurrent.futures.wait([r.grammar.future for r in self._grammar_waiting], timeout=0.01,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        self._record_stats(sched, t0)
        return outputs

    def _abort_batch(self, sched) -> list[StepOutput]:
        """One bad batch must not take the engine down: end the requests in it, free their blocks."""
        outputs = []
        for req, _ in sched.scheduled:
            if req.is_finished:
                continue
            req.kv_hold = False
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            outputs.append(self._output(req, [], None))
            self._forget(req)
        return outputs

    def _read_step(self, launched: _Launched, fill=None) -> list[StepOutput]:
        """Reads a launched step's tokens and applies them: append, detokenize, stop checks.
        The constrained rows' tokens go into their matchers on the grammar thread (GrammarManager.step_job), then
        `fill` (the next step's mask, when the sampler passed it) runs there too, while this thread does the rest
        of each token's work but the grammar's checks, which wait for the thread."""
        sched, handle = launched.sched, launched.handle
        try:
            sampled = handle.result()
        except Exception:
            log.exception("model step failed; aborting the %d requests of this batch", len(sched.scheduled))
            outputs = self._abort_batch(sched)
            if fill is not None:
                fill()  # (its aborted rows' tokens are dropped)
            return outputs
        outputs: list[StepOutput | None] = []
        self.scheduler.update_from_output(sched)
        job = None
        if self.grammars.num_compiles:  # (some request was ever constrained)
            job = self._start_grammar_job(handle.requests, sampled.token_ids, fill)
        elif fill is not None:
            fill()
        deferred = []  # (place in outputs, request, token, logprobs): the grammar's checks wait for the job
        for req, token, lp in zip(handle.requests, sampled.token_ids, sampled.logprobs):
            if req.is_finished:  # it stopped on the token before this one (or was aborted): drop this one
                continue
            if job is not None and req.grammar is not None and req.grammar.active:
                self._append_token(req, token, lp, grammar_busy=True)
                deferred.append((len(outputs), req, token, lp))
                outputs.append(None)
                continue
            out = self._append_token(req, token, lp)
            if out.finished:
                self._forget(req)
            outputs.append(out)
        if job is not None:
            try:
                job.result()
                failed = False
            except Exception:  # noqa: BLE001 - xgrammar's; the constrained requests of the step end, not the engine
                log.exception("structured outputs: the matchers failed; aborting the step's constrained requests")
                failed = True
            for place, req, token, lp in deferred:
                out = outputs[place] = self._grammar_checks(req, token, lp, failed)
                if out.finished:
                    self._forget(req)
        # Prefill chunks that sampled nothing still report progress (the prefill service streams their blocks), as
        # of this step: a step launched after it may still be writing the next chunk's KV.
        if all(sched.samples):
            return outputs
        for (req, _), samples, done in zip(sched.scheduled, sched.samples, launched.num_computed):
            if not samples and req.kv_hold and not req.is_finished:
                out = self._output(req, [], None)
                out.num_computed_tokens = done
                outputs.append(out)
        return outputs

    def _start_grammar_job(self, requests: list[Request], token_ids: list[int], fill):
        """Starts the step's tokens into the matchers of the requests that will append them (one batch on several
        threads: GrammarManager.accept), then `fill`, on the grammar thread; None when there is nothing to do.
        Until it is done this thread touches no matcher (_append_token's grammar_busy)."""
        grammars, tokens = [], []
        for req, token in zip(requests, token_ids):
            g = req.grammar
            if (g is not None and g.active and not req.is_finished and g.num_accepted == len(req.output_token_ids)
                    and not g.terminated):
                grammars.append(g)
                tokens.append(token)
        if not grammars and fill is None:
            return None
        return self.grammars.step_job(grammars, tokens, fill)

    def _record_stats(self, sched, t0: float) -> None:
        self.last_stats = StepStats(len(self.scheduler.running), len(self.scheduler.waiting), self.kv.usage(),
                                    sched.num_batched_tokens, len(sched.preempted), time.perf_counter() - t0,
                                    len(sched.scheduled))
        if self.step_log is not None:
            self.step_log.append(self.last_stats)

    def _attach_grammar(self, req: Request) -> None:
        """Gives a structured-outputs request its grammar; one already compiled is activated at once (a cached
        constraint), so that prior outputs the grammar refuses are a ValueError here."""
        grammar = self.grammars.grammar_for(req.sampling_params)
        if grammar is None:
            return
        req.grammar = grammar
        if grammar.future.done():
            err = grammar.activate(req.output_token_ids)
            if err is not None:
                raise ValueError(err if "structured_outputs:" in err else f"prior_output_token_ids: {err}")
        else:
            self._grammar_waiting.append(req)

    def _activate_grammars(self) -> list[StepOutput]:
        """Activates the grammars whose compile finished; a request whose grammar failed ends (aborted)."""
        outputs, still = [], []
        for req in self._grammar_waiting:
            if req.is_finished:
                continue
            if req.status == RequestStatus.RESERVED or not req.grammar.future.done():
                still.append(req)  # (a reservation activates once committed: its first token is not known yet)
                continue
            err = req.grammar.activate(req.output_token_ids)
            if err is None and not req.grammar.terminated:
                continue
            if err is not None:
                log.warning("request %s: %s; aborting it", req.request_id, err)
                req.kv_hold = False
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED if err else RequestStatus.FINISHED_STOPPED)
            outputs.append(self._output(req, [], None))
            self._forget(req)
        self._grammar_waiting = still
        return outputs

    def _append_token(self, req: Request, token: int, logprobs: dict[int, float] | None,
                      grammar_busy: bool = False) -> StepOutput | None:
        """grammar_busy: the request's matcher is taking this token on the grammar thread: everything but the
        grammar's checks and the stops after them (length), and no output yet: _grammar_checks does the rest."""
        req.output_token_ids.append(token)
        if not grammar_busy and self._grammar_refused(req, token):
            return self._output(req, [token], logprobs)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if req.logprobs is not None and logprobs is not None:
            req.logprobs.append(logprobs)
            req.cumulative_logprob += logprobs.get(token, 0.0)
        if self.stream_text or req.sampling_params.stop:
            self._detokenize(req)
        status = self._check_stop_tokens(req, token)
        if status is None and not grammar_busy:
            status = self._check_stop_end(req)
        if status is not None:
            self._finish_on_token(req, status)
        return None if grammar_busy else self._output(req, [token], logprobs)

    def _grammar_checks(self, req: Request, token: int, logprobs: dict[int, float] | None,
                        failed: bool) -> StepOutput:
        """The rest of _append_token(grammar_busy=True) once the grammar thread is done (failed: it raised)."""
        if not req.is_finished:
            if failed:
                req.kv_hold = False
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            elif not self._grammar_refused(req, token):
                status = self._check_stop_end(req)
                if status is not None:
                    self._finish_on_token(req, status)
        return self._output(req, [token], logprobs)

    def _grammar_refused(self, req: Request, token: int) -> bool:
        """Brings the request's matcher up to its outputs (they are accepted already after a step's batch accept);
        a token it refuses ends the request (aborted) and gives True."""
        grammar = req.grammar
        if grammar is None or not grammar.active or grammar.advance(req.output_token_ids) is None:
            return False
        # Only a token the mask allowed is sampled: a refused one came from elsewhere (a prefill instance's first
        # token that another constraint drew). It ends this request, not the batch.
        log.warning("request %s: token %d is not allowed by its structured_outputs; aborting it", req.request_id, token)
        req.kv_hold = False
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return True

    def _finish_on_token(self, req: Request, status: RequestStatus) -> None:
        if not isinstance(req.stop_reason, str):
            # The final text is the whole decode (an incomplete trailing character shows as U+FFFD), unless a stop
            # string cut it.
            skip = req.sampling_params.skip_special_tokens
            req.output_text = self._decode(req.output_token_ids, skip)
        self.scheduler.finish(req, status)
        if req.kv_hold:
            self.held[req.request_id] = req

    def _resume(self, req: Request, prior_output_token_ids: list[int]) -> None:
        """Gives a new request the outputs it already generated elsewhere, with the state the original had after
        them: each token goes through what _append_token did with it there (detokenization, the stop checks, the
        text released to the stream), so the next text delta starts where the original's left off."""
        for i, token in enumerate(prior_output_token_ids):
            req.output_token_ids.append(token)
            if self.stream_text or req.sampling_params.stop:
                self._detokenize(req)
            status = self._check_stop(req, token)
            if status is not None:
                raise ValueError(f"prior_output_token_ids: the request already finished ({FINISH_REASONS[status]}, "
                                 f"{req.stop_reason!r}) at output token {i}; resume only an unfinished one")
            self._output(req, [], None)  # advances sent_text_len as the original's stream did

    def _detokenize(self, req: Request) -> None:
        """Incremental detokenization (vLLM's scheme): decode the few newest tokens with some context before them,
        and append what they add once it is whole characters. Costs O(new tokens) per step, not O(output)."""
        ids = req.output_token_ids
        skip = req.sampling_params.skip_special_tokens
        prefix = self._decode(ids[req.prefix_offset:req.read_offset], skip)
        text = self._decode(ids[req.prefix_offset:], skip)
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            req.output_text += text[len(prefix):]
            req.prefix_offset = req.read_offset
            req.read_offset = len(ids)

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        status = self._check_stop_tokens(req, token)
        return status if status is not None else self._check_stop_end(req)

    def _check_stop_tokens(self, req: Request, token: int) -> RequestStatus | None:
        """The stops that come before the grammar's: end-of-sequence, stop tokens and strings (past min_tokens)."""
        p = req.sampling_params
        n_out = len(req.output_token_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if p.stop_token_ids and token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if p.stop:
                text = req.output_text
                window = max(map(len, p.stop)) + 16
                start = max(0, req.sent_text_len - window)
                for s in p.stop:
                    i = text.find(s, start)
                    if i >= 0:
                        req.output_text = text[: i + len(s)] if p.include_stop_str_in_output else text[:i]
                        req.stop_reason = s
                        return RequestStatus.FINISHED_STOPPED
        return None

    def _check_stop_end(self, req: Request) -> RequestStatus | None:
        """The grammar's end, then the length limits."""
        if req.grammar is not None and req.grammar.terminated:  # it accepted the end (even with ignore_eos)
            return RequestStatus.FINISHED_STOPPED
        n_out = len(req.output_token_ids)
        if n_out >= req.max_tokens or len(req.prompt_token_ids) + n_out >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _output(self, req: Request, new_tokens: list[int], logprobs: dict[int, float] | None) -> StepOutput:
        status = req.status
        finished = status in FINISHED
        text, sent = req.output_text, req.sent_text_len
        if finished:
            text_end = len(text)
        else:
            text_end = len(text) - stop_holdback(req.sampling_params)
            if text_end < sent:
                text_end = sent
        new_text = text[sent:text_end] if text_end > sent else ""
        if text_end > sent:
            req.sent_text_len = text_end
        # Positional, in StepOutput's field order: keywords cost more a call, once per request every step (measured:
        # bench/RESULTS.md).
        return StepOutput(
            req.parent_id, req.index, new_tokens, new_text,
            [logprobs] if (logprobs is not None and req.logprobs is not None) else None,
            finished, FINISH_REASONS[status] if finished else None, req.stop_reason, len(req.prompt_token_ids),
            len(req.output_token_ids), req.num_cached_tokens, req.num_computed_tokens)

    def _forget(self, req: Request) -> None:
        """Drops a finished request from the tables (held requests stay until release_kv)."""
        if req.request_id in self.held:
            return
        self.requests.pop(req.request_id, None)
        siblings = self.children.get(req.parent_id)
        if siblings is not None and all(self.requests.get(r) is None for r in siblings):
            del self.children[req.parent_id]
