"""What every Tandem process shares, and no one service owns: the engine thread (`engine_thread`), the worker
process around a role (`worker`: flags, gRPC server, health, metrics server, signals, drain), gRPC servers and
channels (`rpc`), errors -> status codes in one place (`errors`), protobuf <-> core conversions (`convert`), the
grpc.health.v1 codec (`health`), Prometheus metrics (`metrics`) and request timelines (`hops`).

May import: engine/, protos/ and third-party libraries. Never a service (prefill_svc/, decode_svc/, router/),
kv_transfer/ or cli/: those sit above it.
"""
