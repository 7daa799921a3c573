"""A CPU decode step of a real engine, and the sampler alone, in milliseconds (issue 19 item 6).

  python bench/cpu_step.py --model smollm2 --batch 16 --input-len 128 --steps 40 --json out.json

Builds an `LLM` on the CPU (float32, --cpu-threads threads, 1 by default: what `tandem up` gives each engine on
two cores), fills it with --batch requests of --input-len random tokens sampled at --temperature (1.0: what
`vllm bench serve` sends when no --temperature is given), runs until every one decodes, then reports:
- "step": the median wall time of one pure decode `step()` over --steps steps, and its p10 / p90;
- "forward": the same steps' model forward + logits only (the runner's `forward`), so the host work is the rest;
- "sampler": `Sampler.sample(...).result()` alone on [batch, vocab] float32 logits, for plain sampling (the
  requests' params), greedy, and top-p 0.9 / top-k 50, medians over --sampler-iters calls;
- with --time-ops, the forward's pieces (kernels.* ops the model calls, the linears, the sampler) timed with
  perf_counter around each call over --steps more steps, ms per step (about a microsecond per call of wrapping);
- with --profile, torch.profiler's top-level CPU ops of --steps decode steps, ms per step (the profiler's own
  cost per op inflates composite ops such as F.rms_norm several times: --time-ops is the closer look).
To compare two commits on a noisy machine, run the two trees' copies of this script alternately (A/B/A/B) and
compare medians of medians; or, closer, --ab-baseline DIR: in this one engine, step by step, A runs the sampler of
DIR/engine/sampler.py and the float32 CPU norms of DIR/kernels/cpu_ops.py with rotary + KV write through
kernels.rotary's reference (what a tree before this branch's CPU rotary path ran), B this tree's; --steps steps
each, alternating, reporting each one's step median and the three pieces' ms per step. --ab-attention R: R rounds
of --steps decode steps with attention through the torch path (kernels/paged_attention_cpu.py's gathered copies
and SDPA) and --steps through the C kernel that reads the cache in place, A B B A ... so that a drift of the
machine's load or of the sequences' lengths falls on both, reporting each one's step median and attention ms per
step.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import git_commit, machine_info, write_json  # noqa: E402


def _quantiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    return dict(p50=statistics.median(xs), p10=xs[len(xs) // 10], p90=xs[(9 * len(xs)) // 10])


def time_sampler(sampler, vocab: int, batch: int, iters: int) -> dict:
    """Median ms of sampler.sample(...).result() for a few parameter mixes, on fixed random logits."""
    from engine.sampling_params import SamplingParams

    class State:
        def __init__(self, params, seed=None):
            self.sampling_params = params
            self.prompt_token_ids = list(range(128))
            self.output_token_ids = [1, 2, 3]
            self.seed = seed
            self.num_computed_tokens = 131

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=g) * 4
    mixes = {
        "temperature 1": [State(SamplingParams(temperature=1.0)) for _ in range(batch)],
        "temperature 0.7": [State(SamplingParams(temperature=0.7)) for _ in range(batch)],
        "greedy": [State(SamplingParams(temperature=0.0)) for _ in range(batch)],
        "seeded": [State(SamplingParams(temperature=1.0, seed=i)) for i in range(batch)],
        "top-p 0.9": [State(SamplingParams(temperature=1.0, top_p=0.9)) for _ in range(batch)],
        "top-k 50": [State(SamplingParams(temperature=1.0, top_k=50)) for _ in range(batch)],
    }
    out = {}
    for name, states in mixes.items():
        for st in states:
            if st.seed is None and st.sampling_params.seed is not None:
                st.seed = st.sampling_params.seed
        for _ in range(3):
            sampler.sample(logits, states).result()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            sampler.sample(logits, states).result()
            times.append((time.perf_counter() - t0) * 1e3)
        out[name] = statistics.median(times)
    return out


def time_ops(eng, steps: int) -> dict:
    """ms per step and calls per step of each wrapped piece over `steps` decode steps."""
    import engine.model as model_mod
    import kernels
    from engine import sampler as sampler_mod

    total: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)

    def wrap(owner, name: str, label: str):
        orig = getattr(owner, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                total[label] += time.perf_counter() - t0
                calls[label] += 1
        setattr(owner, name, timed)
        return owner, name, orig

    ops = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding_write_kv", "paged_attention")
    saved = [wrap(kernels, op, op) for op in ops]
    saved.append(wrap(model_mod.Linear, "forward", "Linear.forward"))
    saved.append(wrap(model_mod.nn.Embedding, "forward", "embedding"))
    saved.append(wrap(sampler_mod.Sampler, "sample", "Sampler.sample"))
    saved.append(wrap(type(eng.runner), "forward", "runner.forward (all of the above but the sampler)"))
    try:
        for _ in range(steps):
            eng.step()
    finally:
        for owner, name, orig in saved:
            setattr(owner, name, orig)
    return {k: (v * 1e3 / steps, calls[k] / steps) for k, v in sorted(total.items(), key=lambda kv: -kv[1])}


def _load(path: Path, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def ab_steps(eng, baseline: Path, steps: int) -> dict:
    """--ab-baseline: A (baseline tree's sampler and CPU ops) and B (this tree's) alternating step by step."""
    import kernels
    from kernels.rotary import rotary_embedding_write_kv_ref

    base_ops = _load(baseline / "kernels" / "cpu_ops.py", "baseline_cpu_ops")
    base_sampler = _load(baseline / "engine" / "sampler.py", "baseline_sampler")
    runner = eng.runner
    ours = dict(sampler=runner.sampler, rms_norm=kernels.rms_norm, fused_add_rms_norm=kernels.fused_add_rms_norm,
                rotary_embedding_write_kv=kernels.rotary_embedding_write_kv)
    theirs = dict(sampler=base_sampler.Sampler(runner.sampler.vocab_size, runner.sampler.eos_token_ids),
                  rms_norm=base_ops.rms_norm_cpu, fused_add_rms_norm=base_ops.fused_add_rms_norm_cpu,
                  rotary_embedding_write_kv=lambda *a, **kw: rotary_embedding_write_kv_ref(*a, **kw))
    pieces = ("norms", "rotary_embedding_write_kv", "sampler")
    out = {name: dict(step_ms=[], **{p: [] for p in pieces}) for name in "AB"}
    spent: dict[str, float] = defaultdict(float)

    def timed(fn, piece):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[piece] += time.perf_counter() - t0
        return wrapper

    def use(impl: dict) -> None:
        sampler = impl["sampler"]
        sampler.sample = timed(type(sampler).sample.__get__(sampler), "sampler")
        runner.sampler = sampler
        kernels.rms_norm = timed(impl["rms_norm"], "norms")
        kernels.fused_add_rms_norm = timed(impl["fused_add_rms_norm"], "norms")
        kernels.rotary_embedding_write_kv = timed(impl["rotary_embedding_write_kv"], "rotary_embedding_write_kv")

    try:
        for i in range(2 * steps):
            name = "AB"[i % 2]
            use(theirs if name == "A" else ours)
            spent.clear()
            t0 = time.perf_counter()
            eng.step()
            out[name]["step_ms"].append((time.perf_counter() - t0) * 1e3)
            for p in pieces:
                out[name][p].append(spent[p] * 1e3)
    finally:
        for k, fn in ours.items():
            if k == "sampler":
                del fn.sample  # the instance attribute; the class's method again
                runner.sampler = fn
            else:
                setattr(kernels, k, fn)
    return {name: {k: statistics.median(v) for k, v in r.items()} for name, r in out.items()}


def ab_attention(eng, steps: int, rounds: int) -> dict:
    """--ab-attention: A (the torch path) and B (the C kernel) in alternating runs of `steps` decode steps."""
    import kernels
    from kernels.cpu_native import load_library

    assert load_library("paged_decode_attention") is not None, "the C kernel did not build (see the log)"
    dispatch, native_ok = kernels.paged_attention, kernels.native_attention_cpu_ok
    spent = [0.0]

    def timed(*a, **kw):
        t0 = time.perf_counter()
        try:
            return dispatch(*a, **kw)
        finally:
            spent[0] += time.perf_counter() - t0

    out = {name: dict(step_ms=[], attention_ms=[]) for name in "AB"}
    kernels.paged_attention = timed
    try:
        for r in range(rounds):
            for name in ("AB" if r % 2 == 0 else "BA"):
                kernels.native_attention_cpu_ok = (lambda *a: False) if name == "A" else native_ok
                for _ in range(steps):
                    spent[0] = 0.0
                    t0 = time.perf_counter()
                    eng.step()
                    out[name]["step_ms"].append((time.perf_counter() - t0) * 1e3)
                    out[name]["attention_ms"].append(spent[0] * 1e3)
    finally:
        kernels.paged_attention, kernels.native_attention_cpu_ok = dispatch, native_ok
    return {name: {k: statistics.median(v) for k, v in r.items()} for name, r in out.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument("--sampler-iters", type=int, default=30)
    p.add_argument("--sampler-only", action="store_true", help="time the sampler alone (vocab --vocab), no engine")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--time-ops", action="store_true")
    p.add_argument("--ab-baseline", default=None, metavar="DIR", help="a baseline tree: A/B step by step")
    p.add_argument("--ab-attention", type=int, default=0, metavar="ROUNDS",
                   help="A/B the torch and C decode attention, ROUNDS x --steps steps each")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from engine import LLM, SamplingParams

    if args.sampler_only:
        from engine.sampler import Sampler

        torch.set_num_threads(args.cpu_threads)
        sampler = time_sampler(Sampler(args.vocab, None), args.vocab, args.batch, args.sampler_iters)
        for name, ms in sampler.items():
            print(f"sampler {name:16s} {ms:7.2f} ms")
        if args.json:
            write_json(args.json, dict(batch=args.batch, vocab=args.vocab, threads=args.cpu_threads,
                                       sampler_ms=sampler, machine=machine_info(), commit=git_commit()["sha"],
                                       date=time.strftime("%Y-%m-%d %H:%M")))
        return 0

    max_tokens = (6 + 2 * args.ab_attention) * args.steps + 32
    llm = LLM(args.model, dtype="float32", device="cpu", cpu_threads=args.cpu_threads,
              max_model_len=args.input_len + max_tokens + 16, max_num_seqs=args.batch, enable_prefix_caching=False)
    eng = llm.engine
    runner = eng.runner
    vocab = runner.hf_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, vocab - 10, (args.batch, args.input_len), generator=g).tolist()
    params = SamplingParams(temperature=args.temperature, max_tokens=max_tokens, ignore_eos=True)
    for i, pr in enumerate(prompts):
        eng.add_request(f"r{i}", pr, params)
    while not (len(eng.scheduler.running) == args.batch
               and all(r.num_output_tokens >= 2 for r in eng.scheduler.running)):
        eng.step()
    for _ in range(3):
        eng.step()

    forward_ms: list[float] = []
    orig_forward = type(runner).forward

    def timed_forward(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return orig_forward(self, *a, **kw)
        finally:
            forward_ms.append((time.perf_counter() - t0) * 1e3)

    step_ms = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        eng.step()
        step_ms.append((time.perf_counter() - t0) * 1e3)
    type(runner).forward = timed_forward
    for _ in range(args.steps):
        eng.step()
    type(runner).forward = orig_forward

    op_ms = time_ops(eng, args.steps) if args.time_ops else None
    ab = ab_steps(eng, Path(args.ab_baseline), args.steps) if args.ab_baseline else None
    ab_attn = ab_attention(eng, args.steps, args.ab_attention) if args.ab_attention else None
    profile = None
    if args.profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                eng.step()
        by_op: dict[str, float] = defaultdict(float)
        calls: dict[str, int] = defaultdict(int)
        for e in prof.events():
            if e.cpu_parent is None:
                by_op[e.name] += e.cpu_time_total / args.steps / 1e3
                calls[e.name] += 1
        profile = {k: (v, calls[k] / args.steps) for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:25]}
    assert len(eng.scheduler.running) == args.batch, "requests finished before the last measured step"

    sampler = time_sampler(runner.sampler, vocab, args.batch, args.sampler_iters)
    step = _quantiles(step_ms)
    fwd = _quantiles(forward_ms)
    print(f"{args.model} float32, {torch.get_num_threads()} thread(s), batch {args.batch}, input {args.input_len}, "
          f"temperature {args.temperature}")
    print(f"step    p50 {step['p50']:7.1f} ms  (p10 {step['p10']:.1f}, p90 {step['p90']:.1f})")
    print(f"forward p50 {fwd['p50']:7.1f} ms  (p10 {fwd['p10']:.1f}, p90 {fwd['p90']:.1f})")
    for name, ms in sampler.items():
        print(f"sampler {name:16s} {ms:7.2f} ms")
    if op_ms:
        print("forward pieces, ms per step (calls per step):")
        for name, (ms, n) in op_ms.items():
            print(f"  {ms:7.2f}  ({n:5.0f})  {name}")
    if ab:
        print("A/B step by step (medians, ms): A = " + args.ab_baseline + ", B = this tree")
        for name, r in ab.items():
            print(f"  {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()))
    if ab_attn:
        print(f"A/B decode attention, {args.ab_attention} rounds of {args.steps} steps each (medians, ms): "
              "A = torch (gathered copies + SDPA), B = C kernel (cache read in place)")
        for name, r in ab_attn.items():
            print(f"  {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()))
    if profile:
        print("top-level CPU ops, ms per step (calls per step):")
        for name, (ms, n) in profile.items():
            print(f"  {ms:7.2f}  ({n:5.0f})  {name[:90]}")
    if args.json:
        write_json(args.json, dict(model=args.model, batch=args.batch, input_len=args.input_len,
                                   temperature=args.temperature, threads=torch.get_num_threads(), step_ms=step,
                                   forward_ms=fwd, sampler_ms=sampler, op_ms=op_ms, ab=ab, ab_attention=ab_attn,
                                   profile=profile, machine=machine_info(),
                                   commit=git_commit()["sha"], date=time.strftime("%Y-%m-%d %H:%M")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
