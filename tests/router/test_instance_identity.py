"""The router routes nothing to an instance that serves another model or tokenizer than its own
(router/instances.py, "Identity"): `compare` field by field; a pool polling a real gRPC server on 127.0.0.1 whose
GetLoad the test sets (mismatched: out of rotation, logged, counted; fixed: back; an older worker's absent fields:
accepted, said once); engine/tokenizer.py's fingerprint; and real random:tiny workers in this process reporting
what a RouterCore over them checks (matching: ready; another --tokenizer or --served-model-name: not ready)."""
from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from prometheus_client import REGISTRY

from engine.tokenizer import synthetic_tokenizer, tokenizer_fingerprint
from protos.tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from router.instances import FIX_FLAGS, Expected, InstancePool, Mismatch, compare
from serving.metrics import Metrics
from serving.rpc import add_health_and_reflection, add_port, new_server, set_serving

FP = tokenizer_fingerprint(synthetic_tokenizer(512))
OURS = Expected(model="m", vocab_size=512, tokenizer_fingerprint=FP, max_model_len=1024)
DECODE = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name


def _load(**kw) -> common_pb2.InstanceLoad:
    base = dict(role="decode", model="m", vocab_size=512, tokenizer_fingerprint=FP, max_model_len=1024,
                block_size=16, num_total_blocks=64)
    return common_pb2.InstanceLoad(**{**base, **kw})


# ---- compare ---------------------------------------------------------------------------------------------------

def test_a_matching_report_has_no_mismatch():
    assert compare(OURS, _load()) == ([], [])


@pytest.mark.parametrize("field,theirs", [("model", "other"), ("vocab_size", 600),
                                          ("tokenizer_fingerprint", "v1:0123456789abcdef"), ("max_model_len", 512)])
def test_each_field_that_differs_is_a_mismatch_naming_the_flag(field, theirs):
    found, unreported = compare(OURS, _load(**{field: theirs}))
    assert found == [Mismatch(field, theirs, getattr(OURS, field))] and unreported == []
    text = str(found[0])
    assert f"its {field} is {theirs!r}, this router's {getattr(OURS, field)!r}" in text
    assert FIX_FLAGS[field] in text


def test_fields_an_older_instance_does_not_report_are_not_checked():
    assert compare(OURS, _load(vocab_size=0, tokenizer_fingerprint="")) == ([], ["vocab_size",
                                                                                "tokenizer_fingerprint"])
    # a fingerprint of another algorithm version cannot be compared: not reported, rather than different
    assert compare(OURS, _load(tokenizer_fingerprint="v2:0123")) == ([], ["tokenizer_fingerprint"])


def test_a_field_the_router_does_not_know_is_not_checked():
    assert compare(Expected(model="m"), _load(vocab_size=7, max_model_len=3, tokenizer_fingerprint="v1:x")) == ([], [])


def test_several_fields_differ_at_once():
    found, _ = compare(OURS, _load(model="x", tokenizer_fingerprint="v1:y"))
    assert [m.field for m in found] == ["model", "tokenizer_fingerprint"]


# ---- the fingerprint -------------------------------------------------------------------------------------------

def test_the_fingerprint_is_stable_across_loads_and_differs_for_another_tokenizer(tmp_path, other_tokenizer_dir):
    from engine.loader import load_tokenizer, resolve_model
    from engine.tokenizer import load_synthetic

    tiny = resolve_model("random:tiny")
    first, second = (tokenizer_fingerprint(load_tokenizer(tiny)) for _ in range(2))
    assert first == second and first.startswith("v1:") and len(first) == 19
    synthetic_tokenizer(tiny.config.vocab_size).save_pretrained(tmp_path)  # saved, then loaded as a worker would
    assert tokenizer_fingerprint(load_synthetic(tmp_path)) == first
    other = [tokenizer_fingerprint(load_tokenizer(tiny, str(other_tokenizer_dir))) for _ in range(2)]
    assert other[0] == other[1] != first
    assert tokenizer_fingerprint(synthetic_tokenizer(tiny.config.vocab_size + 1)) != first


