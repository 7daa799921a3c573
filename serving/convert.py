"""protobuf <-> core conversions shared by the router and the workers: sampling parameters, finish reasons,
logprobs, token deltas."""
from __future__ import annotations

import asyncio
from typing import Any

from protos.tandem.v1 import common_pb2

_OPTIONAL_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "ignore_eos",
                    "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "skip_special_tokens",
                    "include_stop_str_in_output")
_FINISH = {None: common_pb2.FINISH_REASON_UNSPECIFIED, "stop": common_pb2.FINISH_REASON_STOP,
           "length": common_pb2.FINISH_REASON_LENGTH, "abort": common_pb2.FINISH_REASON_ABORT}
_FINISH_NAME = {v: k for k, v in _FINISH.items()}


def sampling_from_proto(msg: common_pb2.SamplingParams, **overrides: Any):
    """The engine's SamplingParams (validated: ValueError names the field) from the proto; unset fields keep the
    engine's defaults."""
    from engine.sampling_params import SamplingParams

    kw: dict[str, Any] = {f: getattr(msg, f) for f in _OPTIONAL_FIELDS if msg.HasField(f)}
    if msg.stop:
        kw["stop"] = list(msg.stop)
    if msg.stop_token_ids:
        kw["stop_token_ids"] = list(msg.stop_token_ids)
    if msg.HasField("structured_outputs"):
        kw["structured_outputs"] = structured_from_proto(msg.structured_outputs)
    kw.update(overrides)
    return SamplingParams(**kw)


async def sampling_from_proto_off_loop(msg: common_pb2.SamplingParams, **overrides: Any):
    """sampling_from_proto, on a worker thread when the params carry a constraint (checking one parses it: time
    that grows with its size, which the event loop must not spend)."""
    if msg.HasField("structured_outputs"):
        return await asyncio.to_thread(sampling_from_proto, msg, **overrides)
    return sampling_from_proto(msg, **overrides)


# StructuredOutputsParams' kinds <-> the oneof's fields
_SO_KINDS = {"json": "json_schema", "regex": "regex", "grammar": "grammar", "json_object": "json_object",
             "structural_tag": "structural_tag", "choice": "choice"}
_SO_FIELDS = {v: k for k, v in _SO_KINDS.items()}


def structured_from_proto(msg: common_pb2.StructuredOutputs):
    """The engine's StructuredOutputsParams (validated: ValueError names the field)."""
    from engine.sampling_params import StructuredOutputsParams

    which = msg.WhichOneof("kind")
    if which is None:
        raise ValueError("structured_outputs: exactly one of json_schema, regex, choice, grammar, json_object, "
                         "structural_tag must be set, got none")
    value = getattr(msg, which)
    if which == "choice":
        value = list(value.choices)
    return StructuredOutputsParams(
        **{_SO_FIELDS[which]: value}, disable_any_whitespace=msg.disable_any_whitespace,
        disable_additional_properties=msg.disable_additional_properties,
        whitespace_pattern=msg.whitespace_pattern if msg.HasField("whitespace_pattern") else None)


def structured_to_proto(so) -> common_pb2.StructuredOutputs:
    msg = common_pb2.StructuredOutputs(disable_any_whitespace=so.disable_any_whitespace,
                                       disable_additional_properties=so.disable_additional_properties)
    if so.whitespace_pattern is not None:
        msg.whitespace_pattern = so.whitespace_pattern
    kind = so.kind
    value = getattr(so, kind)
    if kind == "choice":
        msg.choice.choices.extend(value)
    else:  # (json is canonical JSON text once validated)
        setattr(msg, _SO_KINDS[kind], value)
    return msg


def sampling_to_proto(params) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams()
    for f in _OPTIONAL_FIELDS:
        v = getattr(params, f, None)
        if v is not None:
            setattr(msg, f, v)
    msg.stop.extend(params.stop or [])
    msg.stop_token_ids.extend(params.stop_token_ids or [])
    so = getattr(params, "structured_outputs", None)
    if so is not None:
        msg.structured_outputs.CopyFrom(structured_to_proto(so))
    return msg


def finish_to_proto(reason: str | None) -> int:
    return _FINISH.get(reason, common_pb2.FINISH_REASON_ABORT)


def finish_from_proto(value: int) -> str | None:
    return _FINISH_NAME.get(value)


def ordered_logprobs(logprobs: list[dict[int, float]] | None, token_ids: list[int]) -> list[dict[int, float]]:
    """One dict per token, in the order the wire carries it: the sampled token first, then the other candidates by
    logprob (the router's colocated engine gives its clients this order too)."""
    out = []
    for tok, lp in zip(token_ids, logprobs or []):
        pos = {tok: lp[tok]} if tok in lp else {}
        pos.update((t, v) for t, v in sorted(lp.items(), key=lambda kv: -kv[1]) if t != tok)
        out.append(pos)
    return out


def logprobs_to_proto(logprobs: list[dict[int, float]] | None, token_ids: list[int]) -> list:
    """One PositionLogprobs per token, candidates as `ordered_logprobs` orders them."""
    return [common_pb2.PositionLogprobs(candidates=[common_pb2.TokenLogprob(token_id=t, logprob=v)
                                                    for t, v in pos.items()])
            for pos in ordered_logprobs(logprobs, token_ids)]


def logprobs_from_proto(positions) -> list[dict[int, float]] | None:
    if not positions:
        return None
    return [{c.token_id: c.logprob for c in p.candidates} for p in positions]


def stop_reason_from_proto(text: str, params) -> int | str | None:
    """A TokenDelta's stop_reason (text) as the engine had it: a stop token id (int) when it is one of params'
    stop_token_ids and no stop string, else the stop string; "" is None (end of sequence or not stopped)."""
    if not text:
        return None
    if text not in (params.stop or ()) and text.isdigit() and int(text) in (params.stop_token_ids or ()):
        return int(text)
    return text


def delta_to_proto(out, token_ids: list[int] | None = None, text: str | None = None) -> common_pb2.TokenDelta:
    """A TokenDelta from an engine StepOutput (token_ids/text override its own, e.g. to drop a repeated token)."""
    toks = out.new_token_ids if token_ids is None else token_ids
    d = common_pb2.TokenDelta(token_ids=toks, text=out.new_text if text is None else text,
                              finish_reason=finish_to_proto(out.finish_reason) if out.finished else 0,
                              stop_reason="" if out.stop_reason is None else str(out.stop_reason),
                              num_output_tokens=out.num_output_tokens)
    if out.new_logprobs and toks:
        d.logprobs.extend(logprobs_to_proto(out.new_logprobs, toks))
    return d
