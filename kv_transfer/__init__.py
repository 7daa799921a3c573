"""Moving a prompt's KV blocks from a prefill instance to a decode instance, for both sides and every transport.

Both services use it and neither owns it (vLLM's distributed/kv_transfer/, SGLang's disaggregation/): the block
layout both sides agree on (`layout`), the sending side (`sender`), the CUDA IPC transport (`cuda_ipc`), and the
transfer metrics by path (`metrics`).

May import: engine/ (for nothing but types), serving/, protos/, torch. Never a service (prefill_svc/, decode_svc/,
router/) or cli/.
"""
