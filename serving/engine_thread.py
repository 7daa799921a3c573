"""The one thread that owns an engine (shared by the prefill and decode services and the colocated router).

The engine is not thread-safe, so everything that touches it (adding, aborting, reserving, reading or writing KV
blocks, stepping) runs in this thread. The asyncio side sends commands through a queue (`call` awaits the result,
`submit` does not); between commands the thread steps the engine whenever it has work, hands the step's outputs to
the event loop (`loop.call_soon_threadsafe(on_step, outputs, None)`), then runs the service's `after_step` hook (in
this thread, e.g. to read freshly filled KV blocks) and hands over what it returns (`on_step([], extra)`).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("tandem.engine_thread")

_STOP = object()


class EngineThread:
    def __init__(self, engine, loop: asyncio.AbstractEventLoop, on_step: Callable[[list, Any], None],
                 after_step: Callable[[Any, list], Any] | None = None, name: str = "engine"):
        self.engine = engine
        self.loop = loop
        self.on_step = on_step
        self.after_step = after_step
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.num_steps = 0
        self.step_start_ns = 0  # CLOCK_MONOTONIC of the last step's start and end (for hop traces)
        self.step_end_ns = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._q.put(_STOP)
        self._thread.join(timeout)

    def queue(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Queues fn(engine, *args) for the engine thread now, in order with the commands queued after it; the
        future (not awaited here) gets its result or exception. Callers that go on while it runs (the decode
        service's pipelined block writes) keep the future; `call` awaits it."""
        fut = self.loop.create_future()
        self._q.put((fn, args, fut))
        return fut

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs fn(engine, *args) in the engine thread; returns its result or raises its exception."""
        return await self.queue(fn, *args)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Runs fn(engine, *args) in the engine thread without waiting (errors are logged)."""
        self._q.put((fn, args, None))

    def _resolve(self, fut: asyncio.Future, ok: bool, value: Any) -> None:
        if fut.cancelled():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def _execute(self, item) -> bool:
        if item is _STOP:
            return False
        fn, args, fut = item
        try:
            result, ok = fn(self.engine, *args), True
        except Exception as exc:  # noqa: BLE001 - a failed command ends its caller's request, not the thread
            result, ok = exc, False
            if fut is None:
                log.exception("engine command %s failed", getattr(fn, "__name__", fn))
        if fut is not None:
            self.loop.call_soon_threadsafe(self._resolve, fut, ok, result)
        return True

    def _run(self) -> None:
        from engine.llm_engine import gc_frozen  # (not at import: the router imports hop() without torch)
        from engine.model_runner import use_device

        use_device(self.engine.runner.device)  # this thread steps the engine: its kernels go to the engine's GPU

        # The start-up heap (model, tokenizer, libraries) stays out of full collections while the engine serves:
        # walking it stalled steps at large batches (measured: bench/RESULTS.md).
        with gc_frozen(collect=True):
            self._serve()

    def _serve(self) -> None:
        engine = self.engine
        idle = False  # the last step scheduled nothing (e.g. waiting requests that do not fit yet)
        while True:
            # Block for a command when there is nothing to step; after an empty step wait a little for one, so that
            # a stalled scheduler does not spin a core.
            try:
                if not engine.has_unfinished_requests():
                    item = self._q.get()
                elif idle:
                    item = self._q.get(timeout=0.002)
                else:
                    item = self._q.get_nowait()
            except queue.Empty:
                item = None
            while item is not None:
                if not self._execute(item):
                    return
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    item = None
            if not engine.has_unfinished_requests():
                continue
            self.step_start_ns = time.monotonic_ns()
            try:
                outs = engine.step()
            except Exception:  # noqa: BLE001 - the engine aborts a failing batch itself; this is a last resort
                log.exception("engine step failed")
                continue
            self.num_steps += 1
            self.step_end_ns = time.monotonic_ns()
            stats = getattr(engine, "last_stats", None)
            idle = not outs and (stats is None or stats.num_batched_tokens == 0)
            # Tokens first: the after_step hook's work (reading KV blocks) must not delay them.
            if outs:
                self.loop.call_soon_threadsafe(self.on_step, outs, None)
            if self.after_step is not None:
                try:
                    extra = self.after_step(engine, outs)
                except Exception:  # noqa: BLE001
                    log.exception("after_step hook failed")
                    continue
                if extra:
                    self.loop.call_soon_threadsafe(self.on_step, [], extra)
