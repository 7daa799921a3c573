"""kv_transfer/receiver.py on its own: an incoming transfer over an in-memory `Reservations` (no gRPC, no decode
service), on a CPU cache. The open may come before its reservation; block runs are checked against the reservation;
the commit needs every block; the transfer's KvPoll states are seen in order, and a failure is counted by state."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from types import SimpleNamespace

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from kv_transfer.base import KvPoll
from kv_transfer.layout import block_rows, layout_of
from kv_transfer.metrics import KvPathMetrics
from kv_transfer.receiver import IncomingTransfer, KvReceiver
from protos.tandem.v1 import kv_transfer_pb2 as kv
from serving.errors import ServiceError
from serving.metrics import Metrics

SHAPE = (8, 2, 2, 4, 2, 8)  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
MODEL = "fake-reservations"
B, W, T, S, F = KvPoll.BOOTSTRAPPING, KvPoll.WAITING, KvPoll.TRANSFERRING, KvPoll.SUCCESS, KvPoll.FAILED


@dataclass
class FakeReservation:
    num_prompt_tokens: int
    block_ids: list[int]
    num_reused: int = 0
    transfer_open: bool = False
    committed: bool = False


class FakeReservations:
    """Reservations in a dict; the engine thread's calls run at once on the loop (their futures already done)."""

    def __init__(self, kv_cache: torch.Tensor):
        self.kv_cache = kv_cache
        self.reqs: dict[str, FakeReservation] = {}
        self.arrivals: dict[str, asyncio.Future] = {}
        self.written: list[list[int]] = []
        self.commits: list[tuple[str, int]] = []
        self.failures: list[tuple[str, ServiceError]] = []

    def reserve(self, rid: str, num_prompt_tokens: int, block_ids: list[int], num_reused: int = 0) -> None:
        self.reqs[rid] = FakeReservation(num_prompt_tokens, block_ids, num_reused)
        if rid in self.arrivals:
            self.arrivals.pop(rid).set_result(None)

    async def reservation(self, rid: str) -> FakeReservation | None:
        if rid not in self.reqs:
            self.arrivals[rid] = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(self.arrivals[rid], 2.0)
            except TimeoutError:
                return None
        return self.reqs[rid]

    def is_live(self, rid: str, r: FakeReservation) -> bool:
        return self.reqs.get(rid) is r

    def _done(self, fn) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        try:
            fut.set_result(fn())
        except Exception as exc:  # noqa: BLE001
            fut.set_exception(exc)
        return fut

    def write(self, rid: str, fn) -> asyncio.Future:
        def run():
            before = self.kv_cache.clone()
            fn(self.kv_cache)
            changed = (block_rows(self.kv_cache) != block_rows(before)).any(dim=1).nonzero().flatten().tolist()
            self.written.append(changed)
        return self._done(run)

    def commit(self, rid: str, first_token_id: int, before) -> asyncio.Future:
        def run():
            before()
            self.commits.append((rid, first_token_id))
            return SimpleNamespace(finished=False)
        return self._done(run)

    async def on_engine(self, fn):
        return fn(self.kv_cache)

    def committed(self, r: FakeReservation, out) -> None:
        r.committed = True

    def failed(self, rid: str, err: Exception) -> None:
        self.failures.append((rid, err))


def setup(seed: int = 0):
    cache = torch.zeros(SHAPE, dtype=torch.bfloat16)
    book = FakeReservations(cache)
    receiver = KvReceiver(cache, book, KvPathMetrics(Metrics(MODEL, "decode"), MODEL, "decode"))
    data = torch.randint(0, 256, (4, layout_of(cache).block_bytes), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))
    return cache, book, receiver, data


def open_msg(layout, rid="r", num_prompt_tokens=12, num_blocks=3) -> kv.KvTransferMessage:
    return kv.KvTransferMessage(open=kv.KvTransferOpen(request_id=rid, layout=layout,
                                                      num_prompt_tokens=num_prompt_tokens, num_blocks=num_blocks))


def blocks_msg(first: int, rows: torch.Tensor) -> kv.KvTransferMessage:
    return kv.KvTransferMessage(blocks=kv.KvBlocks(first_block_index=first, num_blocks=rows.shape[0],
                                                   data=rows.numpy().tobytes()))


def commit_msg(token: int = 65) -> kv.KvTransferMessage:
    return kv.KvTransferMessage(commit=kv.KvTransferCommit(first_token_id=token))


async def stream(*msgs):
    for m in msgs:
        yield m


def failures(state: str) -> float:
    return REGISTRY.get_sample_value("tandem:kv_transfer_path_failures_total",
                                     {"model_name": MODEL, "role": "decode", "path": "grpc", "state": state}) or 0.0


def failing(receiver: KvReceiver, *msgs) -> tuple[ServiceError, object]:
    """The ServiceError a transfer of `msgs` fails with, and its TransferState."""
    async def main():
        t = IncomingTransfer(receiver)
        with pytest.raises(ServiceError) as ei:
            await t.run(stream(*msgs))
        return ei.value, t.state
    return asyncio.run(main())


