"""Tandem's gRPC protocol: the .proto files under protos/tandem/v1/ and their committed stubs (see protos/build.py)."""
