"""The tandem.v1.Prefill servicer: protobuf in, PrefillCore, protobuf out. Errors become status codes in
serving.errors.grpc_method; requests are parsed by serving.rpc.add_service (malformed: INVALID_ARGUMENT)."""
from __future__ import annotations

from prefill_svc.core import PrefillCore
from protos.tandem.v1 import prefill_pb2_grpc
from serving.errors import grpc_method


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, core: PrefillCore):
        self.core = core

    @grpc_method
    async def Prefill(self, request, context):
        timeout = request.kv_transfer_timeout_ms / 1000 if request.kv_transfer_timeout_ms else None
        async for resp in self.core.prefill(request.request_id, list(request.prompt_token_ids), request.params,
                                            request.decode_address, timeout,
                                            list(request.prior_output_token_ids)):
            yield resp

    @grpc_method
    async def GetLoad(self, request, context):
        return await self.core.load()
