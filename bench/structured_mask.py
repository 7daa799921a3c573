"""Structured outputs' cost in a decode step: a batch of requests each held to a JSON schema against the same batch
unconstrained (random:qwen2.5-7b, bf16, batch 256 on the H200; target: the constrained step at most 10% slower).

On the H200 (the box has no xgrammar: the carried wheels go in first, unpacked as zips; the device call carries
[".carry"]), with SmolLM2's tokenizer files (tokenizer.json + tokenizer_config.json, copied from its converted
model dir into .carry/smollm2-tokenizer) as the vocabulary, sized to stop within 4 minutes:
  python3 -c "import glob, zipfile as z; [z.ZipFile(w).extractall('/tmp/site') for w in glob.glob('.carry/whl/*')]" \
    && PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 timeout 230 python3 bench/structured_mask.py \
    --model random:qwen2.5-7b --tokenizer .carry/smollm2-tokenizer --dtype bfloat16 --batch-size 256 \
    --output-len 32 --max-step-ms 1000 --json $OUT/structured_mask.json
Without --tokenizer a random: model has the synthetic tokenizer (engine/tokenizer.py), whose ~152k filler tokens
"<fN>" are no BPE vocabulary: every one is valid string content, which no real model's mask looks like.
.carry/whl (git ignores it): xgrammar 0.2.9 for CPython 3.12 and what it needs that the box lacks, made with
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .carry/whl xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
CPU smoke test (a small model; the numbers mean nothing, and a CPU step takes seconds: no --max-step-ms):
  python bench/structured_mask.py --model random:smollm2-135m --tokenizer .carry/smollm2-tokenizer --device cpu \
    --batch-size 8 --input-len 16 --output-len 8 --num-iters 1 --num-schemas 2 --max-step-ms 0

Per mode ("none": unconstrained; "json": request i follows schema i % --num-schemas, a long array of objects, so no
output can end inside the timed steps) it adds --batch-size requests of --input-len random prompt tokens (unseeded
sampling at temperature 1), steps the engine until every request decodes, runs warm-up steps, then times
--output-len `LLMEngine.step()` calls, --num-iters times: "step ms" is the median of the iterations' mean step time.
Each pass prints its progress; a step past --max-step-ms (a prefill step after the first decode, a warm-up step, or
an iteration's mean) stops the run with exit status 2, after the warm-up pass's per-step host breakdown.
The grammars compile before the timing (reported apart). "mask share" is (json - none) / json: everything the
constraint adds to a step (the bitmask fill on the CPU, its copy and the Triton kernel, the matchers taking the
tokens, and whatever of that the device's work does not hide). A second, instrumented json pass breaks it down
per timed decode step: "fill ms" (xgrammar's fill, host), "apply ms" (copy + kernel, device time between CUDA events;
host time on the CPU), "accept ms" (the matchers taking the step's tokens, host), "waiting for the device" (host
time blocked reading a step's tokens: the device work the host did not hide).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import format_table, git_commit, machine_info, write_json  # noqa: E402


def schema(k: int, min_items: int) -> dict:
    """Schema k: an object holding an array of at least min_items records (field names differ per k)."""
    record = {"type": "object", "properties": {
        f"name{k}": {"type": "string", "maxLength": 24},
        "qty": {"type": "integer", "minimum": 0, "maximum": 1000},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
        "required": [f"name{k}", "qty", "ok", "tags"], "additionalProperties": False}
    return {"type": "object", "properties": {"items": {"type": "array", "items": record, "minItems": min_items}},
            "required": ["items"], "additionalProperties": False}


class Timer:
    """Accumulates host seconds, and on CUDA device seconds between event pairs (read once at the end)."""

    def __init__(self) -> None:
        self.host = 0.0
        self.calls = 0
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def device(self) -> float:
        torch.cuda.synchronize()
        return sum(a.elapsed_time(b) for a, b in self.events) / 1e3


def instrument(cuda: bool) -> tuple[dict[str, Timer], callable]:
    """Wraps the mask's pieces with timers, and the engine's wait for a step's tokens ("wait": host seconds blocked
    on the device); returns them and an undo."""
    import kernels
    from engine import structured_output as so
    from engine.model_runner import StepHandle

    timers = {name: Timer() for name in ("fill", "apply", "accept", "wait")}
    orig_fill, orig_apply, orig_advance = so.fill_bitmask, kernels.apply_token_bitmask, so.RequestGrammar.advance
    orig_accept, orig_result = so.GrammarManager.accept, StepHandle.result
    pending: list = []  # the event recorded after the fill, waiting for its apply

    def fill(*a, **kw):
        t0 = time.perf_counter()
        out = orig_fill(*a, **kw)
        timers["fill"].host += time.perf_counter() - t0
        timers["fill"].calls += 1
        if cuda:
            pending.append(torch.cuda.Event(enable_timing=True))
            pending[-1].record()
        return out

    def apply(*a, **kw):
        t0 = time.perf_counter()
        orig_apply(*a, **kw)
        timers["apply"].host += time.perf_counter() - t0
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            timers["apply"].events.append((pending.pop(), end))

    def advance(self, ids):
        t0 = time.perf_counter()
        out = orig_advance(self, ids)
        timers["accept"].host += time.perf_counter() - t0
        return out

    def accept(self, grammars, tokens):
        t0 = time.perf_counter()
        orig_accept(self, grammars, tokens)
        timers["accept"].host += time.perf_counter() - t0

    def result(self):
        t0 = time.perf_counter()
        out = orig_result(self)
        timers["wait"].host += time.perf_counter() - t0
        return out

    so.fill_bitmask, kernels.apply_token_bitmask, so.RequestGrammar.advance = fill, apply, advance
    so.GrammarManager.accept, StepHandle.result = accept, result

    def undo():
        so.fill_bitmask, kernels.apply_token_bitmask, so.RequestGrammar.advance = orig_fill, orig_apply, orig_advance
        so.GrammarManager.accept, StepHandle.result = orig_accept, orig_result

    return timers, undo


def host_breakdown(timers: dict[str, Timer]) -> str:
    """The mask's host seconds so far, per constrained step (one fill each; prefill steps included)."""
    n = max(1, timers["fill"].calls)
    return (f"{timers['fill'].calls} constrained steps, per step: fill {timers['fill'].host / n * 1e3:.2f} ms, "
            f"apply {timers['apply'].host / n * 1e3:.2f} ms, accept {timers['accept'].host / n * 1e3:.2f} ms (host), "
            f"waiting for the device {timers['wait'].host / n * 1e3:.2f} ms")


