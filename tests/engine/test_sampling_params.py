import pytest

from engine.sampling_params import SamplingParams


def test_defaults_mirror_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.ignore_eos and not p.include_stop_str_in_output and p.skip_special_tokens
    assert not p.greedy and not p.has_penalties


def test_stop_is_normalized_to_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_greedy():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    # As vLLM, greedy turns the truncation parameters off.
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)


def test_max_tokens_none_means_up_to_the_context():
    assert SamplingParams(max_tokens=None, min_tokens=5).max_tokens is None


def test_has_penalties():
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=-0.5).has_penalties
    assert SamplingParams(frequency_penalty=2.0).has_penalties


@pytest.mark.parametrize("field, value, message", [
    ("temperature", -0.1, "temperature=-0.1: must be >= 0"),
    ("temperature", float("nan"), "temperature=nan: must be >= 0"),
    ("top_p", 1.5, "top_p=1.5: must be in (0, 1]"),
    ("top_p", 0.0, "top_p=0.0: must be in (0, 1]"),
    ("top_k", -2, "top_k=-2: must be -1 or 0 (off) or an int >= 1"),
    ("top_k", 2.5, "top_k=2.5: must be -1 or 0 (off) or an int >= 1"),
    ("min_p", 1.01, "min_p=1.01: must be in [0, 1]"),
    ("min_p", -0.01, "min_p=-0.01: must be in [0, 1]"),
    ("presence_penalty", 2.5, "presence_penalty=2.5: must be in [-2, 2]"),
    ("frequency_penalty", -3.0, "frequency_penalty=-3.0: must be in [-2, 2]"),
    ("repetition_penalty", 0.0, "repetition_penalty=0.0: must be > 0"),
    ("max_tokens", 0, "max_tokens=0: must be an int >= 1 or None"),
    ("min_tokens", -1, "min_tokens=-1: must be an int >= 0"),
    ("min_tokens", 17, "min_tokens=17: must be <= max_tokens=16"),
    ("n", 0, "n=0: must be an int in [1, 128]"),
    ("n", 129, "n=129: must be an int in [1, 128]"),
    ("logprobs", 21, "logprobs=21: must be an int in [0, 20] or None"),
    ("logprobs", -1, "logprobs=-1: must be an int in [0, 20] or None"),
    ("seed", 1.5, "seed=1.5: must be an int or None"),
    ("stop", ["ok", ""], "stop=['ok', '']: must be a non-empty string or a list of them"),
    ("stop_token_ids", [-1], "stop_token_ids=[-1]: must be ints >= 0"),
])
def test_invalid_values_name_the_field_value_and_range(field, value, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert str(e.value).startswith(message), str(e.value)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.0), dict(top_p=1.0), dict(top_p=1e-3), dict(top_k=-1), dict(top_k=1),
    dict(min_p=0.0), dict(min_p=1.0), dict(presence_penalty=-2.0), dict(frequency_penalty=2.0),
    dict(repetition_penalty=0.01), dict(max_tokens=1), dict(min_tokens=16), dict(n=128),
    dict(logprobs=0), dict(logprobs=20), dict(seed=0),
])
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_k=2**31), r"^top_k=2147483648: must be at most 2147483647$"),
    (dict(max_tokens=2**31), r"^max_tokens=2147483648: must be at most 2147483647$"),
    (dict(min_tokens=2**31, max_tokens=None), r"^min_tokens=2147483648: must be at most 2147483647$"),
    (dict(stop_token_ids=[1, 2**31]), r"^stop_token_ids=\[1, 2147483648\]: must be ints <= 2147483647$"),
    (dict(seed=2**63), r"^seed=9223372036854775808: must be in \[-2\*\*63, 2\*\*63 - n\]"),
    (dict(seed=2**63 - 2, n=4), r"^seed=9223372036854775806: must be in"),
    (dict(seed=-2**63 - 1), r"^seed=-9223372036854775809: must be in"),
])
def test_values_the_wire_cannot_carry_are_refused_naming_the_field(kwargs, message):
    """The services carry int32 counts and an int64 seed (seed + i for completion i): a larger value is the
    caller's error here, not a protobuf range error (HTTP 500) in the router later."""
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
    SamplingParams(top_k=2**31 - 1, seed=2**63 - 4, n=4)  # the largest that fit