# ---- a pool polling a real server -------------------------------------------------------------------------------

class _Decode(decode_pb2_grpc.DecodeServicer):
    """A decode instance that only answers GetLoad, with what the test put in `load`."""

    def __init__(self):
        self.load = _load()

    async def GetLoad(self, request, context):
        return self.load


def _gauge(state: str) -> float | None:
    return REGISTRY.get_sample_value("tandem:router_instances", {"model_name": "identity", "role": "router",
                                                                 "instance_role": "decode", "state": state})


async def _serve_decode(fake) -> tuple[grpc.aio.Server, str]:
    """A started gRPC server on 127.0.0.1 serving `fake` as the Decode service (health SERVING), and its address."""
    server = new_server()
    decode_pb2_grpc.add_DecodeServicer_to_server(fake, server)
    hs = add_health_and_reflection(server, [DECODE])
    port = add_port(server, "127.0.0.1:0")
    await server.start()
    await set_serving(hs, [DECODE], True)
    return server, f"127.0.0.1:{port}"


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.ERROR and r.name == "tandem.router.instances"]


def test_a_mismatched_instance_leaves_the_rotation_until_it_matches_again(caplog):
    caplog.set_level(logging.INFO, logger="tandem.router.instances")

    async def go():
        fake = _Decode()
        server, address = await _serve_decode(fake)
        pool = InstancePool("decode", [address], poll_timeout_s=5.0, metrics=Metrics("identity", "router"),
                            expected=OURS)
        seen = {}
        try:
            await pool.poll_once()
            seen["matching"] = [i.address for i in pool.healthy()], _gauge("healthy"), _gauge("mismatched")
            fake.load = _load(tokenizer_fingerprint="v1:0123456789abcdef")
            await pool.poll_once()
            await pool.poll_once()  # the same difference: not said again
            inst = pool.instances[0]
            seen["mismatched"] = (pool.healthy(), pool.ordered(), inst.last_error, _gauge("healthy"),
                                  _gauge("unhealthy"), _gauge("mismatched"), len(_errors(caplog)))
            fake.load = _load(tokenizer_fingerprint="v1:0123456789abcdef", vocab_size=7)
            await pool.poll_once()  # another difference: said at once
            seen["two"] = len(_errors(caplog))
            fake.load = _load()  # the worker restarted with the right flags
            await pool.poll_once()
            seen["fixed"] = [i.address for i in pool.healthy()], _gauge("healthy"), _gauge("mismatched"), inst.mismatch
        finally:
            await pool.close()
            await server.stop(0)
        return address, seen

    address, seen = asyncio.run(go())
    assert seen["matching"] == ([address], 1, 0)
    healthy, ordered, last_error, up, down, mismatched, errors = seen["mismatched"]
    assert healthy == [] and ordered == [] and (up, down, mismatched) == (0, 0, 1) and errors == 1
    assert last_error.startswith("mismatched: its tokenizer_fingerprint is 'v1:0123456789abcdef'")
    error = _errors(caplog)[0]
    assert error.startswith(f"decode {address} serves another model or tokenizer than this router")
    assert f"its tokenizer_fingerprint is 'v1:0123456789abcdef', this router's {FP!r}" in error
    assert "--tokenizer" in error
    assert seen["two"] == 2 and "its vocab_size is 7" in _errors(caplog)[1]
    assert seen["fixed"] == ([address], 1, 0, "")
    assert f"decode {address} is up" in [r.getMessage() for r in caplog.records][-1]


