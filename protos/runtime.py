"""What every Tandem gRPC process shares: message-size limits, health and reflection, the mapping of errors to
status codes (the one place where that happens), and the protobuf <-> core conversions.

Servicers stay thin: each method is wrapped by `grpc_method`, which turns a `ServiceError`, a `ValueError` (bad
input: the message names the field) or anything else into `context.abort(code, message)`.
"""
from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Iterable
from typing import Any

import grpc

from protos import health as health_codec
from protos.tandem.v1 import common_pb2

try:  # optional: the GPU image has grpcio only (see protos/health.py)
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
except ImportError:  # pragma: no cover - depends on the machine
    health = None
try:
    from grpc_reflection.v1alpha import reflection
except ImportError:  # pragma: no cover
    reflection = None

log = logging.getLogger("tandem.rpc")

# A KV transfer message carries about 1 MiB of payload but at least one block (prefill_svc/kv_sender.py); the limits
# leave room for very large blocks and for the public API's long prompts. The HTTP/2 settings stay gRPC's defaults:
# on loopback, a larger max frame size, initial window (lookahead_bytes, BDP probing off) or TCP read chunk made no
# difference to the KV bytes path (bench/kv_transfer.py, 2-core dev machine).
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


class ServiceError(Exception):
    """An error that ends one RPC with a status code."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


# RequestError.code (router/core.py, shared with the HTTP front) -> gRPC status.
_CODE_NAMES = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "deadline_exceeded": grpc.StatusCode.DEADLINE_EXCEEDED,
    "cancelled": grpc.StatusCode.CANCELLED,
    "internal": grpc.StatusCode.INTERNAL,
}


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message that end an RPC which raised exc."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    code = getattr(exc, "code", None)
    if isinstance(code, str) and code in _CODE_NAMES:  # router.core.RequestError
        return _CODE_NAMES[code], str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, grpc.aio.AioRpcError):  # an upstream call failed: pass its status on
        return exc.code(), exc.details() or exc.code().name
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def grpc_method(fn):
    """Wraps an async servicer method (unary or server-streaming): errors end the RPC via `status_of`."""
    if inspect.isasyncgenfunction(fn):
        @functools.wraps(fn)
        async def stream(self, request, context):
            try:
                async for item in fn(self, request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - the one place errors become status codes
                code, msg = status_of(exc)
                if code == grpc.StatusCode.INTERNAL:
                    log.exception("%s failed", fn.__qualname__)
                await context.abort(code, msg)
        return stream

    @functools.wraps(fn)
    async def unary(self, request, context):
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            code, msg = status_of(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", fn.__qualname__)
            await context.abort(code, msg)
    return unary


def new_server() -> grpc.aio.Server:
    return grpc.aio.server(options=GRPC_OPTIONS)


def add_health_and_reflection(server: grpc.aio.Server, service_names: Iterable[str]):
    """Registers grpc.health.v1 (set each service and "" with `set_serving`) and server reflection. Without
    grpcio-health-checking a Check-only fallback serves health; without grpcio-reflection there is no reflection."""
    names = list(service_names)
    if health is not None:
        hs = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    else:
        hs = health_codec.HealthFallback()
        server.add_generic_rpc_handlers((hs.handler(),))
        log.warning("grpcio-health-checking is not installed: serving grpc.health.v1 Check only (no Watch)")
    if reflection is not None:
        reflection.enable_server_reflection(names + [health_codec.SERVICE, reflection.SERVICE_NAME], server)
    else:
        log.warning("grpcio-reflection is not installed: no server reflection")
    return hs


async def set_serving(hs, service_names: Iterable[str], serving: bool) -> None:
    status = health_codec.SERVING if serving else health_codec.NOT_SERVING
    if health is not None and not isinstance(hs, health_codec.HealthFallback):
        status = health_pb2.HealthCheckResponse.ServingStatus.Value("SERVING" if serving else "NOT_SERVING")
    for name in ["", *service_names]:
        await hs.set(name, status)


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)


# ---- conversions --------------------------------------------------------------------------------------------------
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
    kw.update(overrides)
    return SamplingParams(**kw)


def sampling_to_proto(params) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams()
    for f in _OPTIONAL_FIELDS:
        v = getattr(params, f, None)
        if v is not None:
            setattr(msg, f, v)
    msg.stop.extend(params.stop or [])
    msg.stop_token_ids.extend(params.stop_token_ids or [])
    return msg


def finish_to_proto(reason: str | None) -> int:
    return _FINISH.get(reason, common_pb2.FINISH_REASON_ABORT)


def finish_from_proto(value: int) -> str | None:
    return _FINISH_NAME.get(value)


def logprobs_to_proto(logprobs: list[dict[int, float]] | None, token_ids: list[int]) -> list:
    """One PositionLogprobs per token: the sampled token first, then the other candidates by logprob."""
    out = []
    for tok, lp in zip(token_ids, logprobs or []):
        pos = common_pb2.PositionLogprobs()
        if tok in lp:
            pos.candidates.add(token_id=tok, logprob=lp[tok])
        for t, v in sorted(lp.items(), key=lambda kv: -kv[1]):
            if t != tok:
                pos.candidates.add(token_id=t, logprob=v)
        out.append(pos)
    return out


def logprobs_from_proto(positions) -> list[dict[int, float]] | None:
    if not positions:
        return None
    return [{c.token_id: c.logprob for c in p.candidates} for p in positions]


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
