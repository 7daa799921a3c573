"""The router: the OpenAI HTTP front and the public gRPC API over one RouterCore, which validates, tokenizes and fans
out each request and serves every sub-request through a backend (disaggregated prefill + decode instances, or one
colocated engine in this process).

May import: engine/, serving/, protos/. Never prefill_svc/, decode_svc/, kv_transfer/ or cli/.
"""
