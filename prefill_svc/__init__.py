"""The prefill service: computes prompts' KV and first tokens and streams the KV to decode instances.

May import: engine/, serving/, kv_transfer/, protos/. Never decode_svc/, router/ or cli/.
"""
