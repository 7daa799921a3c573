import math
from dataclasses import dataclass, field

import pytest
import torch

from engine.sampler import Sampler, apply_min_p, apply_penalties, apply_top_k_top_p, draw_seed, inverse_cdf_draw
from engine.sampling_params import SamplingParams

EOS = 0


@dataclass
class State:
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=lambda: [1, 2])
    output_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None  # default: sampling_params.seed

    def __post_init__(self):
        if self.seed is None:
            self.seed = self.sampling_params.seed

    @property
    def num_computed_tokens(self) -> int:  # as when the engine samples: every token before the drawn one
        return len(self.prompt_token_ids) + len(self.output_token_ids)


def kept(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits]


def probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log().unsqueeze(0)


# ---- greedy ------------------------------------------------------------------------------------------------

def test_greedy_equals_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    out = Sampler(50, EOS)(logits, [State(SamplingParams(temperature=0)) for _ in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6


def test_greedy_rows_in_a_mixed_batch_take_the_argmax():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    states = [State(SamplingParams(temperature=0)), State(SamplingParams(temperature=1.0, seed=1)),
              State(SamplingParams(temperature=0)), State(SamplingParams(temperature=0.5, top_k=3))]
    out = Sampler(50, EOS)(logits, states)
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[2] == int(logits[2].argmax())
    assert out.token_ids[3] in set(logits[3].topk(3).indices.tolist())


def test_sampler_does_not_modify_the_callers_logits():
    logits = torch.randn(2, 20)
    before = logits.clone()
    states = [State(SamplingParams(repetition_penalty=2.0, temperature=0.7, top_p=0.5, min_p=0.1)),
              State(SamplingParams(temperature=0, min_tokens=3))]
    Sampler(20, EOS)(logits, states)
    assert torch.equal(logits, before)


# ---- seeded draws ------------------------------------------------------------------------------------------

# The CPU's draws (an inverse CDF; a seeded row's uniform from a CPU generator), and a GPU's (a device generator
# reseeded per row).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


def draw_sequence(seed: int, steps: int = 20, others: int = 0, device: str = "cpu") -> list[int]:
    """One seeded request drawing `steps` tokens from flat logits, batched with `others` unseeded rows."""
    sampler = Sampler(1000, None)
    state = State(SamplingParams(seed=seed))
    batch = [State(SamplingParams()) for _ in range(others)] + [state]
    tokens = []
    for _ in range(steps):
        tokens.append(sampler(torch.zeros(len(batch), 1000, device=device), batch).token_ids[-1])
        state.output_token_ids.append(tokens[-1])
    return tokens


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_draws_are_reproducible_and_differ_across_seeds(device):
    a = draw_sequence(seed=1, device=device)
    assert a == draw_sequence(seed=1, device=device)
    assert a != draw_sequence(seed=2, device=device)
    assert len(set(a)) > 10  # really drawn, not a constant


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_draws_do_not_depend_on_the_rest_of_the_batch(device):
    torch.manual_seed(123)
    alone = draw_sequence(seed=7, device=device)
    torch.manual_seed(456)
    batched = draw_sequence(seed=7, others=3, device=device)
    assert alone == batched


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_draws_follow_the_distribution(device):
    """Over many seeds, a seeded row's token follows probs (four tokens of 0.1, 0.2, 0.3, 0.4): each frequency
    within 5 standard deviations of its expectation."""
    probs = [0.1, 0.2, 0.3, 0.4]
    logits = probs_logits(probs).to(device).expand(64, 4).contiguous()
    sampler, counts, n = Sampler(4, None), [0] * 4, 0
    for batch in range(32):
        states = [State(SamplingParams(seed=batch * 64 + i)) for i in range(64)]
        for t in sampler(logits, states).token_ids:
            counts[t] += 1
            n += 1
    for c, p in zip(counts, probs):
        assert abs(c - n * p) < 5 * math.sqrt(n * p * (1 - p)), (counts, n)


@pytest.mark.parametrize("device", DEVICES)
def test_a_seeded_draw_depends_on_the_seed_and_the_position_only(device):
    """The token after prompt [1, 2] + outputs [3] is drawn as after prompt [1, 2, 3]: what a request re-issued as
    prompt + its outputs so far draws; and a draw does not depend on the draws before it."""
    sampler = Sampler(1000, None)
    logits = torch.zeros(1, 1000, device=device)
    torch.manual_seed(0)
    a = sampler(logits, [State(SamplingParams(seed=5), prompt_token_ids=[1, 2], output_token_ids=[3])]).token_ids
    torch.manual_seed(1)
    b = sampler(logits, [State(SamplingParams(seed=5), prompt_token_ids=[1, 2, 3])]).token_ids
    fresh = State(SamplingParams(seed=5), prompt_token_ids=[9, 9], output_token_ids=[9])
    assert a == b == sampler(logits, [fresh]).token_ids
    # Each position of one seed, and each seed at one position, draws something else.
    assert len({tuple(sampler(logits, [State(SamplingParams(seed=5), prompt_token_ids=[1] * n)]).token_ids)
                for n in range(1, 21)}) > 15
    assert len({tuple(sampler(logits, [State(SamplingParams(seed=s))]).token_ids) for s in range(20)}) > 15


def test_draw_seed_is_a_64_bit_value_that_mixes_seed_and_position():
    seeds = {draw_seed(s, p) for s in (-2**63, -1, 0, 1, 2, 2**63 - 1) for p in range(64)}
    assert len(seeds) == 6 * 64 and all(0 <= x < 2**64 for x in seeds)
    assert draw_seed(-1, 3) == draw_seed(2**64 - 1, 3)  # a negative seed is taken modulo 2**64
    # Neighbouring inputs flip about half of the output bits (the CPU generator keys on the low 32 of them).
    flips = [bin(draw_seed(s, p) ^ draw_seed(s + ds, p + dp)).count("1")
             for s in range(16) for p in range(16) for ds, dp in ((1, 0), (0, 1))]
    assert 28 < sum(flips) / len(flips) < 36
    low = [bin((draw_seed(s, p) ^ draw_seed(s, p + 1)) & 0xFFFFFFFF).count("1") for s in range(8) for p in range(32)]
    assert 14 < sum(low) / len(low) < 18


def test_unseeded_draws_follow_the_global_generator():
    torch.manual_seed(5)
    a = Sampler(1000, None)(torch.zeros(4, 1000), [State(SamplingParams()) for _ in range(4)]).token_ids
    torch.manual_seed(5)
    b = Sampler(1000, None)(torch.zeros(4, 1000), [State(SamplingParams()) for _ in range(4)]).token_ids
    assert a == b and len(set(a)) > 1


# ---- truncation masks --------------------------------------------------------------------------------------

def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 0.5, 2.5],
                           [5.0, 4.0, 3.0, 2.0, 1.0, 0.0],
                           [0.1, 3.0, -1.0, 2.0, 0.5, 2.5]])
    out = apply_top_k_top_p(logits, [3, 1, 0], [1.0, 1.0, 1.0])
    assert kept(out) == [{1, 5, 3}, {0}, {0, 1, 2, 3, 4, 5}]
    assert torch.equal(out[0, [1, 3, 5]], logits[0, [1, 3, 5]])  # kept logits unchanged
    # -1 and k >= vocab are off too.
    assert kept(apply_top_k_top_p(logits[:1], [-1], [1.0])) == [set(range(6))]
    assert kept(apply_top_k_top_p(logits[:1], [6], [1.0])) == [set(range(6))]


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = probs_logits([0.05, 0.4, 0.1, 0.3, 0.15]).repeat(4, 1)
    out = apply_top_k_top_p(logits, [0, 0, 0, 0], [0.35, 0.65, 0.8, 1.0])
    # descending: 1 (0.4), 3 (0.3), 4 (0.15), 2 (0.1), 0 (0.05); cumulative 0.4, 0.7, 0.85, 0.95, 1.0
    assert kept(out) == [{1}, {1, 3}, {1, 3, 4}, {0, 1, 2, 3, 4}]


