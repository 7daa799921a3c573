"""`tandem decode`: one decode instance (grpc.aio on uvloop) serving tandem.v1.Decode, grpc.health.v1 and
reflection on --host:--port, and Prometheus metrics on --metrics-port (HTTP GET /metrics; 0 = off).

The life of a request is told in decode_svc/core.py; the process around it in serving/worker.py.
"""
from __future__ import annotations

import argparse

from decode_svc.core import DecodeCore
from decode_svc.servicer import add_to_server
from protos.tandem.v1 import decode_pb2
from serving import worker

ROLE = worker.WorkerRole(
    name="decode",
    service_name=decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name,
    default_port=50071,
    kv_timeout_help="seconds from a reservation to its KV commit when the router gives no deadline",
    make_core=DecodeCore,
    add_servicer=add_to_server,
)


def build_parser(prog: str = "tandem decode") -> argparse.ArgumentParser:
    return worker.build_parser(ROLE, prog)


def main(argv: list[str] | None = None) -> int:
    return worker.main(ROLE, argv)


if __name__ == "__main__":
    raise SystemExit(main())