def test_an_older_instance_that_reports_no_identity_is_used_and_said_once(caplog):
    caplog.set_level(logging.INFO, logger="tandem.router.instances")

    async def go():
        fake = _Decode()
        fake.load = _load(vocab_size=0, tokenizer_fingerprint="")
        server, address = await _serve_decode(fake)
        pool = InstancePool("decode", [address], poll_timeout_s=5.0, expected=OURS)
        try:
            await pool.poll_once()
            await pool.poll_once()
            return len(pool.healthy())
        finally:
            await pool.close()
            await server.stop(0)

    assert asyncio.run(go()) == 1
    said = [r.getMessage() for r in caplog.records if "does not report" in r.getMessage()]
    assert len(said) == 1 and "vocab_size, tokenizer_fingerprint" in said[0], said
    assert not _errors(caplog)


# ---- real workers ----------------------------------------------------------------------------------------------

ARGS = dict(model="random:tiny", device="cpu", num_gpu_blocks_override=32, max_model_len=256, block_size=16)


def test_real_workers_report_what_the_router_checks(other_tokenizer_dir, caplog):
    """A random:tiny prefill and decode worker (in this process, real gRPC): a RouterCore given the same model flags
    is ready; one given another --tokenizer routes to neither and is not; another --served-model-name or
    --max-model-len is said (a warning per instance) and the router is ready."""
    from decode_svc.core import DecodeCore
    from decode_svc.servicer import add_to_server
    from engine import EngineArgs, LLMEngine
    from prefill_svc.core import PrefillCore
    from prefill_svc.servicer import PrefillServicer
    from protos.tandem.v1 import prefill_pb2, prefill_pb2_grpc
    from router.core import RouterConfig, RouterCore

    caplog.set_level(logging.WARNING, logger="tandem.router.instances")
    prefill_service = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name

    async def go():
        pcore = PrefillCore(LLMEngine.from_engine_args(EngineArgs(**ARGS)), Metrics("random:tiny", "prefill"),
                            default_kv_timeout_s=5)
        dcore = DecodeCore(LLMEngine.from_engine_args(EngineArgs(**ARGS)), Metrics("random:tiny", "decode"))
        servers, addrs = [], []
        for core, service, register in [
                (pcore, prefill_service, lambda c, s: prefill_pb2_grpc.add_PrefillServicer_to_server(
                    PrefillServicer(c), s)),
                (dcore, DECODE, add_to_server)]:
            await core.start()
            server = new_server()
            register(core, server)
            hs = add_health_and_reflection(server, [service])
            addrs.append(f"127.0.0.1:{add_port(server, '127.0.0.1:0')}")
            await server.start()
            await set_serving(hs, [service], True)
            servers.append(server)
        load = await dcore.load()
        ready = {}
        try:
            for name, kw in [("same", {}), ("tokenizer", dict(tokenizer=str(other_tokenizer_dir))),
                             ("name", dict(served_model_name="another")), ("len", dict(max_model_len=128))]:
                router = await RouterCore.create(RouterConfig(
                    prefill_addrs=[addrs[0]], decode_addrs=[addrs[1]], model="random:tiny",
                    max_model_len=kw.pop("max_model_len", 256), poll_interval_s=3600, **kw))
                try:
                    b = router.backend
                    ready[name] = (router.ready(), [i.mismatch.split(" is ")[0] for i in
                                                    b.prefill.instances + b.decode.instances])
                finally:
                    await router.close()
        finally:
            for server in servers:
                await server.stop(0)
            await pcore.close()
            await dcore.close()
        return load, ready

    load, ready = asyncio.run(go())
    assert load.vocab_size == 512 and load.max_model_len == 256 and load.model == "random:tiny"
    assert load.tokenizer_fingerprint == FP  # random:tiny's synthetic tokenizer, as built here
    assert ready["same"] == (True, ["", ""])
    assert ready["tokenizer"] == (False, ["its tokenizer_fingerprint"] * 2)
    assert ready["name"] == (True, ["", ""])
    assert ready["len"] == (True, ["", ""])
    assert len(_errors(caplog)) == 2
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "differs from" in r.getMessage()]
    assert len(said) == 4 and sum("its model is 'random:tiny', this router's 'another'" in m for m in said) == 2
    assert sum("its max_model_len is 256, this router's 128" in m for m in said) == 2