def test_top_p_stops_as_soon_as_the_mass_reaches_p():
    # Four equal tokens (probability 0.25, exact in float): top_p=0.5 needs exactly two of them.
    out = apply_top_k_top_p(torch.zeros(2, 4), [0, 0], [0.5, 0.50001])
    assert [len(k) for k in kept(out)] == [2, 3]


def test_top_p_applies_to_the_top_k_renormalized_distribution():
    logits = probs_logits([0.05, 0.4, 0.1, 0.3, 0.15])
    # top_k=3 leaves 0.4, 0.3, 0.15 -> renormalized 0.47, 0.35, 0.18: top_p=0.8 keeps two, not three.
    assert kept(apply_top_k_top_p(logits, [3], [0.8])) == [{1, 3}]
    assert kept(apply_top_k_top_p(logits, [2], [0.99])) == [{1, 3}]


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    logits = probs_logits([0.05, 0.4, 0.1, 0.3, 0.15]).repeat(3, 1)
    out = apply_min_p(logits, [0.3, 0.5, 0.0])  # thresholds 0.12, 0.2, 0
    assert kept(out) == [{1, 3, 4}, {1, 3}, {0, 1, 2, 3, 4}]
    # min_p=1 keeps exactly the tokens tied at the top.
    assert kept(apply_min_p(torch.tensor([[1.0, 3.0, 3.0, 2.0]]), [1.0])) == [{1, 2}]