def test_an_open_before_its_reservation_waits_and_lands_bit_exact():
    cache, book, receiver, data = setup()
    layout = receiver.layout

    async def main():
        t = IncomingTransfer(receiver)
        task = asyncio.create_task(t.run(stream(open_msg(layout), blocks_msg(1, data[1:3]), blocks_msg(0, data[:1]),
                                                commit_msg())))
        await asyncio.sleep(0.05)
        waiting = (t.state.state, task.done())
        book.reserve("r", 12, [6, 2, 3])
        return waiting, await task, t.state

    (state_before, done_before), ack, state = asyncio.run(main())
    assert state_before == B and not done_before  # the open waits for its reservation
    assert state.seen == [B, W, T, S] and state.request_id == "r"
    assert ack.request_id == "r" and ack.num_blocks == 3 and ack.received_bytes == 3 * layout.block_bytes
    assert ack.path == kv.KV_TRANSFER_PATH_GRPC
    assert torch.equal(block_rows(cache)[[6, 2, 3]], data[:3]) and book.commits == [("r", 65)]
    assert book.reqs["r"].committed and not book.failures


def test_a_reused_prefix_is_skipped():
    cache, book, receiver, data = setup(1)
    book.reserve("r", 12, [5, 1, 7], num_reused=2)
    ack = asyncio.run(receiver.transfer(stream(open_msg(receiver.layout), blocks_msg(0, data[:3]), commit_msg())))
    assert ack.received_bytes == 3 * receiver.layout.block_bytes  # every block arrived and is counted
    assert book.written == [[7]] and torch.equal(block_rows(cache)[7], data[2])  # only the third was written
    assert not block_rows(cache)[[5, 1]].any()


def test_a_run_outside_the_reservation_is_invalid_and_names_the_field():
    _, book, receiver, data = setup()
    book.reserve("r", 12, [0, 1, 2])
    before = failures("waiting")
    err, state = failing(receiver, open_msg(receiver.layout), blocks_msg(2, data[:2]), commit_msg())
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.message == "blocks.first_block_index=2, 2 blocks: must lie within the 3 reserved blocks"
    assert state.seen == [B, W, F]
    assert book.failures == [("r", err)] and not book.written and not book.commits
    assert failures("waiting") == before + 1


def test_a_commit_with_a_missing_block_fails():
    _, book, receiver, data = setup()
    book.reserve("r", 12, [0, 1, 2])
    before = failures("transferring")
    err, state = failing(receiver, open_msg(receiver.layout), blocks_msg(0, data[:1]), blocks_msg(2, data[2:3]),
                         commit_msg())
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.message == "commit: 1 of 3 blocks never arrived"
    assert state.seen == [B, W, T, F]
    assert book.failures == [("r", err)] and not book.commits and not book.reqs["r"].committed
    assert failures("transferring") == before + 1


def test_no_reservation_is_not_found_and_a_second_open_already_exists():
    _, book, receiver, data = setup()

    async def main():
        t = IncomingTransfer(receiver)
        with pytest.raises(ServiceError) as missing:
            await t.run(stream(open_msg(receiver.layout, rid="none")))
        book.reserve("r", 12, [0, 1, 2])
        book.reqs["r"].transfer_open = True
        with pytest.raises(ServiceError) as twice:
            await receiver.transfer(stream(open_msg(receiver.layout)))
        return missing.value, twice.value, t.state

    missing, twice, state = asyncio.run(main())
    assert missing.code == grpc.StatusCode.NOT_FOUND and missing.message.startswith(
        "open.request_id='none': no reservation here")
    assert twice.code == grpc.StatusCode.ALREADY_EXISTS
    assert state.seen == [B, F] and not book.failures  # (the Decode call was never this transfer's to fail)


@pytest.mark.parametrize("rid", ["", "i" * 5000])
def test_an_empty_or_long_open_request_id_is_invalid_at_once(rid):
    _, book, receiver, _ = setup()
    err, state = failing(receiver, open_msg(receiver.layout, rid=rid))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.message == f"open.request_id: {len(rid)} characters, must be 1 to 256"
    assert state.seen == [B, F] and not book.arrivals  # refused before it waited for (or logged) any reservation


def test_the_handshake_quotes_a_peers_strings_in_short(caplog):
    """A hostile peer's host name of a million lines was one log line per line, and its layout field went back
    whole in the answer (and in the log)."""
    _, _, receiver, _ = setup()
    layout = kv.KvLayout()
    layout.CopyFrom(receiver.layout)
    layout.layout = "x" * 5_000_000
    req = kv.KvHandshakeRequest(host=kv.HostIdentity(hostname="a\n" * 1_000_000, pid=7), layout=layout)
    with caplog.at_level(logging.INFO, logger="tandem.decode.kv"), pytest.raises(ServiceError) as ei:
        asyncio.run(receiver.handshake(req))
    assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert ei.value.message.startswith("layout.layout='xxx") and len(ei.value.message) < 400, ei.value.message[:500]
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("kv handshake from prefill pid 7 on 'a\\na\\n") and "\n" not in line and len(line) < 400
