"""`tandem prefill`: one prefill instance (grpc.aio on uvloop) serving tandem.v1.Prefill, grpc.health.v1 and
reflection on --host:--port, and Prometheus metrics on --metrics-port (HTTP GET /metrics; 0 = off).

The life of a request is told in prefill_svc/core.py; the process around it in serving/worker.py.
"""
from __future__ import annotations

import argparse

from engine.config import PREFILL_CPU_MAX_NUM_BATCHED_TOKENS
from kv_transfer.registry import CHOICES
from kv_transfer.sender import tensor_parallel_refusal
from prefill_svc.core import PrefillCore
from prefill_svc.servicer import PrefillServicer
from protos.tandem.v1 import prefill_pb2
from serving import worker
from serving.config import KvTransferConfig
from serving.discovery import DiscoveryConfig, add_discovery_args, split_host_port
from serving.rpc import add_service
from serving.tls import TlsConfig


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-transfer", choices=CHOICES, default=KvTransferConfig.transport,
                   help="how KV blocks reach decode instances: ipc = GPU to GPU through CUDA IPC (same host, a CUDA "
                        "cache on both sides), nixl = the decode instance READs the blocks through NIXL (the nixl-cu12 "
                        "package on both sides; trusted peers only: docs/operations.md), grpc = block bytes over the "
                        "TransferKv stream (any host), auto = ipc where the handshake with a decode instance allows "
                        "it, else nixl to another host when installed and the cache is on a GPU, else grpc (default: "
                        f"{KvTransferConfig.transport})")
    p.add_argument("--decode-allowlist", default=None, metavar="HOST:PORT[,...]",
                   help="the decode instances this prefill may send KV to (the router's --decode list; tandem up "
                        "passes it); a request naming another is refused before anything dials it; a host that is "
                        "a DNS name allows every address it resolves to (default: any)")
    add_discovery_args(p)


def _core_kwargs(ns: argparse.Namespace) -> dict:
    allow = None if ns.decode_allowlist is None else [a.strip() for a in ns.decode_allowlist.split(",") if a.strip()]
    for entry in allow or ():
        split_host_port(entry, "--decode-allowlist")
    if (reason := tensor_parallel_refusal(ns.kv_transfer, ns.tensor_parallel_size)) is not None:
        raise ValueError(reason)
    return {"kv_transfer": ns.kv_transfer, "tls": TlsConfig.from_cli_args(ns), "decode_allowlist": allow,
            "discovery": DiscoveryConfig.from_cli_args(ns)}


ROLE = worker.WorkerRole(
    name="prefill",
    service_name=prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name,
    default_port=50061,
    kv_timeout_help="seconds a KV transfer may take when the router gives no deadline",
    make_core=PrefillCore,
    add_servicer=lambda core, server: add_service(server, prefill_pb2.DESCRIPTOR.services_by_name["Prefill"],
                                                  PrefillServicer(core)),
    add_args=add_args,
    core_kwargs=_core_kwargs,
    decodes=False,
    cpu_max_num_batched_tokens=PREFILL_CPU_MAX_NUM_BATCHED_TOKENS,  # (engine/config.py says why)
)


def build_parser(prog: str = "tandem prefill") -> argparse.ArgumentParser:
    return worker.build_parser(ROLE, prog)


def main(argv: list[str] | None = None) -> int:
    return worker.main(ROLE, argv)


if __name__ == "__main__":
    raise SystemExit(main())
