"""`tandem prefill`: one prefill instance (grpc.aio on uvloop) serving tandem.v1.Prefill, grpc.health.v1 and
reflection on --host:--port, and Prometheus metrics on --metrics-port (HTTP GET /metrics; 0 = off).

The life of a request is told in prefill_svc/core.py.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal

import uvloop

from engine.args import EngineArgs, add_engine_args
from engine.metrics import Metrics, start_metrics_server
from prefill_svc.core import PrefillCore
from prefill_svc.servicer import PrefillServicer
from protos.runtime import add_health_and_reflection, new_server, set_serving
from protos.tandem.v1 import prefill_pb2, prefill_pb2_grpc

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name
log = logging.getLogger("tandem.prefill")


def build_parser(prog: str = "tandem prefill") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Run one prefill instance.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=50061, help="gRPC port")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics HTTP port (0: off)")
    p.add_argument("--kv-transfer-timeout", type=float, default=30.0,
                   help="seconds a KV transfer may take when the router gives no deadline")
    p.add_argument("--log-level", default="INFO")
    add_engine_args(p)
    return p


async def serve(engine, host: str, port: int, kv_timeout_s: float, stop: asyncio.Event | None = None) -> None:
    core = PrefillCore(engine, Metrics(engine.model_name, "prefill"), kv_timeout_s)
    await core.start()
    server = new_server()
    prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(core), server)
    hs = add_health_and_reflection(server, [SERVICE_NAME])
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await set_serving(hs, [SERVICE_NAME], True)
    log.info("prefill serving %s on %s:%d", engine.model_name, host, port)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await set_serving(hs, [SERVICE_NAME], False)
    await server.stop(grace=2.0)
    await core.close()


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(ns))
    start_metrics_server(ns.metrics_port, ns.host)
    uvloop.run(serve(engine, ns.host, ns.port, ns.kv_transfer_timeout))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
