"""The bytes of block runs on the GRPC path (kv_transfer/grpc_bytes.py): the hand-written KvBlocks encoding is
protobuf's, byte for byte; the receiver's parser agrees with protobuf's on every input (or hands it to protobuf); the
round trip cache -> bytes -> cache is bit-exact, contiguous or scattered, on the CPU and (where present) on CUDA."""
from __future__ import annotations

import pytest
import torch

from kv_transfer.grpc_bytes import (MAX_DIRECT_RUNS, ReceivedBlocks, encode_blocks, parse_transfer_message,
                                    stage_blocks, write_blocks)
from kv_transfer.layout import block_rows, id_runs
from protos.tandem.v1 import kv_transfer_pb2 as kv

SHAPE = (40, 2, 2, 4, 2, 8)  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def cache(device: str, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype).to(device)


def proto_bytes(first: int, n: int, data: bytes) -> bytes:
    msg = kv.KvTransferMessage(blocks=kv.KvBlocks(first_block_index=first, num_blocks=n, data=data))
    return msg.SerializeToString()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ids", [[4], [4, 5, 6], [9, 3, 4, 30], list(range(20, 0, -2))])  # the last: > MAX_DIRECT_RUNS
@pytest.mark.parametrize("first", [0, 1, 127, 128, 300_000])
def test_encoding_is_protobufs_and_round_trips_bit_exact(device, ids, first):
    src = cache(device)
    wire = encode_blocks(first, len(ids), stage_blocks(src, ids))
    payload = block_rows(src)[ids].cpu().numpy().tobytes()
    assert wire == proto_bytes(first, len(ids), payload)
    got = parse_transfer_message(wire)
    assert isinstance(got, ReceivedBlocks) and isinstance(got.data, memoryview)  # a view of the message: no copy
    assert (got.first_block_index, got.num_blocks, bytes(got.data)) == (first, len(ids), payload)
    dst = torch.zeros_like(src)
    targets = [39 - i for i in ids]  # other positions, runs reversed
    write_blocks(dst, targets, got.data)
    assert torch.equal(dst[targets].view(torch.uint8), src[ids].view(torch.uint8))
    untouched = [i for i in range(SHAPE[0]) if i not in targets]
    assert not dst[untouched].view(torch.uint8).any()


def test_scattered_runs_take_the_gather_path():
    assert len(id_runs(list(range(20, 0, -2)))) > MAX_DIRECT_RUNS


def test_a_cpu_cache_is_staged_without_a_copy():
    src = cache("cpu")
    staged = stage_blocks(src, [3, 4, 8])
    assert staged.copied is None and [p.data_ptr() for p in staged.parts] == [
        block_rows(src)[3].data_ptr(), block_rows(src)[8].data_ptr()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float8_e4m3fn])
def test_every_cache_dtype_round_trips(dtype):
    src = cache("cpu", dtype)
    got = parse_transfer_message(encode_blocks(2, 2, stage_blocks(src, [0, 5])))
    dst = torch.zeros_like(src)
    write_blocks(dst, [1, 2], got.data)
    assert torch.equal(dst[[1, 2]].view(torch.uint8), src[[0, 5]].view(torch.uint8))


@pytest.mark.parametrize("msg", [
    kv.KvTransferMessage(open=kv.KvTransferOpen(request_id="r", num_blocks=3)),
    kv.KvTransferMessage(commit=kv.KvTransferCommit(first_token_id=7)),
    kv.KvTransferMessage(ready=kv.KvBlocksReady(first_block_index=1, block_ids=[4, 5])),
    kv.KvTransferMessage(),
])
def test_other_messages_go_through_protobuf(msg):
    got = parse_transfer_message(msg.SerializeToString())
    assert isinstance(got, kv.KvTransferMessage) and got == msg


def _field(key: int, value: int | bytes) -> bytes:
    def varint(n):
        out = bytearray()
        while n > 0x7F:
            out.append(n & 0x7F | 0x80)
            n >>= 7
        return bytes(out + bytes([n]))
    return bytes([key]) + (varint(len(value)) + value if isinstance(value, bytes) else varint(value))


def _message(inner: bytes) -> bytes:
    return _field(0x12, inner)


@pytest.mark.parametrize("inner", [
    _field(0x1A, b"abcd") + _field(0x10, 2) + _field(0x08, 5),  # fields out of order
    _field(0x08, 5) + _field(0x08, 6) + _field(0x1A, b"abcd"),  # a repeated scalar: the last one wins
    _field(0x1A, b"ab") + _field(0x1A, b"cd"),  # a repeated bytes field: the last one wins
    _field(0x08, 5) + _field(0x20, 9) + _field(0x1A, b"abcd"),  # an unknown field
    _field(0x08, 1 << 33) + _field(0x1A, b"abcd"),  # a varint past 32 bits (uint32 keeps the low bits)
    _field(0x10, 2),  # no data
    b"",  # an empty KvBlocks
])
def test_the_parser_agrees_with_protobuf_on_any_encoding(inner):
    raw = _message(inner)
    expected = kv.KvTransferMessage.FromString(raw).blocks
    got = parse_transfer_message(raw)
    blocks = got if isinstance(got, ReceivedBlocks) else ReceivedBlocks.of(got.blocks)
    assert (blocks.first_block_index, blocks.num_blocks, bytes(blocks.data)) == (
        expected.first_block_index, expected.num_blocks, expected.data)


@pytest.mark.parametrize("raw", [
    _message(_field(0x1A, b"abcd"))[:-1],  # truncated payload
    b"\x12\x80",  # truncated length
    _message(_field(0x1A, b"abcd")) + b"\x12",  # a second, truncated field after the message
])
def test_a_broken_message_fails_as_protobuf_fails(raw):
    with pytest.raises(Exception, match="(?i)pars|decod|truncat"):
        parse_transfer_message(raw)
