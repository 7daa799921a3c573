"""The process around one worker role (prefill or decode): flags, engine, gRPC server, health, metrics, signals.

Each role's server.py names its core, servicer and defaults; the life of a request is told in that role's core.py.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import uvloop

from engine.args import EngineArgs, add_engine_args
from engine.config import DeviceConfig
from serving.config import KvTransferConfig, WorkerConfig
from serving.logs import add_log_args, configure as configure_logging
from serving.metrics import Metrics, add_metrics_args, set_prefix, start_metrics_server
from serving.rpc import add_health_and_reflection, add_port, new_server, set_serving
from serving.tls import TlsConfig, add_tls_args
from serving.tracing import add_tracing_args, setup_tracing


@dataclass
class WorkerRole:
    name: str  # "prefill" | "decode"
    service_name: str  # the tandem.v1 service's full name, for health checks
    default_port: int
    kv_timeout_help: str
    make_core: Callable  # (engine, Metrics, kv_timeout_s, **core_kwargs) -> core with async start() / close()
    add_servicer: Callable  # (core, grpc.aio.Server) -> None
    add_args: Callable[[argparse.ArgumentParser], None] | None = None  # the role's own flags
    core_kwargs: Callable[[argparse.Namespace], dict] | None = None  # those flags -> make_core keyword arguments
    decodes: bool = True  # False (prefill): every engine request ends at its first token, no decode step runs
    cpu_max_num_batched_tokens: int | None = None  # on the CPU, without --max-num-batched-tokens (None: the engine's)


def build_parser(role: WorkerRole, prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog or f"tandem {role.name}", description=f"Run one {role.name} instance.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=role.default_port, help="gRPC port")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics HTTP port (0: off)")
    add_metrics_args(p)
    p.add_argument("--kv-transfer-timeout", type=float, default=KvTransferConfig.timeout_s,
                   help=f"{role.kv_timeout_help} (default: {KvTransferConfig.timeout_s:g})")
    p.add_argument("--max-kv-transfer-timeout", type=float, default=KvTransferConfig.max_timeout_s,
                   help="the longest KV transfer deadline a caller may ask for, seconds: a reservation holds its "
                        f"blocks until then (default: {KvTransferConfig.max_timeout_s:g})")
    p.add_argument("--shutdown-grace", type=float, default=WorkerConfig.shutdown_grace_s,
                   help=f"on SIGTERM/SIGINT: seconds the requests in flight get to finish, with health NOT_SERVING "
                        f"so routers send no new ones (default: {WorkerConfig.shutdown_grace_s:g})")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    add_log_args(p)
    add_tracing_args(p)
    add_tls_args(p)
    if role.add_args is not None:
        role.add_args(p)
    add_engine_args(p)
    return p


def engine_args(role: WorkerRole, ns: argparse.Namespace) -> EngineArgs:
    """The engine flags of `ns`, with `role`'s own defaults where a flag was not given."""
    args = EngineArgs.from_cli_args(ns)
    on_cpu = DeviceConfig(device=args.device).device == "cpu"
    if args.max_num_batched_tokens is None and on_cpu and role.cpu_max_num_batched_tokens is not None:
        args = replace(args, max_num_batched_tokens=role.cpu_max_num_batched_tokens)
    return args


async def serve(role: WorkerRole, engine, host: str, port: int, kv_timeout_s: float,
                stop: asyncio.Event | None = None,
                shutdown_grace_s: float = WorkerConfig.shutdown_grace_s, tls: TlsConfig | None = None) -> None:
    """Serves `role` on host:port (mutual TLS with `tls`: only clients whose certificate our CA signed) until stop
    is set or SIGINT/SIGTERM, then drains."""
    log = logging.getLogger(f"tandem.{role.name}")
    metrics = Metrics(engine.model_name, role.name)
    metrics.observe_cache_config(engine.config.cache, engine.kv.num_blocks)
    core = role.make_core(engine, metrics, kv_timeout_s)
    await core.start()
    server = new_server()
    role.add_servicer(core, server)
    hs = add_health_and_reflection(server, [role.service_name])
    add_port(server, f"{host}:{port}", tls)
    await server.start()
    await set_serving(hs, [role.service_name], True)
    log.info("%s serving %s on %s:%d (%s)", role.name, engine.model_name, host, port,
             "mutual TLS" if tls else "plaintext")
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await set_serving(hs, [role.service_name], False)
    await drain(core, shutdown_grace_s, log)
    await server.stop(grace=1.0)
    await core.close()


async def drain(core, grace_s: float, log, poll_s: float = 0.05) -> None:
    """A stopping worker keeps serving what it tracks (streams, reservations whose KV is still to come) until none is
    left or grace_s runs out. Its health already says NOT_SERVING: routers stop picking it at their next poll (1 s),
    and a request that still arrives is served like the others. Then the gRPC server stops."""
    deadline = asyncio.get_running_loop().time() + grace_s
    left = (await core.load()).num_tracked_requests
    if left:
        log.info("draining: %d request(s) in flight, up to %.0f s", left, grace_s)
    while left and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(poll_s)
        left = (await core.load()).num_tracked_requests
    if left:
        log.warning("drain: %d request(s) still in flight after %.0f s: cancelling them", left, grace_s)


def main(role: WorkerRole, argv: list[str] | None = None) -> int:
    parser = build_parser(role)
    ns = parser.parse_args(argv)
    try:
        tls = TlsConfig.from_cli_args(ns)
        set_prefix(ns.metrics_prefix)
    except ValueError as e:
        parser.error(str(e))
    if not 0 < ns.kv_transfer_timeout <= ns.max_kv_transfer_timeout:
        parser.error(f"--kv-transfer-timeout={ns.kv_transfer_timeout:g}: must be > 0 and at most "
                     f"--max-kv-transfer-timeout={ns.max_kv_transfer_timeout:g}")
    try:
        kwargs = {"max_kv_timeout_s": ns.max_kv_transfer_timeout, **(role.core_kwargs(ns) if role.core_kwargs else {})}
    except ValueError as e:  # a role flag's value (it names the flag)
        parser.error(str(e))
    role = replace(role, make_core=partial(role.make_core, **kwargs))
    configure_logging(role.name, ns.log_level, ns.log_format)
    if ns.node_rank > 0:  # another host's share of node 0's tensor-parallel ranks: it serves nothing itself
        from engine.tp_node import run_node

        try:
            return run_node(engine_args(role, ns).create_engine_config())
        except ValueError as e:
            print(f"tandem {role.name}: {e}", file=sys.stderr)
            return 1
    setup_tracing(role.name, ns.otlp_traces_endpoint)
    from engine import LLMEngine

    # A prefill worker's decode CUDA graphs would never replay: it captures only the prompt steps' graphs.
    try:
        engine = LLMEngine.from_engine_args(engine_args(role, ns), decode_graphs=role.decodes)
    except ValueError as e:  # what only loading tells: the checkpoint's format, the device, the memory
        print(f"tandem {role.name}: {e}", file=sys.stderr)
        return 1
    start_metrics_server(ns.metrics_port, ns.host)
    uvloop.run(serve(role, engine, ns.host, ns.port, ns.kv_transfer_timeout, shutdown_grace_s=ns.shutdown_grace,
                     tls=tls))
    return 0
