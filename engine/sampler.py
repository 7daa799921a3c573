"""`Sampler`: turns one step's logits into one token per running sequence.

The order is vLLM's:
0. structured outputs: a row with a grammar gets -inf at every token its grammar forbids now, on the logits'
   device (engine/structured_output.py, TokenMasks; vLLM applies the grammar bitmask to the logits before its
   sampler runs, so everything below sees the masked logits);
1. logprobs are taken from the raw logits (log_softmax before any processing);
2. min_tokens: EOS and stop_token_ids are masked while the output is shorter than min_tokens (not on a row with a
   grammar: the grammar decides where the output may end, and masking the end it requires would leave no token);
3. repetition penalty over prompt + output tokens (divide positive / multiply negative logits);
4. frequency and presence penalties over output tokens;
5. greedy rows take the argmax; the others go through temperature, top-k, top-p, min-p and a draw.

Everything is vectorized over the batch: per-row parameters become tensors once per call (copied without waiting
for the device), and the only device-to-host transfer is one non-blocking copy of the results, read by
`DeviceSample.result()` (the engine reads a step's tokens after it has launched the next step).

A draw is an exponential race: argmax(probs / q), q ~ Exp(1). Rows without a seed share one draw from the global
generator; on the CPU they take an inverse-CDF draw instead, one uniform per row against the running sum of probs
(the same distribution: torch's CPU exponential_ costs ~30 ns an element, most of a decode step's sampling at
16 x 49,152; bench/RESULTS.md, "CPU: sampler and small ops").
A row with a seed draws its q from a generator on the logits' device seeded with `draw_seed(seed, position)`,
position being the number of tokens in the sequence before the one drawn (prompt + outputs): the draw for a token
depends on the request's seed and the token's place only, not on how many draws came before it. So a request
re-issued as prompt + the outputs it already had (a migrated stream), or whose first token another engine drew (the
prefill -> decode hand-off), draws what an undisturbed run would have, on engines of the same device type (the CPU's
generator and CUDA's differ: a CPU engine and a GPU engine draw different, equally distributed, tokens for a seed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.sampling_params import SamplingParams
from engine.structured_output import TokenMasks


class SamplingState(Protocol):
    """What the sampler reads from a request (the engine's `Request` satisfies it)."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    seed: int | None  # the completion's seed (SamplingParams.seed + its index among the n), None: unseeded
    num_computed_tokens: int  # at sampling time: the tokens before the one drawn (its position)
    # Optional: a RequestGrammar (engine/structured_output.py) whose matcher stands after output_token_ids.
    # grammar: RequestGrammar | None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    """One sampled token id per row."""
    logprobs: list[dict[int, float] | None]
    """Per row, when its params.logprobs is not None: the top-n ids -> logprob, plus the sampled id."""


_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment: 2**64 / the golden ratio


def _mix64(z: int) -> int:
    """SplitMix64's finalizer (Stafford's Mix13): a bijection of [0, 2**64) in which every input bit flips about
    half of the output bits."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def draw_seed(seed: int, position: int) -> int:
    """The generator seed, in [0, 2**64), of the draw for the token at `position` (the tokens before it: prompt +
    outputs) of a request seeded with `seed` (any int; a negative one is taken modulo 2**64): output position + 1 of
    a SplitMix64 stream started from the mixed seed. Nearby seeds start far apart, and nearby positions of one
    stream do not correlate. A CPU generator (mt19937) keys on the low 32 bits, which are as well mixed as the rest."""
    return _mix64((_mix64(seed & _MASK64) + (position + 1) * _GAMMA) & _MASK64)


class Sampler:
    def __init__(self, vocab_size: int, eos_token_id: int | Sequence[int] | None):
        self.vocab_size = vocab_size
        self.token_masks = TokenMasks(vocab_size)  # structured outputs' bitmask buffers, kept between steps
        self._generator = torch.Generator()  # CPU; re-seeded for every seeded row's draw (draw_seed)
        self._device_generators: dict[torch.device, torch.Generator] = {}  # the same on other devices
        if eos_token_id is None:
            self.eos_token_ids: list[int] = []
        elif isinstance(eos_token_id, int):
            self.eos_token_ids = [eos_token_id]
        else:
            self.eos_token_ids = list(eos_token_id)

    def __call__(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SamplerOutput:
        """logits: [batch, vocab] float32, any device; one row per state."""
        return self.sample(logits, states).result()

    def sample(self, logits: torch.Tensor, states: Sequence[SamplingState],
               before_mask: Callable[[Callable[[], None]], None] | None = None) -> "DeviceSample":
        """Like __call__, but returns as soon as the work is queued on the device.
        before_mask(fill), when there are grammar rows: runs fill (their bitmask, on the host) once, after their
        matchers took the previous step's tokens, and returns once it has run: under async scheduling the engine
        reads that step there, while this step's forward pass runs on the device, and fills on its grammar thread.
        A row whose matcher has ended (on the previous token: that step ran one step ahead) is not masked; its
        request is finished and its token is dropped."""
        assert logits.dim() == 2 and logits.shape[0] == len(states), (logits.shape, len(states))
        assert logits.shape[1] == self.vocab_size, (logits.shape, self.vocab_size)
        params = [s.sampling_params for s in states]
        logits = logits.float()
        grammar_rows = [i for i, s in enumerate(states) if getattr(s, "grammar", None) is not None]
        masked: list[int] = []
        if grammar_rows:
            filled = []
            cuda = logits.device.type == "cuda"

            def fill() -> None:
                rows = [i for i in grammar_rows if not states[i].grammar.terminated]
                if rows:
                    grammars = [states[i].grammar for i in rows]
                    assert all(g.active for g in grammars), "a request is scheduled before its grammar compiled"
                    self.token_masks.fill(grammars, rows, pin=cuda)
                masked.extend(rows)
                filled.append(True)

            if before_mask is not None:
                before_mask(fill)
            else:
                fill()
            if not filled:  # (it raised on the grammar thread): never sample a constrained row unmasked
                raise RuntimeError("structured outputs: the grammar rows' token mask was not filled")
            if masked:
                logits = logits.clone()  # (not the runner's buffer: a CUDA graph's output is reused)
                self.token_masks.launch(logits)
        # One pass over the rows for what the batch needs (most steps: plain greedy or plain sampling, no logprobs).
        any_logprobs = any_min_tokens = False
        penalty_rows = []
        sample_rows = []
        for i, p in enumerate(params):
            if p.logprobs is not None:
                any_logprobs = True
            if p.min_tokens > 0:
                any_min_tokens = True
            if p.has_penalties:
                penalty_rows.append(i)
            if not p.greedy:
                sample_rows.append(i)

        raw_logprobs = None
        if any_logprobs:
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]

        min_tokens_masks = self._min_tokens_masks(states, grammar_rows) if any_min_tokens else []
        if min_tokens_masks or penalty_rows:
            if not masked:
                logits = logits.clone()  # (the masks and penalties go in place; the caller's logits stay)
            for row, ids in min_tokens_masks:
                logits[row, ids] = float("-inf")
            if penalty_rows:
                self._apply_penalties(logits, states, penalty_rows)
        if sample_rows and len(sample_rows) == len(states):
            token_ids = self._sample(logits, states)  # every row draws: no argmax, no row gather
        else:
            token_ids = logits.argmax(dim=-1)  # [B], right for greedy rows
            if sample_rows:
                sub = [states[i] for i in sample_rows]
                rows = _tensor(sample_rows, torch.int64, logits.device)
                token_ids[rows] = self._sample(logits[rows], sub)

        # Penalties and min_tokens read the outputs before the next step is scheduled: the engine reads this step
        # first (a sync under async scheduling). A grammar row needs its token only by the next step's mask, which
        # before_mask provides with the next forward pass already running.
        return DeviceSample(token_ids, raw_logprobs, params,
                            needs_host_tokens=bool(penalty_rows) or any_min_tokens)

    # ---- logits processing -------------------------------------------------------------------------------

    def _min_tokens_masks(self, states: Sequence[SamplingState],
                          skip_rows: list[int] = ()) -> list[tuple[int, list[int]]]:
        """(row, token ids to mask) for every row whose output is still shorter than min_tokens (but skip_rows)."""
        masks = []
        skip = set(skip_rows)
        for i, s in enumerate(states):
            p = s.sampling_params
            if len(s.output_token_ids) < p.min_tokens and i not in skip:
                ids = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
                ids = [t for t in ids if t < self.vocab_size]
                if ids:
                    masks.append((i, ids))
        return masks

    def _apply_penalties(self, logits: torch.Tensor, states: Sequence[SamplingState],
                         rows: list[int]) -> None:
        """In place on logits[rows]."""
        sub = [states[i].sampling_params for i in rows]
        row_idx = _tensor(rows, torch.int64, logits.device)
        logits[row_idx] = apply_penalties(
            logits[row_idx], [states[i].prompt_token_ids for i in rows],
            [states[i].output_token_ids for i in rows], [p.repetition_penalty for p in sub],
            [p.frequency_penalty for p in sub], [p.presence_penalty for p in sub])

    def _sample(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """Draw one token per row of logits [R, V] (all rows non-greedy; read, not written); returns [R] int64."""
        device = logits.device
        params = [s.sampling_params for s in states]
        temperatures = [p.temperature for p in params]
        if any(t != 1.0 for t in temperatures):  # (x / 1.0 is x: vllm bench serve's default skips a pass)
            logits = logits / _tensor(temperatures, torch.float32, device).unsqueeze(1)

        logits = apply_top_k_top_p(logits, [p.top_k for p in params], [p.top_p for p in params])
        logits = apply_min_p(logits, [p.min_p for p in params])
        probs = torch.softmax(logits, dim=-1)  # [R, V]
        if device.type == "cpu":
            return self._sample_cpu(probs, states)
        q = torch.empty_like(probs)
        q.exponential_()  # one shared draw for the rows without a seed
        seeded = [i for i, s in enumerate(states) if s.seed is not None]
        if seeded:
            # Each seeded row draws on the logits' device from a generator seeded for its token (vLLM keeps a device
            # generator per request): one launch a row. (Drawn on the CPU and copied, the noise cost a vocabulary of
            # floats a row and step on the host, ~5 ms a row at 152k: seconds a step at large batches.)
            gen = self._device_generator(device)
            for i in seeded:
                s = states[i]
                gen.manual_seed(draw_seed(s.seed, s.num_computed_tokens))
                q[i].exponential_(generator=gen)
        # Exp(1) can round to 0 on some backends; 0 / 0 would be NaN and win the argmax.
        q.clamp_(min=torch.finfo(torch.float32).tiny)
        return (probs / q).argmax(dim=-1)

    def _device_generator(self, device: torch.device) -> torch.Generator:
        """A generator on `device`, reseeded for every seeded row's draw. (A launch reads its generator's seed and
        offset when it is queued, so one object serves every row.)"""
        gen = self._device_generators.get(device)
        if gen is None:
            gen = self._device_generators[device] = torch.Generator(device=device)
        return gen

    def _sample_cpu(self, probs: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """_sample's draw on the CPU, from probs [R, V]: an inverse-CDF draw per row, its uniform from the global
        generator, or for a seeded row from the CPU generator seeded with draw_seed(seed, position): a function of
        the seed and the token's position alone, whatever the batch. (The exponential race a GPU runs would draw a
        vocabulary of noise a row: ~1 ms a row and step at 49k tokens on one core.)"""
        u = torch.rand(len(states), 1, dtype=torch.float64)
        gen = self._generator
        for i, s in enumerate(states):
            if s.seed is not None:
                gen.manual_seed(draw_seed(s.seed, s.num_computed_tokens))
                u[i, 0] = torch.rand((), dtype=torch.float64, generator=gen)
        return inverse_cdf_draw(probs, u)


class DeviceSample:
    """One step's sampled tokens (and logprobs) on the device, with a non-blocking copy to the host under way."""

    def __init__(self, token_ids: torch.Tensor, raw_logprobs: torch.Tensor | None, params: list[SamplingParams],
                 needs_host_tokens: bool = False):
        self.token_ids = token_ids  # [B] int64, on the logits' device: the next step's inputs read it there
        self.params = params
        # Some row has penalties or min_tokens: the next step's sampling needs this step's tokens on the host.
        self.needs_host_tokens = needs_host_tokens
        self.num_top = 0
        if raw_logprobs is None:
            packed = token_ids
        else:
            self.num_top = max(p.logprobs for p in params if p.logprobs is not None)
            sampled_lp = raw_logprobs.gather(1, token_ids.unsqueeze(1))  # [B, 1]
            # Pack ids and logprobs into one float64 tensor: ids < 2**53 are exact, float32 logprobs are exact.
            parts = [token_ids.unsqueeze(1).double(), sampled_lp.double()]
            if self.num_top > 0:
                top_lp, top_ids = raw_logprobs.topk(self.num_top, dim=-1)  # [B, n]
                parts += [top_ids.double(), top_lp.double()]
            packed = torch.cat(parts, dim=1)
        self._event = None
        if packed.is_cuda:
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = packed

    def result(self) -> SamplerOutput:
        """Waits for the copy (only for this step's work, not for work queued after it)."""
        if self._event is not None:
            self._event.synchronize()
        rows = self._host.tolist()
        if self._host.dim() == 1:
            return SamplerOutput(token_ids=rows, logprobs=[None] * len(rows))
        out_ids, out_lps = [], []
        num_top = self.num_top
        for row, p in zip(rows, self.params):
            tok = int(row[0])
            out_ids.append(tok)
            if p.logprobs is None:
                out_lps.append(None)
                continue
            top: dict[int, float] = {}
            for j in range(p.logprobs):
                top[int(row[2 + j])] = row[2 + num_top + j]
            top.setdefault(tok, row[1])
            out_lps.append(top)
        return SamplerOutput(token_ids=out_ids, logprobs=out_lps)


