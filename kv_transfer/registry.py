"""The transports by their protobuf KvTransferPath: a new transport is a new module and one line here."""
from __future__ import annotations

from kv_transfer import cuda_ipc, grpc_bytes, nixl
from kv_transfer.base import AUTO, Transport

TRANSPORTS: dict[int, Transport] = {t.path: t for t in (grpc_bytes.TRANSPORT, cuda_ipc.TRANSPORT, nixl.TRANSPORT)}
PATH_LABELS = {path: t.label for path, t in TRANSPORTS.items()}  # the metrics' `path` label
CHOICES = (AUTO, *PATH_LABELS.values())  # --kv-transfer values
