"""Moving a prompt's KV blocks from a prefill instance to a decode instance, for both sides and every transport.

Both services use it and neither owns it (vLLM's distributed/kv_transfer/, SGLang's disaggregation/):
- `base`: the interfaces: the KvPoll states of a transfer, a transport's sending and receiving halves, and the
  Reservations the receiver is handed by the decode service;
- one module per transport: `grpc_bytes` (block bytes on the TransferKv stream), `cuda_ipc` (same host, GPU to GPU),
  `nixl` (decode READs the prefill's registered cache through NIXL; optional `nixl-cu12`, imported on first use);
  `registry` maps the protobuf KvTransferPath to its transport;
- `sender` (prefill: path negotiation, one request's outgoing transfer), `receiver` (decode: the handshake, one
  request's incoming transfer);
- `layout` (the block layout both sides agree on), `metrics` (transfer metrics by path).

May import: engine/ (for nothing but types and helpers), serving/, protos/, torch. Never a service (prefill_svc/,
decode_svc/, router/) or cli/.
"""
