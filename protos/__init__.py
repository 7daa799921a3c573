"""Tandem's gRPC protocol, and nothing else: the .proto files under protos/tandem/v1/, their committed stubs and
protos/build.py, which regenerates them. Imports only protobuf and grpcio; what the processes do with the messages
lives in serving/, kv_transfer/ and the services.
"""