def to_device_nowait(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, copied without waiting for the device's queued work (through pinned memory on
    CUDA; a pageable source could make the copy wait). The engine's per-step inputs go this way too."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device (to_device_nowait)."""
    return to_device_nowait(torch.tensor(values, dtype=dtype), device)


def apply_penalties(logits: torch.Tensor, prompt_token_ids: list[list[int]],
                    output_token_ids: list[list[int]], repetition_penalty: list[float],
                    frequency_penalty: list[float], presence_penalty: list[float]) -> torch.Tensor:
    """Penalized copy of logits [R, V], as vLLM: the repetition penalty divides positive and multiplies
    negative logits of every token seen in the prompt or the output; then the frequency penalty times the
    token's output count and the presence penalty (once) are subtracted for tokens seen in the output."""
    device, vocab = logits.device, logits.shape[1]
    rep, freq, pres = _tensor([repetition_penalty, frequency_penalty, presence_penalty], torch.float32,
                              device).unsqueeze(2)  # each [R, 1]
    output_counts = _bin_counts(output_token_ids, vocab, device)  # [R, V]
    output_seen = output_counts > 0
    seen = output_seen | (_bin_counts(prompt_token_ids, vocab, device) > 0)
    penalty = torch.where(seen, rep, 1.0)  # [R, V]
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    return logits - freq * output_counts - pres * output_seen.float()


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Copy of logits [R, V] with -inf where top-k, then top-p (over the top-k renormalized distribution),
    drop the token. top_k 0 or -1 and top_p 1 are off.

    Top-k keeps every token whose logit is >= the k-th largest (ties at the boundary are kept, as vLLM).
    Top-p keeps the smallest prefix of the descending order whose probability sum reaches top_p.
    """
    device, vocab = logits.device, logits.shape[1]
    k_on = [0 < k < vocab for k in top_k]
    p_on = [p < 1.0 for p in top_p]
    if not any(k_on) and not any(p_on):
        return logits
    k = _tensor([k if on else vocab for k, on in zip(top_k, k_on)], torch.int64, device)  # [R]
    if not any(p_on):
        # Top-k only: a partial top-k of the largest k is cheaper than a full sort.
        max_k = max(k for k, on in zip(top_k, k_on) if on)
        top_vals = logits.topk(max_k, dim=-1).values  # [R, max_k]
        kth = top_vals.gather(1, (k.clamp(max=max_k) - 1).unsqueeze(1))  # [R, 1]
        kth = torch.where(_tensor(k_on, torch.bool, device).unsqueeze(1), kth, float("-inf"))
        return logits.masked_fill(logits < kth, float("-inf"))

    # top_p > 1 means off: a sum of probabilities may round to >= 1 before the tail ends.
    p = _tensor([p if on else 2.0 for p, on in zip(top_p, p_on)], torch.float32, device)  # [R]
    if device.type == "cpu":
        max_k = max((k for k, on in zip(top_k, k_on) if on), default=0)
        return _top_k_top_p_partial(logits, k, p, _tensor(k_on, torch.bool, device), max_k)
    return _top_k_top_p_sorted(logits, k, p)


TOP_P_CANDIDATES = 256  # the CPU's top-p looks for its cut among this many of a row's largest logits first


def _top_k_top_p_sorted(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """apply_top_k_top_p's top-k then top-p by a full sort of each row: k [R] (vocab: off), p [R] (2.0: off)."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [R, V]
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))  # [R, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # probability of the tokens ranked above
    sorted_logits = sorted_logits.masked_fill(mass_before >= p.unsqueeze(1), float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def _top_k_top_p_partial(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor, k_on: torch.Tensor, max_k: int,
                         candidates: int = TOP_P_CANDIDATES) -> torch.Tensor:
    """_top_k_top_p_sorted's result from a partial top-`candidates` of each row instead of a full sort (on one CPU
    core a sort of 16 x 49,152 logits costs more than the rest of a decode step's sampling many times over).

    A trained model's distribution puts top_p's mass (0.9, 0.95) in a few dozen tokens: when a row's largest
    `candidates` logits hold at least p of its (top-k renormalized) probability, the cut lies among them and the
    smallest prefix reaching p is found there; tokens past them have at least that mass ranked above and are dropped,
    as the sort would drop them. Rows whose candidates fall short (a flat distribution) take the full sort."""
    vocab = logits.shape[1]
    c = max(candidates, max_k)  # top-k's k-th largest must be among the candidates
    if c * 4 >= vocab:
        return _top_k_top_p_sorted(logits, k, p)
    vals, idx = logits.topk(c, dim=-1)  # [R, c], descending
    kth = vals.gather(1, (k.clamp(max=c) - 1).unsqueeze(1))  # [R, 1]: the k-th largest (k <= c where top-k is on)
    kth = torch.where(k_on.unsqueeze(1), kth, float("-inf"))
    masked = logits.masked_fill(logits < kth, float("-inf"))  # [R, V]: top-k's mask (ties at the boundary kept)
    probs = torch.softmax(masked, dim=-1).gather(1, idx)  # [R, c]: the candidates' renormalized probabilities
    mass_before = torch.cumsum(probs, dim=-1) - probs
    found = (mass_before[:, -1] + probs[:, -1]) >= p  # [R]: the cut lies among the candidates
    cand = vals.masked_fill((vals < kth) | (mass_before >= p.unsqueeze(1)), float("-inf"))
    out = torch.full_like(logits, float("-inf")).scatter_(1, idx, cand)
    off = p > 1.0  # top-p off: top-k's mask alone, whatever the candidates hold
    out = torch.where(off.unsqueeze(1), masked, out)
    short = ~(found | off)
    if bool(short.any()):
        rows = short.nonzero().squeeze(1)
        out[rows] = _top_k_top_p_sorted(logits[rows], k[rows], p[rows])
    return out


def inverse_cdf_draw(probs: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of probs [R, V] (non-negative, not necessarily normalized), drawn with probability
    proportional to probs from one uniform per row (u [R, 1] float64 in [0, 1); default: the global generator's);
    returns [R] int64.

    The running sum is float64, so each token's share of it is its float32 probability to ~1e-16. A token of
    probability 0 adds nothing to the sum and is never drawn: searchsorted(right=True) returns the first index whose
    sum exceeds u, and u stays below the row's total."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [R, V], non-decreasing
    total = cdf[:, -1:]  # [R, 1]
    if u is None:
        u = torch.rand(total.shape, dtype=torch.float64, device=probs.device)
    u = u * total  # [R, 1] in [0, total]
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # rand * total can round up to total
    return torch.searchsorted(cdf, u, right=True).squeeze(1)


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Copy of logits [R, V] with -inf where the token's probability is below min_p times the top one's."""
    if not any(m > 0.0 for m in min_p):
        return logits
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p)   (min_p = 0: log = -inf, no mask)
    m = _tensor(min_p, torch.float32, logits.device)
    threshold = logits.amax(dim=-1) + torch.log(m)  # [R]
    return logits.masked_fill(logits < threshold.unsqueeze(1), float("-inf"))


def _bin_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[R, V] float32: how often each token id occurs in each row's list."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, dtype=torch.float32, device=device)
    if width > 0:
        # Pad with the extra column `vocab`, dropped afterwards.
        padded = _tensor([list(t) + [vocab] * (width - len(t)) for t in token_lists], torch.int64,
                         device)  # [R, width]
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]