def test_sampled_tokens_stay_inside_the_kept_set():
    logits = probs_logits([0.05, 0.4, 0.1, 0.3, 0.15])
    sampler = Sampler(5, None)
    cases = [(SamplingParams(top_k=2, seed=0), {1, 3}), (SamplingParams(top_p=0.8, seed=0), {1, 3, 4}),
             (SamplingParams(min_p=0.3, seed=0), {1, 3, 4})]
    for params, allowed in cases:
        drawn = {sampler(logits, [State(params, seed=seed)]).token_ids[0] for seed in range(300)}
        assert drawn == allowed, params


# ---- penalties and min_tokens ------------------------------------------------------------------------------

def test_penalties_give_the_exact_expected_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, -1.0, 4.0]])
    # prompt has 0 and 1; output has 2 twice and 4 once; 3 and 5 unseen.
    out = apply_penalties(logits, [[0, 1]], [[2, 4, 2]], [2.0], [0.5], [0.25])
    # repetition: positive / 2, negative * 2 for 0, 1, 2, 4.
    # frequency 0.5 * count: token 2 -> -1.0, token 4 -> -0.5; presence 0.25 for 2 and 4.
    expected = torch.tensor([[1.0, -4.0, 0.5 - 1.0 - 0.25, 0.5, -2.0 - 0.5 - 0.25, 4.0]])
    assert torch.equal(out, expected)


def test_penalties_per_row_and_off_rows_unchanged():
    logits = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    out = apply_penalties(logits, [[0], [0]], [[1], []], [1.0, 4.0], [0.0, 0.0], [-1.0, 0.0])
    assert torch.equal(out, torch.tensor([[1.0, 2.0, 1.0], [0.25, 1.0, 1.0]]))


def test_penalties_change_the_greedy_choice_through_the_sampler():
    logits = torch.tensor([[3.0, 2.0, 1.0]])
    sampler = Sampler(3, None)
    state = State(SamplingParams(temperature=0, repetition_penalty=2.0), prompt_token_ids=[0],
                  output_token_ids=[])
    assert sampler(logits, [state]).token_ids == [1]  # 3 / 2 = 1.5 < 2
    state = State(SamplingParams(temperature=0, frequency_penalty=0.6), prompt_token_ids=[0],
                  output_token_ids=[0, 0])
    assert sampler(logits, [state]).token_ids == [1]  # 3 - 1.2 = 1.8 < 2


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.tensor([[9.0, 1.0, 8.0, 7.0]])  # EOS = 0, then 2 and 3
    sampler = Sampler(4, EOS)
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    assert sampler(logits, [State(params, output_token_ids=[])]).token_ids == [3]
    assert sampler(logits, [State(params, output_token_ids=[5])]).token_ids == [3]
    assert sampler(logits, [State(params, output_token_ids=[5, 5])]).token_ids == [0]
    # With ignore_eos, EOS is not a stop token, so min_tokens leaves it alone.
    params = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sampler(logits, [State(params)]).token_ids == [0]
    # A sampled row never draws a masked token.
    params = SamplingParams(min_tokens=1)
    assert 0 not in {sampler(logits, [State(params, seed=seed)]).token_ids[0] for seed in range(200)}


# ---- logprobs ----------------------------------------------------------------------------------------------

def test_logprobs_are_the_raw_log_softmax_and_contain_the_sampled_token():
    torch.manual_seed(0)
    logits = torch.randn(3, 40)
    raw = torch.log_softmax(logits, dim=-1)
    states = [State(SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.5, logprobs=3, seed=1),
                    prompt_token_ids=list(range(10))),
              State(SamplingParams(temperature=0, logprobs=0)),
              State(SamplingParams(temperature=0))]
    out = Sampler(40, EOS)(logits, states)
    lp0, lp1, lp2 = out.logprobs
    top3 = raw[0].topk(3).indices.tolist()
    assert set(lp0) == set(top3) | {out.token_ids[0]}
    for tok, lp in lp0.items():
        assert lp == raw[0, tok].item()
    assert lp1 == {out.token_ids[1]: raw[1, out.token_ids[1]].item()}
    assert lp2 is None


