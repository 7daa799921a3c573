"""`tandem router`: one process, one uvloop event loop, serving the public gRPC API and the OpenAI HTTP API over a
single RouterCore.

1. Flags (and TANDEM_PREFILL_ADDRS / TANDEM_DECODE_ADDRS) say where the prefill and decode instances are: IP
   addresses, or DNS names that stand for every address they resolve to (serving/discovery.py).
2. The HTTP port is bound first, so a port in use fails fast with a clear message, before any instance is dialled.
3. `RouterCore.create` connects to the instances and starts polling their health (router/disaggregated.py);
   `/health` turns 200 once at least one prefill and one decode instance answer.
4. The gRPC server (router/grpc_server.py) and uvicorn (router/http.py's app) run side by side in this loop.
5. SIGTERM or SIGINT: the core drains (`RouterCore.drain`): health turns 503 and new requests are refused at once,
   the ones in flight get --shutdown-grace seconds to finish, then each ends with an error event and [DONE] (HTTP) or
   UNAVAILABLE (gRPC), never a cut-off body. The gRPC server stops accepting at once; HTTP keeps answering (503 with
   the reason) until the drain is over, then uvicorn waits for those last events; the core closes its channels.
   Exit status 0.

With --colocated there are no instances: the core runs over one engine of its own for both phases
(router/colocated.py), taking every engine flag (--dtype, --device, --kv-cache-memory, ...); without it, only the
model flags (--model, --tokenizer, --served-model-name, --max-model-len) apply and any other engine flag is refused.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from dataclasses import fields

import uvicorn
import uvloop

from engine.args import EngineArgs, add_engine_args
from router.admission import AdmissionConfig, add_admission_args
from router.core import RouterConfig, RouterLimits
from router.grpc_server import DEFAULT_MAX_MESSAGE_BYTES, MAX_MESSAGE_FLAG
from router.http import DEFAULT_MAX_REQUEST_BYTES
from router.instances import POLICIES
from router.tool_calls import ToolConfig
from router.tool_parsers import PARSERS
from serving.auth import ApiKey, add_api_key_args
from serving.config import WorkerConfig
from serving.discovery import DiscoveryConfig, add_discovery_args, split_host_port
from serving.metrics import add_metrics_args, set_prefix
from serving.logs import add_log_args, configure as configure_logging
from serving.rpc import RequestLimit
from serving.tls import TlsConfig, add_tls_args
from serving.tracing import add_tracing_args, setup_tracing

log = logging.getLogger("tandem.router")

# What uvicorn and the gRPC server wait beyond the drain, for the ended requests' last events to go out.
_CLOSE_MARGIN_S = 2.0

ENV_PREFILL = "TANDEM_PREFILL_ADDRS"
ENV_DECODE = "TANDEM_DECODE_ADDRS"


def add_router_args(p: argparse.ArgumentParser) -> None:
    """The router's flags that `tandem up` passes on too (declared once, here)."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind both APIs to (default: 127.0.0.1)")
    p.add_argument("--grpc-port", type=int, default=50051, help="public gRPC API port (default: 50051)")
    p.add_argument("--port", "--http-port", dest="http_port", type=int, default=8000,
                   help="OpenAI HTTP API port, vLLM's --port (--http-port: the same; default: 8000)")
    p.add_argument("--policy", choices=POLICIES, default=RouterConfig.policy,
                   help="how to pick instances: " + ", ".join(POLICIES) + " (router/instances.py; default: "
                        f"{RouterConfig.policy})")
    p.add_argument(MAX_MESSAGE_FLAG, type=int, default=DEFAULT_MAX_MESSAGE_BYTES,
                   help="gRPC request messages larger than this are refused, RESOURCE_EXHAUSTED (the workers' "
                        f"internal limit is larger: KV blocks; default: {DEFAULT_MAX_MESSAGE_BYTES})")
    add_admission_args(p)
    add_metrics_args(p)
    p.add_argument("--migration-limit", type=int, default=RouterConfig.migration_limit,
                   help="how many times one request may move to another instance when the one serving it fails "
                        "(its stream continues, token-exact, router/migration.py); past it the client gets the "
                        f"error; 0: never (default: {RouterConfig.migration_limit})")
    p.add_argument("--migration-timeout", type=float, default=RouterConfig.migration_timeout_s,
                   help="seconds a moving request may wait for a healthy decode instance to take it (default: "
                        f"{RouterConfig.migration_timeout_s:g})")
    p.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=ToolConfig.tool_call_parser,
                   help="the format of the model's tool calls, read when tool_choice is auto: hermes (Hermes, "
                        "Qwen2.5, Qwen3) or llama3_json (Llama 3.1/3.2) (docs/openai-api.md)")
    p.add_argument("--enable-auto-tool-choice", action="store_true", default=ToolConfig.enable_auto_tool_choice,
                   help="let the model decide whether to call a tool (tool_choice auto, the default when a request "
                        "has tools); needs --tool-call-parser")
    add_log_args(p)  # (every process's; `tandem up` passes them on to each)
    add_tracing_args(p)


