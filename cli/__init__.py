"""The `tandem` command: one console script for every role (`main`) and `tandem up`, the whole stack as local
processes (`up`).

May import anything below it: the services (router/, prefill_svc/, decode_svc/), serving/, kv_transfer/, engine/.
Nothing imports cli/.
"""
