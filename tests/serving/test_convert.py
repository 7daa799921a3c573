"""serving/rpc.py conversions: every SamplingParams field crosses the wire and comes back equal."""
from __future__ import annotations

from dataclasses import fields

import pytest

from engine.sampling_params import SamplingParams, StructuredOutputsParams
from protos.tandem.v1 import common_pb2
from serving.convert import (delta_to_proto, finish_from_proto, finish_to_proto, logprobs_from_proto, logprobs_to_proto, sampling_from_proto, sampling_to_proto)


def test_every_sampling_field_has_a_proto_field():
    proto_fields = set(common_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
    missing = [f.name for f in fields(SamplingParams) if f.name not in proto_fields]
    assert not missing, f"add these SamplingParams fields to common.proto and serving/rpc.py: {missing}"


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(n=3, presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.25, temperature=0.7,
                   top_p=0.9, top_k=40, min_p=0.05, seed=1234, stop=["\n\n", "END"], stop_token_ids=[2, 7],
                   include_stop_str_in_output=True, ignore_eos=True, max_tokens=77, min_tokens=3, logprobs=5,
                   skip_special_tokens=False),
    SamplingParams(temperature=0.0, max_tokens=1, logprobs=0),
    SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True,
                                                              disable_additional_properties=True)),
    SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b c"])),
    SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"\d+")),
    SamplingParams(structured_outputs=StructuredOutputsParams(grammar='root ::= "x"')),
    SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)),
])
def test_sampling_params_round_trip(params):
    """(max_tokens=None, "up to the context", does not cross: the router resolves it first.)"""
    back = sampling_from_proto(common_pb2.SamplingParams.FromString(sampling_to_proto(params).SerializeToString()))
    assert back == params


def test_bad_values_raise_naming_the_field():
    with pytest.raises(ValueError, match="^max_tokens="):
        sampling_from_proto(common_pb2.SamplingParams(max_tokens=-1))
    with pytest.raises(ValueError, match="^top_p="):
        sampling_from_proto(common_pb2.SamplingParams(top_p=1.5))
    with pytest.raises(ValueError, match="^structured_outputs.regex: invalid"):
        sampling_from_proto(common_pb2.SamplingParams(structured_outputs=common_pb2.StructuredOutputs(regex="(")))
    with pytest.raises(ValueError, match="^structured_outputs: exactly one of"):
        sampling_from_proto(common_pb2.SamplingParams(structured_outputs=common_pb2.StructuredOutputs()))


def test_finish_reasons_and_logprobs():
    for r in ("stop", "length", "abort", None):
        assert finish_from_proto(finish_to_proto(r)) == r
    lps = [{5: -0.1, 9: -2.5, 1: -3.0}, {4: -1.0, 2: -0.5}]
    msgs = logprobs_to_proto(lps, [5, 4])
    assert [m.candidates[0].token_id for m in msgs] == [5, 4]  # the sampled token first
    assert logprobs_from_proto(msgs) == [{5: pytest.approx(-0.1), 9: -2.5, 1: -3.0}, {4: -1.0, 2: -0.5}]


def test_delta_from_step_output():
    from engine import StepOutput

    out = StepOutput(request_id="r", index=0, new_token_ids=[3], new_text="a", new_logprobs=[{3: -0.5}],
                     finished=True, finish_reason="stop", stop_reason="END", num_prompt_tokens=4,
                     num_output_tokens=2, num_cached_tokens=0, num_computed_tokens=5)
    d = delta_to_proto(out)
    assert list(d.token_ids) == [3] and d.text == "a" and d.finish_reason == common_pb2.FINISH_REASON_STOP
    assert d.stop_reason == "END" and d.num_output_tokens == 2 and d.logprobs[0].candidates[0].token_id == 3