# The router flags `tandem up` passes on only when they differ from their defaults (compose.yaml leaves them out):
# namespace attribute -> (flag, default).
OPTIONAL_ROUTER_FLAGS = {"migration_limit": ("--migration-limit", RouterConfig.migration_limit),
                         "migration_timeout": ("--migration-timeout", RouterConfig.migration_timeout_s),
                         "tool_call_parser": ("--tool-call-parser", ToolConfig.tool_call_parser),
                         "enable_auto_tool_choice": ("--enable-auto-tool-choice", ToolConfig.enable_auto_tool_choice)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem router", description=__doc__.split("\n\n")[0])
    add_router_args(p)
    p.add_argument("--prefill", default=None,
                   help=f"prefill instances, host:port[,host:port...]; a host that is a DNS name (a headless "
                        f"service) is one instance per address it resolves to (default: ${ENV_PREFILL})")
    p.add_argument("--decode", default=None,
                   help=f"decode instances, host:port[,host:port...], names as --prefill's (default: ${ENV_DECODE})")
    add_discovery_args(p)
    p.add_argument("--colocated", action="store_true",
                   help="no instances: run one engine in this process for prefill and decode alike (the "
                        "non-disaggregated baseline); every engine flag below then applies")
    p.add_argument("--shutdown-grace", type=float, default=WorkerConfig.shutdown_grace_s,
                   help="on SIGTERM/SIGINT: seconds open requests get to finish (new ones are refused and health "
                        "turns 503 at once); then each ends with an error event or status (default: "
                        f"{WorkerConfig.shutdown_grace_s:g}, as the workers')")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"HTTP request bodies larger than this are refused, 413 (default: {DEFAULT_MAX_REQUEST_BYTES})")
    p.add_argument("--max-prompt-bytes", type=int, default=RouterLimits.max_prompt_bytes,
                   help="text prompts (or chats) longer than this, in UTF-8 bytes, are refused before they are "
                        f"tokenized (default: {RouterLimits.max_prompt_bytes})")
    p.add_argument("--max-sub-requests", type=int, default=RouterLimits.max_sub_requests,
                   help="completions one request may ask for, its prompts times n "
                        f"(default: {RouterLimits.max_sub_requests})")
    add_tls_args(p)
    add_api_key_args(p)
    # --model and --tokenizer (for the tokenizer), --served-model-name and --max-model-len (must match the workers')
    # always apply.
    add_engine_args(p)
    return p


# The engine flags a router without --colocated uses: it tokenizes and checks lengths, it runs no model. `tandem up`
# passes these to the router (and every engine flag to the workers), so both tokenize with the same vocabulary.
MODEL_FLAGS = ("model", "tokenizer", "served_model_name", "max_model_len")


def engine_only_flags(ns: argparse.Namespace) -> list[str]:
    """The engine flags set to something else than their default, other than MODEL_FLAGS."""
    return ["--" + f.name.replace("_", "-") for f in fields(EngineArgs)
            if f.name not in MODEL_FLAGS and getattr(ns, f.name) != f.default]


