"""Structured outputs: the grammars that constrain what a request may generate, through xgrammar.

The life of a constrained request (SamplingParams.structured_outputs set):
1. `StructuredOutputsParams` checks the constraint where it is built (router, services, offline API):
   `check_constraint` parses it into an xgrammar `Grammar` (no tokenizer needed, linear in its size; cached by
   the canonical constraint), so a schema, regex or grammar xgrammar cannot take is a ValueError naming the field.
2. The engine asks its `GrammarManager` for the request's `RequestGrammar`. Compiling a grammar against the
   vocabulary (the token masks xgrammar precomputes) can take from milliseconds to minutes for a large schema, so
   it runs on the manager's worker thread, never in the engine's step or on an event loop, once per distinct
   constraint (a bounded LRU of compiled grammars; n > 1 completions and repeated schemas share one).
3. Until its grammar is compiled the request is not scheduled (vLLM's WAITING_FOR_FSM); then the engine builds its
   matcher and replays the output tokens it already has (a migrated request's prior outputs, the first token the
   prefill instance drew): a matcher always stands after the request's last output token.
4. Each step that samples for it, the sampler's `TokenMasks` fills the request's row of the step's token bitmask
   from the matcher (`fill_bitmask`: the constrained rows only, packed, on xgrammar's threads) and masks the logits
   with it on their device (kernels/token_bitmask.py) before any other processing (vLLM applies the grammar bitmask
   to the logits before its sampler runs). The engine accepts each sampled token into the matcher when it reads
   the step; under async scheduling that is inside the next step, once its forward pass is queued and before its
   mask is filled (Sampler.sample's before_mask), so the matchers and the fill run while the device computes
   rather than between steps. When the matcher terminates (it accepted the end-of-sequence token) the request
   finishes with "stop"; a step already launched for it by then leaves its row unmasked and drops its token.
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from functools import lru_cache

import torch

# (No import of engine.sampling_params, even for types: it imports this module to check constraints.)

log = logging.getLogger(__name__)

# Distinct constraints whose compiled grammars an engine keeps (each holds per-state token masks: up to a few MB
# for a large schema over a 150k-token vocabulary).
MAX_CACHED_GRAMMARS = 256
# accept() gives each thread at least this many rows (fewer would cost more in hand-offs than they save).
MIN_ACCEPT_ROWS_PER_THREAD = 16
# xgrammar's errors start with "[time] /path/file.cc:line: "; the rest is the message for the user.
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _xgr():
    import xgrammar

    return xgrammar


def _clean(e: Exception) -> str:
    return _XGR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)


def _no_additional_properties(schema):
    """The schema with `additionalProperties: false` on every object schema that does not say (vLLM's
    disable_additional_properties)."""
    if isinstance(schema, dict):
        out = {k: _no_additional_properties(v) for k, v in schema.items()}
        if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_no_additional_properties(v) for v in schema]
    return schema


def _choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF whose root is exactly one of the strings (JSON string literals are valid EBNF literals for xgrammar)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@lru_cache(maxsize=MAX_CACHED_GRAMMARS)
def _parse(key: tuple):
    """The xgrammar Grammar of a canonical constraint (StructuredOutputsParams.key())."""
    xgr = _xgr()
    kind, value, compact, no_additional = key
    if kind == "json" or kind == "json_object":
        schema = json.loads(value) if kind == "json" else {"type": "object"}
        if no_additional:
            schema = _no_additional_properties(schema)
        return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=not compact)
    if kind == "regex":
        return xgr.Grammar.from_regex(value)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(_choice_grammar(value))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(value)
    if kind == "structural_tag":
        tag = json.loads(value)
        if isinstance(tag, dict) and "structures" in tag:  # the legacy form vLLM also takes
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in tag["structures"]]
            return xgr.Grammar.from_structural_tag(items, tag["triggers"])
        return xgr.Grammar.from_structural_tag(value)
    raise AssertionError(kind)


def check_constraint(so) -> None:
    """Raises ValueError naming the field when xgrammar cannot take the constraint (a StructuredOutputsParams)."""
    try:
        _parse(so.key())
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError, its own errors, KeyError/TypeError above
        raise ValueError(f"structured_outputs.{so.kind}: invalid ({_clean(e)})") from None


class RequestGrammar:
    """One request's grammar: the compile it waits for, then its matcher, which stands after the first
    `num_accepted` output tokens."""

    __slots__ = ("future", "matcher", "num_accepted")

    def __init__(self, future: concurrent.futures.Future):
        self.future = future
        self.matcher = None
        self.num_accepted = 0

    @property
    def active(self) -> bool:
        return self.matcher is not None

    def activate(self, output_token_ids: list[int]) -> str | None:
        """Builds the matcher (the compile is done) and replays the output so far; returns why it cannot, or None."""
        try:
            compiled = self.future.result()
        except Exception as e:  # noqa: BLE001
            return f"structured_outputs: the grammar did not compile ({_clean(e)})"
        self.matcher = _xgr().GrammarMatcher(compiled)
        return self.advance(output_token_ids)

    def advance(self, output_token_ids: list[int]) -> str | None:
        """Accepts the output tokens not accepted yet; returns the error of the first one the grammar refuses."""
        while self.num_accepted < len(output_token_ids):
            token = output_token_ids[self.num_accepted]
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                return (f"output token {self.num_accepted} (id {token}) is not allowed by the request's "
                        "structured_outputs")
            self.num_accepted += 1
        return None

    @property
    def terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()


class GrammarManager:
    """One engine's grammars: the tokenizer's vocabulary as xgrammar sees it (built on the first constrained
    request, on the worker thread), the compiler, and the LRU of compiles (finished or under way)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int],
                 max_cached: int = MAX_CACHED_GRAMMARS):
        """vocab_size: the model's logits width, which may exceed the tokenizer's vocabulary (padding rows: the
        grammar never allows them)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.max_cached = max_cached
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self._cache: OrderedDict[tuple, concurrent.futures.Future] = OrderedDict()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._accept_pool: concurrent.futures.ThreadPoolExecutor | None = None  # accept()'s other threads
        self._step_pool: concurrent.futures.ThreadPoolExecutor | None = None  # step_job's thread
        self.num_compiles = 0  # compiles started (cache misses)

    def compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                xgr = _xgr()
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids or None)
                # Our LRU keeps the compiled grammars; xgrammar's own cache would keep a second copy.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _compile(self, key: tuple):
        return self.compiler().compile_grammar(_parse(key))

    def grammar_for(self, params) -> RequestGrammar | None:
        """The grammar of a request with these SamplingParams (its compile started or shared), or None for an
        unconstrained request."""
        so = params.structured_outputs
        if so is None:
            return None
        key = so.key()
        fut = self._cache.get(key)
        if fut is not None:
            self._cache.move_to_end(key)
            return RequestGrammar(fut)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        fut = self._executor.submit(self._compile, key)
        self.num_compiles += 1
        self._cache[key] = fut
        fut.add_done_callback(lambda f, key=key: (f.cancelled() or f.exception() is not None) and self._drop(key, f))
        while len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)  # requests that hold its future keep it alive
        return RequestGrammar(fut)

    def _drop(self, key: tuple, fut: concurrent.futures.Future) -> None:
        """A failed compile leaves the cache (the next request with it tries again). Runs on the worker thread, or
        in grammar_for when the future is already done: pop is atomic under the GIL."""
        if self._cache.get(key) is fut:
            self._cache.pop(key, None)

    def accept(self, grammars: list[RequestGrammar], tokens: list[int]) -> None:
        """One step's tokens into active, unterminated matchers that stand after every output token but this one:
        each one accepted counts (num_accepted); a refused one leaves its matcher as it was, for advance() to
        report. xgrammar's batch accept runs without the GIL, so the rows are split over fill_threads() threads (a
        JSON matcher takes tens of microseconds a token: serial, 256 rows would outlast a 7B model's decode step)."""
        matchers = [g.matcher for g in grammars]
        batch_accept = _xgr().BatchGrammarMatcher.batch_accept_token
        threads = min(fill_threads(), len(matchers) // MIN_ACCEPT_ROWS_PER_THREAD)
        if threads <= 1:
            results = batch_accept(matchers, tokens)
        else:
            if self._accept_pool is None:
                self._accept_pool = concurrent.futures.ThreadPoolExecutor(fill_threads() - 1,
                                                                          thread_name_prefix="grammar-accept")
            bounds = [len(matchers) * i // threads for i in range(threads + 1)]
            futures = [self._accept_pool.submit(batch_accept, matchers[a:b], tokens[a:b])
                       for a, b in zip(bounds[1:-1], bounds[2:])]
            results = batch_accept(matchers[:bounds[1]], tokens[:bounds[1]])
            for f in futures:
                results += f.result()
        for g, ok in zip(grammars, results):
            if ok:
                g.num_accepted += 1

    def step_job(self, grammars: list[RequestGrammar], tokens: list[int], then=None) -> concurrent.futures.Future:
        """accept(grammars, tokens), then `then()` (the next step's mask fill), on the grammar thread: the engine
        thread meanwhile does the rest of the step's tokens (detokenization, stops, outputs)."""
        if self._step_pool is None:
            self._step_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-step")

        @torch.inference_mode()  # (as the engine thread's step: the mask buffers are inference tensors)
        def run():
            # A failed accept still fills the next mask: the engine ends these requests (their rows' tokens are
            # dropped), and the other rows of the next step must not lose their step for it.
            failed = None
            if grammars:
                try:
                    self.accept(grammars, tokens)
                except Exception as e:  # noqa: BLE001 - raised again below, for the engine
                    failed = e
            if then is not None:
                then()
            if failed is not None:
                raise failed

        return self._step_pool.submit(run)

    def close(self) -> None:
        for pool in (self._executor, self._step_pool, self._accept_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)


# ---- the token bitmask ----------------------------------------------------------------------------------------
def fill_threads() -> int:
    """Threads xgrammar's batch fill uses: half the cores this process may run on (the engine's own threads keep
    the rest), at most 8. (xgrammar's "auto" takes half the host's cores, which a container may not have.)"""
    return max(1, min(8, len(os.sched_getaffinity(0)) // 2))


def fill_bitmask(grammars: list[RequestGrammar], vocab_size: int, out=None, batch_matcher=None):
    """[len(grammars), ceil(vocab_size / 32)] int32 on the CPU: bit t of row i is set when grammars[i] may take
    token t next. out: fill this CPU array of that shape instead (a torch tensor, or a numpy view of one: a pinned
    tensor must go as its numpy view, which DLPack describes as CPU memory, not as CUDA host memory).
    batch_matcher: an xgrammar BatchGrammarMatcher (fills the rows on its threads), else one row at a time."""
    xgr = _xgr()
    if out is None:
        out = xgr.allocate_token_bitmask(len(grammars), vocab_size)
    if batch_matcher is not None and len(grammars) > 1:
        batch_matcher.batch_fill_next_token_bitmask([g.matcher for g in grammars], out)
    else:
        for i, g in enumerate(grammars):
            g.matcher.fill_next_token_bitmask(out, i)
    return out


class TokenMasks:
    """One sampler's token masks. Each step the constrained rows' bitmasks are filled on the CPU, packed (row i
    masks the i-th constrained row), into a buffer kept between steps; on CUDA it is pinned, and the bitmask and the
    row indices reach the device in one copy each, queued without waiting on a stream of their own (beside the
    step's forward pass); kernels.apply_token_bitmask masks those rows in place (a Triton kernel on CUDA, the
    plain-torch reference elsewhere). A batch's unconstrained rows cost nothing."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._host: tuple[torch.Tensor, torch.Tensor] | None = None  # ([cap, words] int32, [cap] int64)
        self._host_view = None  # the host bitmask's numpy view (what xgrammar fills)
        self._device: tuple[torch.Tensor, torch.Tensor] | None = None
        self._copied = None  # CUDA event: the last copy out of the host buffers is done
        self._applied = None  # CUDA event: the last kernel that read the device buffers is done
        self._copy_stream = None  # the copies' CUDA stream
        self._device_fresh = False  # the device buffers are new: no copy has gone into them yet
        self._filled = 0  # rows of the host buffers the last fill() wrote, for launch()
        self._batch_matcher = None

    def apply(self, logits: torch.Tensor, grammars: list[RequestGrammar], rows: list[int]) -> None:
        """In place: logits [batch, vocab_size] float get -inf at the tokens grammars[i] forbids, in row rows[i]."""
        self.fill(grammars, rows, pin=logits.device.type == "cuda")
        self.launch(logits)

    def fill(self, grammars: list[RequestGrammar], rows: list[int], pin: bool) -> None:
        """The host half of apply: the bitmasks of grammars (for rows) into the host buffers (pinned: pin). Any
        thread may run it, while no other uses these matchers; launch() then masks the logits with them."""
        k = len(rows)
        if self._copied is not None:
            self._copied.synchronize()  # (done already: the engine read the last constrained step's tokens)
        host_mask, host_rows = self._buffers("_host", k, torch.device("cpu"), pin=pin)
        if self._batch_matcher is None and k > 1:
            self._batch_matcher = _xgr().BatchGrammarMatcher(fill_threads())
        fill_bitmask(grammars, self.vocab_size, out=self._host_view[:k], batch_matcher=self._batch_matcher)
        host_rows[:k] = torch.tensor(rows, dtype=torch.int64)
        self._filled = k

    def launch(self, logits: torch.Tensor) -> None:
        """The device half of apply: masks the rows of the last fill() in place (on the engine thread)."""
        from kernels import apply_token_bitmask

        k, self._filled = self._filled, 0
        assert k > 0, "launch() without a fill()"
        host_mask, host_rows = self._host
        if logits.device.type != "cuda":
            apply_token_bitmask(logits, host_mask[:k], host_rows[:k])
            return
        mask, idx = self._buffers("_device", k, logits.device)
        # The copies go on a stream of their own, so that they run beside the forward pass queued before them
        # (on the compute stream they would wait for it, then hold the kernel back). They wait for the last
        # kernel that read the device buffers; the kernel waits for them.
        compute = torch.cuda.current_stream(logits.device)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(logits.device)
        if self._device_fresh:
            # New device buffers came from the compute stream's pool: memory that work queued there (the forward
            # pass) may still use. The first copy into them waits for that work.
            self._copy_stream.wait_stream(compute)
            self._device_fresh = False
        with torch.cuda.stream(self._copy_stream):
            if self._applied is not None:
                self._copy_stream.wait_event(self._applied)
            mask[:k].copy_(host_mask[:k], non_blocking=True)
            idx[:k].copy_(host_rows[:k], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(self._copy_stream)
        compute.wait_event(self._copied)
        apply_token_bitmask(logits, mask[:k], idx[:k])
        self._applied = torch.cuda.Event()
        self._applied.record(compute)

    def _buffers(self, name: str, k: int, device: torch.device, pin: bool = False):
        held = getattr(self, name)
        if held is None or held[0].shape[0] < k or held[0].device != device:
            cap = max(k, 2 * held[0].shape[0] if held is not None else 8)
            held = (torch.empty(cap, self.words, dtype=torch.int32, device=device, pin_memory=pin),
                    torch.empty(cap, dtype=torch.int64, device=device, pin_memory=pin))
            setattr(self, name, held)
            if name == "_host":
                self._host_view = held[0].numpy()
            else:
                self._device_fresh = True
        return held
