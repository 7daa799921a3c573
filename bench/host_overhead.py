"""The engine's host work per step at large batches, on the CPU, with the model's forward stubbed out.

  python bench/host_overhead.py --batch 64 256 512 --steps 40 --runs 2

What runs is a real `LLMEngine` (scheduler, KV cache manager and block pool, the runner's input packing, sampler,
token read-back, detokenization, stop checks, `StepOutput`s) driven by `LLMEngine.step()` as `LLM.generate` and the
services drive it. Only the model is replaced, in this process and after the engine is built: `runner.model` becomes
`StubModel`, whose forward returns the positions as its "hidden states" and whose `compute_logits` returns one-hot
logits rows of the right shape, [num_sampled, vocab] float32, that make greedy sampling emit a fixed English text's
tokens in a cycle (so detokenization and stop checks see real text). It costs one small index_select. Nothing of it is
in engine/. On the GPU the forward and the sampler's kernels run on the device; here the sampler's few torch ops run
on the CPU over a small vocabulary (random:tiny, 512), which is close to what launching them costs the host.

Per batch size and text mode ("offline": `LLM`'s stream_text=False, text decoded once at the end; "stream": the
services' stream_text=True, text deltas every step) it fills the engine with --batch requests of --input-len random
prompt tokens, runs until all of them decode, then times --steps pure decode steps, --runs times:
- "step ms": median wall time of one `step()` with nothing instrumented (the number to compare across commits);
- the breakdown: the same steps again with every section below wrapped in perf_counter timers, each section's own
  time (its children's excluded), in ms per step. Wrapping costs about a microsecond per call, so the instrumented
  total exceeds the plain one by roughly (calls per step) us; "timed total" shows it.
- one mixed step per run: --batch decodes plus one new --input-len prompt in the same step.
- Python's garbage collector: collections per generation and their time over all the timed steps of the runs
  (plain, instrumented and mixed: runs * (2 * steps + 1) steps), through gc.callbacks;
  --gc-freeze calls gc.freeze() once the engine is built (what the services could do).
--cprofile FILE writes a cProfile of the plain timed steps of the largest batch (stream mode) for a closer look.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import format_table, git_commit, machine_info, write_json  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog. A decode step appends one token to every running request, "
        "and the host turns it into text, checks whether the request should stop, and reports what changed. ")


class StubModel:
    """Stands in for the model in this benchmark: forward returns positions [num_tokens] as the hidden states, and
    compute_logits(hidden [n]) returns one-hot float32 logits [n, vocab] picking cycle[position % len(cycle)]."""

    def __init__(self, cycle: list[int], vocab: int):
        self.table = torch.zeros(len(cycle), vocab)  # [len(cycle), vocab]
        self.table[torch.arange(len(cycle)), torch.tensor(cycle)] = 1.0

    def __call__(self, input_ids, positions, kv_layers, meta):
        return self.forward(input_ids, positions, kv_layers, meta)

    def forward(self, input_ids, positions, kv_layers, meta):
        return positions  # [num_tokens]

    def compute_logits(self, hidden):
        return self.table.index_select(0, hidden % self.table.shape[0])  # [n, vocab]


class Sections:
    """Exclusive perf_counter time per named section (a section's children are subtracted from it)."""

    def __init__(self):
        self.total = defaultdict(float)
        self.calls = defaultdict(int)
        self.stack: list[list[float]] = []  # [start, children's time]
        self.on = False

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            frame = [time.perf_counter(), 0.0]
            self.stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - frame[0]
                self.stack.pop()
                self.total[name] += elapsed - frame[1]
                self.calls[name] += 1
                if self.stack:
                    self.stack[-1][1] += elapsed

        setattr(owner, attr, timed)

    def reset(self) -> None:
        self.total.clear()
        self.calls.clear()


class GcTimer:
    """Collections per generation and their wall time, through gc.callbacks."""

    def __init__(self):
        self.count = defaultdict(int)
        self.seconds = defaultdict(float)
        self.longest = 0.0
        self._t0 = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            dt = time.perf_counter() - self._t0
            g = info["generation"]
            self.count[g] += 1
            self.seconds[g] += dt
            self.longest = max(self.longest, dt)

    def reset(self) -> None:
        self.count.clear()
        self.seconds.clear()
        self.longest = 0.0


# (owner path, attribute, section name), in the order of the table
SECTIONS = (
    ("engine", "step", "step: glue (block-table lists, stats)"),
    ("scheduler", "schedule", "schedule"),
    ("kv", "allocate_slots", "kv: allocate_slots"),
    ("runner", "execute", "execute: glue (StepHandle)"),
    ("runner", "step_inputs", "step_inputs (host buffers)"),
    ("runner", "_pack", "step_inputs: _pack"),
    ("runner", "device_inputs", "device_inputs (copies)"),
    ("model", "forward", "stub forward + logits"),
    ("sampler", "sample", "sampler.sample"),
    ("engine", "_read_step", "read_step: glue"),
    ("handle", "result", "read tokens (tolist)"),
    ("scheduler", "update_from_output", "update_from_output"),
    ("kv", "cache_blocks", "kv: cache_blocks"),
    ("engine", "_append_token", "append_token"),
    ("engine", "_detokenize", "detokenize"),
    ("engine", "_check_stop", "check_stop"),
    ("engine", "_output", "StepOutput"),
    ("scheduler", "finish", "finish"),
)


def build_engine(args, batch: int):
    from engine import LLMEngine, EngineArgs

    # Enough for every timed step, plus what the first requests decode while the last ones are still in prefill.
    max_tokens = (args.warmup + args.runs * (2 * args.steps + 2) + 16
                  + batch * args.input_len // args.max_num_batched_tokens)
    eng = LLMEngine.from_engine_args(EngineArgs(
        model=args.model, max_model_len=args.input_len + max_tokens + 16, block_size=args.block_size,
        max_num_seqs=batch + args.runs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching, async_scheduling=args.async_scheduling,
        device="cpu", kv_cache_memory=args.kv_cache_memory))
    cycle = eng.tokenizer(TEXT, add_special_tokens=False).input_ids
    eng.runner.model = StubModel(cycle, eng.runner.hf_config.vocab_size)
    return eng, max_tokens


def run_one(args, batch: int, stream: bool, profiler: cProfile.Profile | None) -> dict:
    from engine import SamplingParams

    eng, max_tokens = build_engine(args, batch)
    eng.stream_text = stream
    vocab = eng.runner.hf_config.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(torch.randint(0, min(vocab, 256), (batch, args.input_len), generator=g).tolist()):
        eng.add_request(f"r{i}", p, params)
    while not (len(eng.scheduler.running) == batch and all(r.num_output_tokens >= 1 for r in eng.scheduler.running)):
        eng.step()
    for _ in range(args.warmup):
        eng.step()
    if args.gc_freeze:
        gc.collect()
        gc.freeze()

    secs = Sections()
    owners = {"engine": eng, "scheduler": eng.scheduler, "kv": eng.kv, "runner": eng.runner,
              "model": eng.runner.model, "sampler": eng.runner.sampler}
    from engine.model_runner import StepHandle
    for owner, attr, name in SECTIONS:
        if owner == "handle":
            secs.wrap(StepHandle, attr, name)
        elif owner == "model":
            secs.wrap(eng.runner.model, "forward", name)
            secs.wrap(eng.runner.model, "compute_logits", name)
        else:
            secs.wrap(owners[owner], attr, name)
    gct = GcTimer()

    plain, timed, mixed, per_section = [], [], [], defaultdict(list)
    n_out = 0
    try:
        for run in range(args.runs):
            if profiler is not None and run == 0:
                profiler.enable()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                outs = eng.step()
                plain.append(time.perf_counter() - t0)
                n_out += len(outs)
            if profiler is not None and run == 0:
                profiler.disable()
            secs.reset()
            secs.on = True
            for _ in range(args.steps):
                t0 = time.perf_counter()
                eng.step()
                timed.append(time.perf_counter() - t0)
            secs.on = False
            for name, s in secs.total.items():
                per_section[name].append(s / args.steps * 1e3)
            # One step that carries --batch decodes and a new prompt (chunked to the token budget).
            p = torch.randint(0, min(vocab, 256), (args.input_len,), generator=g).tolist()
            eng.add_request(f"mixed{run}", p, params)
            t0 = time.perf_counter()
            eng.step()
            mixed.append(time.perf_counter() - t0)
    finally:
        gc.callbacks.remove(gct._cb)
        if args.gc_freeze:
            gc.unfreeze()
    assert n_out >= batch * args.steps * args.runs - batch, n_out  # every timed plain step emitted tokens
    ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    return dict(batch=batch, mode="stream" if stream else "offline", step_ms=ms(plain),
                step_ms_runs=[ms(plain[i * args.steps:(i + 1) * args.steps]) for i in range(args.runs)],
                step_ms_p90=sorted(plain)[int(0.9 * len(plain))] * 1e3, timed_ms=ms(timed), mixed_ms=ms(mixed),
                sections_ms={k: statistics.median(v) for k, v in per_section.items()},
                gc_collections={str(k): v for k, v in sorted(gct.count.items())},
                gc_ms={str(k): v * 1e3 for k, v in sorted(gct.seconds.items())}, gc_longest_ms=gct.longest * 1e3,
                tracked_objects=len(gc.get_objects()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:tiny", help="its tokenizer and vocabulary are used; its forward is not")
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256, 512])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=40, help="timed decode steps per run (plain, then instrumented)")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--modes", nargs="+", default=["offline", "stream"], choices=["offline", "stream"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--kv-cache-memory", type=float, default=0.5, help="GiB")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="as on the GPU: the next step is launched before the last one's tokens are read")
    p.add_argument("--gc-freeze", action="store_true")
    p.add_argument("--cprofile", default=None, help="write a cProfile of the largest batch's stream run here")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    results = []
    for batch in args.batch:
        for mode in args.modes:
            prof = None
            if args.cprofile and batch == max(args.batch) and mode == args.modes[-1]:
                prof = cProfile.Profile()
            r = run_one(args, batch, mode == "stream", prof)
            if prof is not None:
                prof.dump_stats(args.cprofile)
            results.append(r)
            print(f"batch {batch:4d} {r['mode']:8s} step {r['step_ms']:.3f} ms (runs "
                  f"{', '.join(f'{x:.3f}' for x in r['step_ms_runs'])}), mixed {r['mixed_ms']:.3f} ms, "
                  f"gc {r['gc_collections']} {({k: round(v, 2) for k, v in r['gc_ms'].items()})} ms",
                  flush=True)

    names = [s[2] for s in SECTIONS]
    headers = ["ms per step"] + [f"{r['batch']} {r['mode']}" for r in results]
    rows = [["step (plain, median)"] + [r["step_ms"] for r in results],
            ["step p90"] + [r["step_ms_p90"] for r in results],
            ["mixed step (+1 prompt)"] + [r["mixed_ms"] for r in results],
            ["timed total (instrumented)"] + [r["timed_ms"] for r in results]]
    for name in names:
        rows.append([name] + [r["sections_ms"].get(name, 0.0) for r in results])
    rows.append(["gc collections gen0/1/2"] + ["/".join(str(r["gc_collections"].get(str(g), 0)) for g in range(3))
                                               for r in results])
    rows.append(["gc ms gen2 (total)"] + [r["gc_ms"].get("2", 0.0) for r in results])
    rows.append(["gc longest pause ms"] + [r["gc_longest_ms"] for r in results])
    print()
    print(format_table(headers, [[f"{c:.3f}" if isinstance(c, float) else c for c in row] for row in rows]))
    info = machine_info()
    print(f"\n{info['cpu']}, {info['cpu_count']} cores, torch {info['torch']}, commit {git_commit()['sha'][:7]}"
          f"{' (dirty)' if git_commit()['dirty'] else ''}, load {info['load_average_1m']:.2f}")
    if args.json:
        write_json(args.json, {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
