"""The decode service: reserves blocks for prompts, receives their KV from prefill instances and decodes them in one
continuous batch.

May import: engine/, serving/, kv_transfer/, protos/. Never prefill_svc/, router/ or cli/.
"""