def prefill_slack(args) -> int:
    """Tokens a request may decode before the timing: the first prompts decode in the mixed steps that prefill the
    rest (one per step, at most a step per 2048 prompt tokens, the engine's smallest default budget), and async
    scheduling runs a step ahead."""
    return args.batch_size * args.input_len // 2048 + 64


class TooSlow(Exception):
    """A step ran past --max-step-ms: the run stops rather than spend minutes on numbers that say it already."""


def check_step(args, mode: str, where: str, seconds: float) -> None:
    if args.max_step_ms and seconds * 1e3 > args.max_step_ms:
        raise TooSlow(f"{mode} {where}: {seconds * 1e3:.1f} ms per step > --max-step-ms {args.max_step_ms:g}")


def run_mode(engine, args, constrained: bool, iters: int, on_timed=None) -> dict:
    """Fills the engine with the batch, times the decode steps; returns the mean step seconds per iteration and
    the grammars' compile time. on_timed: called once the timed steps start (after the prefill and warm-up)."""
    from engine import SamplingParams
    from engine.sampling_params import StructuredOutputsParams

    vocab = min(engine.runner.hf_config.vocab_size, len(engine.tokenizer))  # prompts of the tokenizer's own ids
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else (lambda: None)
    steps = args.warmup_steps + iters * args.output_len
    gen = torch.Generator().manual_seed(0)
    rids = [f"{'json' if constrained else 'none'}-{i}" for i in range(args.batch_size)]
    t_add = time.perf_counter()
    for i, rid in enumerate(rids):
        so = None
        if constrained:
            so = StructuredOutputsParams(json=schema(i % args.num_schemas, args.min_items),
                                         disable_any_whitespace=True)
        # Unseeded: a seeded row draws its noise on the CPU (engine/sampler.py), a vocabulary of floats per row and
        # step, which at 256 x 152k would swamp both modes' steps.
        params = SamplingParams(temperature=1.0, max_tokens=steps + prefill_slack(args), ignore_eos=True,
                                structured_outputs=so)
        prompt = torch.randint(10, vocab - 10, (args.input_len,), generator=gen).tolist()
        engine.add_request(rid, prompt, params)
    started: set[str] = set()
    compile_s = None
    mode = "json" if constrained else "none"
    while len(started) < len(rids):  # prefill (after the compiles) until every request has decoded once
        t0 = time.perf_counter()
        for out in engine.step():
            assert not out.finished, f"{out.request_id} finished ({out.finish_reason}) before the timing"
            if out.new_token_ids:
                started.add(out.request_id)
                if compile_s is None:
                    compile_s = time.perf_counter() - t_add
        if started:  # (the steps before the first decode wait for the compiles)
            check_step(args, mode, "prefill", time.perf_counter() - t0)
    print(f"    {mode}: every request decoding after {time.perf_counter() - t_add:.1f} s", flush=True)
    for _ in range(args.warmup_steps):
        t0 = time.perf_counter()
        engine.step()
        check_step(args, mode, "warm-up", time.perf_counter() - t0)
    per_step = []
    if on_timed is not None:
        on_timed()
    for it in range(iters):
        sync()
        t0 = time.perf_counter()
        for _ in range(args.output_len):
            for out in engine.step():
                assert not out.finished, f"{out.request_id} finished ({out.finish_reason}) inside the timing"
        sync()
        per_step.append((time.perf_counter() - t0) / args.output_len)
        print(f"    {mode}: iteration {it + 1}/{iters}, {1e3 * per_step[-1]:.2f} ms per step", flush=True)
        check_step(args, mode, f"iteration {it + 1}", per_step[-1])
    for rid in rids:
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return {"step_s": per_step, "to_first_decode_s": compile_s}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:qwen2.5-7b")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default=None, help="cuda or cpu (default: the engine's)")
    p.add_argument("--batch-size", type=int, default=256, help="requests decoding together")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64, help="decode steps timed per iteration")
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--warmup-steps", type=int, default=8)
    p.add_argument("--num-schemas", type=int, default=4, help="distinct schemas across the batch")
    p.add_argument("--min-items", type=int, default=64, help="records each output must hold (it cannot end early)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory (tokenizer.json + tokenizer_config.json) instead of the model's; a "
                        "random: model otherwise has the synthetic tokenizer, whose filler tokens are no BPE "
                        "vocabulary (its vocabulary must fit the model's vocab_size)")
    p.add_argument("--max-step-ms", type=float, default=1000.0,
                   help="stop (exit 2) when a prefill step after the first decode, a warm-up step or an iteration's "
                        "mean step takes longer (0: never)")
    p.add_argument("--kv-cache-memory", type=float, default=None, help="GiB of KV cache (default: the engine's)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from engine import EngineArgs, LLMEngine

    kw = dict(model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, max_num_seqs=args.batch_size,
              enable_prefix_caching=False, enforce_eager=args.enforce_eager,
              max_model_len=args.input_len + args.warmup_steps + args.num_iters * args.output_len + prefill_slack(args))
    if args.device is not None:
        kw["device"] = args.device
    if args.kv_cache_memory is not None:
        kw["kv_cache_memory"] = args.kv_cache_memory
    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs(**kw))
    cuda = engine.runner.device.type == "cuda"

    def timed_pass(name: str, constrained: bool, iters: int, on_timed=None) -> dict:
        t = time.perf_counter()
        out = run_mode(engine, args, constrained, iters, on_timed)
        print(f"  pass {name}: {time.perf_counter() - t:.1f} s, step ms {[round(1e3 * x, 2) for x in out['step_s']]}",
              flush=True)
        return out

    tok_name = args.tokenizer or "the model's"
    print(f"structured_mask: engine built in {time.perf_counter() - t0:.1f} s; tokenizer {tok_name} "
          f"({len(engine.tokenizer)} tokens, logits {engine.runner.hf_config.vocab_size} wide)", flush=True)
    try:
        # The warm-up pass compiles the schemas and builds the mask buffers; it runs instrumented, so that a run the
        # --max-step-ms guard stops still says where the constrained steps' host time went.
        warm_timers, undo = instrument(False)
        try:
            warm = timed_pass("warm-up (json)", True, 1)
        finally:
            undo()
            print(f"  warm-up (json): {host_breakdown(warm_timers)}", flush=True)
        none = timed_pass("none", False, args.num_iters)
        json_ = timed_pass("json", True, args.num_iters)
        timers, undo = instrument(cuda)

        def reset():  # the breakdown is of the timed decode steps only
            for t in timers.values():
                t.host, t.calls, t.events = 0.0, 0, []

        try:
            timed_pass("instrumented (json)", True, 1, reset)
        finally:
            undo()
    except TooSlow as e:
        print(f"structured_mask: stopped: {e}", flush=True)
        return 2
    finally:
        engine.close()
    steps = args.output_len  # the instrumented pass's timed steps
    t_none, t_json = statistics.median(none["step_s"]), statistics.median(json_["step_s"])
    share = (t_json - t_none) / t_json
    fill_ms = timers["fill"].host / steps * 1e3
    apply_ms = (timers["apply"].device() if cuda else timers["apply"].host) / steps * 1e3
    accept_ms = timers["accept"].host / steps * 1e3
    wait_ms = timers["wait"].host / steps * 1e3
    print(f"model {args.model} tokenizer {tok_name} device {engine.runner.device} dtype {engine.runner.dtype} "
          f"batch {args.batch_size} schemas {args.num_schemas}")
    print(format_table(["mode", "step ms", "tok/s"], [
        ["none", t_none * 1e3, args.batch_size / t_none], ["json", t_json * 1e3, args.batch_size / t_json]]))
    print(f"mask share {share:.1%} (target <= 10%); per step: fill {fill_ms:.2f} ms (host), apply {apply_ms:.3f} ms "
          f"({'device' if cuda else 'host'}), accept {accept_ms:.2f} ms (host), waiting for the device "
          f"{wait_ms:.2f} ms; the first pass decoded {warm['to_first_decode_s']:.1f} s after its requests came (the "
          "schemas' compiles)")
    if args.json:
        write_json(args.json, dict(
            model=args.model, tokenizer=args.tokenizer, batch_size=args.batch_size, input_len=args.input_len,
            output_len=args.output_len, num_schemas=args.num_schemas, min_items=args.min_items,
            step_ms_none=t_none * 1e3, step_ms_json=t_json * 1e3, mask_share=share, fill_ms_per_step=fill_ms,
            apply_ms_per_step=apply_ms, accept_ms_per_step=accept_ms, wait_ms_per_step=wait_ms,
            step_s_none=none["step_s"], step_s_json=json_["step_s"],
            compile_to_first_decode_s=warm["to_first_decode_s"],
            machine=machine_info(), commit=git_commit()["sha"], date=time.strftime("%Y-%m-%d")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