def parse_addresses(value: str | None, env: str) -> list[str]:
    """host:port list from a flag, else from the environment; ValueError names the flag when it is malformed."""
    flag = "--" + ("prefill" if env == ENV_PREFILL else "decode")
    raw = value if value is not None else os.environ.get(env, "")
    addrs = [a.strip() for a in raw.split(",") if a.strip()]
    if not addrs:
        raise ValueError(f"{flag}: no instances given (pass {flag} host:port[,host:port...] or set ${env})")
    for a in addrs:
        split_host_port(a, flag)
    return addrs


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot bind the HTTP API to {host}:{port}: {e.strerror} (see --host, --port)") from None
    sock.set_inheritable(True)
    return sock


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: this process handles SIGTERM/SIGINT for both servers."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def serve(ns: argparse.Namespace, prefill: list[str], decode: list[str], tls: TlsConfig | None = None,
                api_key: ApiKey | None = None) -> None:
    from router.core import RouterCore
    from router.grpc_server import start_grpc_server
    from router.http import create_app

    limits = RouterLimits(max_sub_requests=ns.max_sub_requests, max_prompt_bytes=ns.max_prompt_bytes)
    tools = ToolConfig(ns.tool_call_parser, ns.enable_auto_tool_choice)
    admission = AdmissionConfig.from_cli_args(ns)
    http_sock = _bind(ns.host, ns.http_port)
    try:
        if ns.colocated:
            from router.colocated import ColocatedBackend

            core = RouterCore(await ColocatedBackend.from_engine_args(EngineArgs.from_cli_args(ns)), limits, admission)
            await core.start()
        else:
            core = await RouterCore.create(RouterConfig(
                prefill_addrs=prefill, decode_addrs=decode, policy=ns.policy, model=ns.model, tokenizer=ns.tokenizer,
                served_model_name=ns.served_model_name, max_model_len=ns.max_model_len, tls=tls,
                migration_limit=ns.migration_limit, migration_timeout_s=ns.migration_timeout,
                discovery=DiscoveryConfig.from_cli_args(ns)), limits, admission)
    except BaseException:
        http_sock.close()
        raise
    try:
        grpc_server = await start_grpc_server(core, f"{ns.host}:{ns.grpc_port}", tls, api_key,
                                              ns.max_grpc_message_bytes, tools)
        open_paths = [p.strip() for p in ns.api_key_open_paths.split(",") if p.strip()]
        # TLS on the public HTTP API with the process's certificate; clients are not asked for one.
        ssl = {} if tls is None else {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
        # uvicorn and the gRPC server wait a little longer than the core's drain: it ends what is left itself, with
        # an error event or status, before they would cut a response off.
        app = create_app(core, api_key, open_paths, ns.max_request_bytes, tools)
        # (log_config=None: uvicorn's records go through this process's handler, serving/logs.py)
        http = _Uvicorn(uvicorn.Config(app, lifespan="off", log_level=ns.log_level, log_config=None,
                                       access_log=False, timeout_graceful_shutdown=ns.shutdown_grace + _CLOSE_MARGIN_S,
                                       **ssl))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        http_task = asyncio.create_task(http.serve(sockets=[http_sock]))
        where = ("one colocated engine in this process" if ns.colocated else
                 f"prefill {','.join(prefill)}; decode {','.join(decode)}; policy {ns.policy}")
        log.info("router: OpenAI HTTP on %s://%s:%d, gRPC on %s:%d (%s, %s); %s", "https" if tls else "http",
                 ns.host, ns.http_port, ns.host, ns.grpc_port, "TLS" if tls else "plaintext",
                 "API key required" if api_key else "no API key", where)
        stop_task = asyncio.create_task(stop.wait())
        await asyncio.wait({http_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        log.info("router: shutting down")
        grpc_stopped = asyncio.create_task(grpc_server.stop(ns.shutdown_grace + _CLOSE_MARGIN_S))
        # HTTP keeps accepting while the core drains: probes and late clients get a 503 that says why, not a
        # refused connection; then uvicorn closes and waits for the ended streams' last events.
        await core.drain(ns.shutdown_grace)
        http.should_exit = True
        await asyncio.gather(http_task, grpc_stopped, return_exceptions=True)
        stop_task.cancel()
    finally:
        await core.close()
        http_sock.close()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    configure_logging("router", ns.log_level, ns.log_format)
    setup_tracing("router", ns.otlp_traces_endpoint)
    if ns.colocated:
        given = [flag for flag, value in (("--prefill", ns.prefill), ("--decode", ns.decode)) if value is not None]
        if given:
            parser.error(f"{' and '.join(given)}: --colocated runs its own engine and calls no instances; "
                         "leave them out")
        prefill, decode = [], []
    else:
        if extra := engine_only_flags(ns):
            parser.error(f"{', '.join(extra)}: engine flags, and this router runs no engine; they belong on the "
                         "prefill and decode workers (or add --colocated)")
        try:
            prefill = parse_addresses(ns.prefill, ENV_PREFILL)
            decode = parse_addresses(ns.decode, ENV_DECODE)
        except ValueError as e:
            parser.error(str(e))
    try:
        tls = TlsConfig.from_cli_args(ns)
        api_key = ApiKey.from_flag(ns.api_key)
        RequestLimit(ns.max_grpc_message_bytes, MAX_MESSAGE_FLAG)
        set_prefix(ns.metrics_prefix)
        RouterLimits(max_sub_requests=ns.max_sub_requests, max_prompt_bytes=ns.max_prompt_bytes)
        AdmissionConfig.from_cli_args(ns)  # (checked here: a bad value is a usage error)
        DiscoveryConfig.from_cli_args(ns)
        ToolConfig(ns.tool_call_parser, ns.enable_auto_tool_choice)
    except ValueError as e:
        parser.error(str(e))
    try:
        uvloop.run(serve(ns, prefill, decode, tls, api_key))
    except (OSError, ValueError) as e:  # a port taken, a host not ours, a config the model rejects
        if ns.log_format == "json":
            log.error("tandem router: %s", e)
        else:
            print(f"tandem router: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