# ---- statistics --------------------------------------------------------------------------------------------

def frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_sampling_matches_softmax_frequencies(seeded):
    logits = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5, 1.5])
    temperature = 0.7
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    sampler = Sampler(6, None)
    n = 20000
    torch.manual_seed(0)
    if seeded:
        # 400 seeded requests (neighbouring seeds), each drawing 50 tokens (neighbouring positions).
        states = [State(SamplingParams(temperature=temperature, seed=seed)) for seed in range(400)]
        tokens = []
        for _ in range(n // 400):
            step = sampler(logits.repeat(400, 1), states).token_ids
            for state, t in zip(states, step):
                state.output_token_ids.append(t)
            tokens += step
    else:
        # Unseeded rows share one draw per call: a batch of n identical rows.
        states = [State(SamplingParams(temperature=temperature)) for _ in range(n)]
        tokens = sampler(logits.repeat(n, 1), states).token_ids
    freq = frequencies(tokens, 6)
    # 5 standard deviations of a binomial proportion.
    tol = 5 * torch.sqrt(expected * (1 - expected) / n)
    assert torch.all((freq - expected).abs() < tol), (freq, expected)


def test_top_p_sampling_matches_the_renormalized_distribution():
    probs = [0.05, 0.4, 0.1, 0.3, 0.15]
    n = 20000
    torch.manual_seed(1)
    states = [State(SamplingParams(top_p=0.8)) for _ in range(n)]
    tokens = Sampler(5, None)(probs_logits(probs).repeat(n, 1), states).token_ids
    expected = torch.tensor([0.0, 0.4, 0.0, 0.3, 0.15], dtype=torch.float64) / 0.85
    freq = frequencies(tokens, 5)
    tol = 5 * torch.sqrt(expected * (1 - expected) / n) + 1e-12
    assert torch.all((freq - expected).abs() < tol), (freq, expected)
    assert math.isclose(freq.sum().item(), 1.0)


def test_inverse_cdf_draw_never_draws_a_zero_probability_token():
    # Zeros first, last and between; unnormalized rows; a row whose whole mass is one token.
    probs = torch.tensor([[0.0, 2.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 3.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    torch.manual_seed(0)
    n = 20000
    tokens = inverse_cdf_draw(probs.repeat(n, 1)).view(n, 3)
    assert set(tokens[:, 0].tolist()) == {1, 3} and set(tokens[:, 1].tolist()) == {4}
    assert set(tokens[:, 2].tolist()) == {0}
    assert abs((tokens[:, 0] == 1).double().mean().item() - 2 / 3) < 5 * (2 / 9 / n) ** 0.5


@pytest.mark.parametrize("scale", [8.0, 3.0, 0.01])  # peaked (a trained model's), moderate, flat (the full sort)
def test_cpu_top_p_by_candidates_equals_the_full_sort(scale, monkeypatch):
    import engine.sampler as sampler
    from engine.sampler import TOP_P_CANDIDATES, _top_k_top_p_sorted

    sorted_rows = []
    monkeypatch.setattr(sampler, "_top_k_top_p_sorted",
                        lambda x, k, p: sorted_rows.append(x.shape[0]) or _top_k_top_p_sorted(x, k, p))

    g = torch.Generator().manual_seed(int(scale * 100))
    rows, vocab = 12, 8 * TOP_P_CANDIDATES
    logits = torch.randn(rows, vocab, generator=g) * scale
    logits[3, 5:9] = logits[3].max()  # ties at the top
    top_k = [0, 0, 50, 0, -1, 300, 0, 2, 0, 0, 0, 0]
    top_p = [0.9, 0.5, 0.8, 0.95, 0.99, 0.7, 1.0, 0.9, 0.1, 0.999, 0.3, 0.6]
    out = apply_top_k_top_p(logits, top_k, top_p)
    k = torch.tensor([t if 0 < t < vocab else vocab for t in top_k])
    p = torch.tensor([t if t < 1.0 else 2.0 for t in top_p])
    ref = _top_k_top_p_sorted(logits, k, p)
    assert torch.equal(out.isinf(), ref.isinf())
    assert torch.equal(out[~out.isinf()], ref[~ref.isinf()])
    if scale == 8.0:  # peaked: every row's cut lies among the candidates, nothing is sorted
        assert sorted_rows == []
    elif scale == 0.01:  # flat: 300 candidates (row 5's top-k) hold ~15% of a row; the rows with no top-k and a
        assert sorted_rows == [7]  # top_p above that take the full sort, they alone (not row 8's 0.1)
