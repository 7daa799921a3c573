"""What every Tandem process shares, and no one service owns: the engine thread (`engine_thread`), what both worker
cores do alike (`worker_core`: start, close, GetLoad, the checks of what callers send), the worker process around a
role (`worker`: flags, gRPC server, health, metrics server, signals, drain), gRPC servers and channels (`rpc`:
keepalive, `add_service`), TLS (`tls`), the router's API key (`auth`), errors -> status codes in one place
(`errors`), protobuf <-> core conversions (`convert`), the grpc.health.v1 codec (`health`), Prometheus metrics
(`metrics`), request timelines (`hops`) and the defaults the router and the workers share (`config`).

May import: engine/, protos/ and third-party libraries. Never a service (prefill_svc/, decode_svc/, router/),
kv_transfer/ or cli/: those sit above it.
"""
