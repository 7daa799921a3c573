"""Tensor parallelism driven by the engine (vLLM's multiproc executor, simplified): rank 0 is the engine process,
ranks 1..tp-1 are worker processes, each holding its shard of the model and of the KV cache (its own KV heads).
This module is a worker's side; rank 0's is engine/tp_executor.py (TPDriver), the collectives both run are
engine/collectives.py, and the runner in between knows only the link object it is handed.

Start-up. Rank 0's LLMEngine creates the TPDriver, which spawns the workers (multiprocessing "spawn"), each with one
socket pair to rank 0; then rank 0's ModelRunner builds its own shard while they build theirs
(engine/loader.build_model splits each layer as it loads). Each worker reports that it has built (or sends its
traceback and exits); once every rank has, they join one process group (NCCL on CUDA, rank r on cuda:base+r; gloo
on the CPU; a file rendezvous in a temp dir) and run the same collectives in the same order: the CUDA memory
profile (a forward), the all-reduce MIN of the KV blocks each rank's budget holds (so block ids mean the same on
every rank), the fp8 KV calibration (a forward, then the largest |K| and |V| over every rank), then, when rank 0 captures its
CUDA graphs, the same captures (it sends the call first).

A step. Rank 0 schedules and packs the step's inputs into two host buffers (ModelRunner.step_inputs), picks the path (a
prefill graph's key, the decode graphs, or eager) and sends header + buffers to every worker as one message over its
socket (packing and sending are a small part of a step: on the CPU a tp=2 step's extra time is gloo's collectives;
measured: bench/RESULTS.md). Every rank copies the same buffers to its device and runs the same forward; the
row-parallel linears all-reduce. Only rank 0 computes logits and samples. With async scheduling an input may be the
previous step's sampled token, still on rank 0's device: rank 0 broadcasts each step's sampled tokens over the group and
the workers keep them for the next step's inputs.

Ranks on several hosts (`--nnodes`, engine/tp_node.py starts a node's ranks): the group meets at node 0's TCP
rendezvous instead of a file, and rank 0 sends every message to every rank over a gloo control group
(collectives.send_message) rather than the pipes, which then only carry each local worker's start-up report.

Failures. A worker that dies breaks the group: rank 0 sees it when it sends the next step (the socket is closed),
or as an error inside a collective (gloo), and raises WorkerError (the engine does not swallow it as a bad batch);
the other workers are killed and every worker is reaped. A worker whose rank 0 is gone sees its socket close and
exits. A worker dying while rank 0 waits on the GPU for an NCCL collective is only seen when NCCL's watchdog times
out. Shutdown (LLMEngine.close; at interpreter exit the driver's own hook, which skips rank 0's graphs): every rank
destroys its CUDA graphs (NCCL will not destroy a communicator a live graph captured), rank 0 sends stop, all ranks
pass a barrier and destroy the group, the workers leave with os._exit (interpreter teardown with gloo's threads
winding down aborted a rank now and then: tests/engine/test_tp.py).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import sys
import traceback
from multiprocessing.connection import Connection

import numpy as np
import torch
import torch.distributed as dist

from engine.collectives import barrier, init_group, receive_message, receive_tokens
from engine.model_runner import ModelRunner, StepInputs, _offsets, warm_up_attention

_STEP, _CALL, _STOP = 1, 2, 3
# A message's int64 header: kind, then (steps) num_tokens, num_seqs, num_sampled, num_fill, max_blocks,
# max_query_len, max_seq_len, path kind, path tokens, path rows, share (rank 0 broadcasts the sampled tokens).
_HEADER = 12


def encode_step(step: StepInputs, path: tuple[int, int, int], share: bool) -> bytes:
    """A step's message: header, then the step's two host buffers as they are."""
    header = np.array([_STEP, step.num_tokens, step.num_seqs, step.num_sampled, step.num_fill, step.max_blocks,
                       step.max_query_len, step.max_seq_len, *path, int(share)], dtype=np.int64)
    return b"".join((header.data, step.i64.data, step.i32.data))


def encode_call(name: str, args: tuple) -> bytes:
    """A message that has every worker run runner.<name>(*args)."""
    return np.array([_CALL] + [0] * (_HEADER - 1), np.int64).tobytes() + pickle.dumps((name, args))


def encode_stop() -> bytes:
    return np.array([_STOP] + [0] * (_HEADER - 1), np.int64).tobytes()


def decode_step(buf: bytearray) -> tuple[StepInputs, tuple[int, int, int], bool]:
    h = np.frombuffer(buf, np.int64, _HEADER).tolist()
    step = StepInputs(np.empty(0, np.int64), np.empty(0, np.int32), *h[1:8])
    lengths64, lengths32 = step.lengths()
    n64, n32 = _offsets(lengths64, np.int64)[1], _offsets(lengths32, np.int32)[1]
    step.i64 = np.frombuffer(buf, np.int64, n64, 8 * _HEADER)
    step.i32 = np.frombuffer(buf, np.int32, n32, 8 * (_HEADER + n64))
    return step, (h[8], h[9], h[10]), bool(h[11])


class _WorkerLink:
    """A worker's side of ModelRunner's start-up: says it has built, then joins the group (and, with ranks on several
    hosts, the control group rank 0 sends its messages over)."""

    def __init__(self, rank: int, world: int, init_method: str, conn: Connection, nnodes: int = 1):
        self.rank, self.world, self.init_method, self.conn, self.nnodes = rank, world, init_method, conn, nnodes
        self.control = self.cpu_group = None

    def join_group(self, device: torch.device) -> None:
        self.conn.send(("built", ""))
        self.cpu_group = init_group(self.rank, self.world, device, self.init_method)
        self.control = self.cpu_group if self.nnodes > 1 else None


@torch.inference_mode()
def worker_step(runner: ModelRunner, step: StepInputs, path: tuple[int, int, int], share: bool,
                prev_tokens: torch.Tensor | None) -> torch.Tensor | None:
    """Runs rank 0's step on this rank's shard; returns the step's sampled tokens when rank 0 shares them (the next
    step's inputs may be some of them)."""
    runner.forward(runner.device_inputs(step, prev_tokens), path, logits=False)
    return receive_tokens(step.num_sampled, runner.device) if share else None


def _pipe_messages(conn: Connection):
    """Rank 0's messages over this worker's pipe (ranks on one host): (buffer, length), the buffer reused."""
    buf = bytearray(1 << 16)
    while True:
        try:
            n = conn.recv_bytes_into(buf)
        except mp.BufferTooShort as e:
            buf = bytearray(e.args[0])
            n = len(buf)
        yield buf, n


def _control_messages(group):
    """Rank 0's messages over the control group (ranks on several hosts)."""
    while True:
        buf = receive_message(group)
        yield buf, len(buf)


def _serve(runner: ModelRunner, messages) -> None:
    prev_tokens = None
    for buf, n in messages:
        kind = int(np.frombuffer(buf, np.int64, 1)[0])
        if kind == _STEP:
            step, path, share = decode_step(buf)
            prev_tokens = worker_step(runner, step, path, share, prev_tokens)
        elif kind == _CALL:
            name, args = pickle.loads(bytes(buf[8 * _HEADER: n]))
            getattr(runner, name)(*args)
        else:
            assert kind == _STOP, kind
            barrier(runner.device)
            return


def spawn_workers(ranks, config, resolved, eos_token_id, init_method: str, procs: list, conns: list) -> None:
    """Starts worker_main for each of `ranks` (multiprocessing "spawn", daemons), each with a pipe to this process,
    appending each process and this process's end of its pipe as it starts (so a failure midway leaves the started
    ones in the lists to be stopped)."""
    ctx = mp.get_context("spawn")
    for rank in ranks:
        ours, theirs = ctx.Pipe()
        p = ctx.Process(target=worker_main, name=f"tandem-tp-rank{rank}", daemon=True,
                        args=(rank, config, resolved, eos_token_id, init_method, theirs))
        p.start()
        theirs.close()  # the worker's end lives in the worker only: its death closes the socket
        conns.append(ours)
        procs.append(p)


def worker_main(rank: int, config, resolved, eos_token_id, init_method: str, conn: Connection) -> None:
    """A worker process: build the shard, serve rank 0's steps until told to stop (or rank 0 is gone)."""
    code = 0
    try:
        world = config.parallel.tensor_parallel_size
        if config.device.torch_device.type != "cuda":
            torch.set_num_threads(max(1, torch.get_num_threads() // config.parallel.ranks_per_node))
        link = _WorkerLink(rank, world, init_method, conn, config.parallel.nnodes)
        runner = ModelRunner(config, resolved, eos_token_id, rank=rank, link=link)
        if runner.device.type == "cuda":
            warm_up_attention(runner)
        _serve(runner, _pipe_messages(conn) if link.control is None else _control_messages(link.control))
        runner.release_cuda_graphs()  # before the group: NCCL waits for graphs that captured its collectives
        dist.destroy_process_group()
    except (EOFError, ConnectionError):  # rank 0 is gone (or killed us): nothing to report to
        code = 1
    except BaseException:  # noqa: BLE001 - reported to rank 0, then the process ends
        text = traceback.format_exc()
        print(f"tensor-parallel rank {rank}: {text}", file=sys.stderr, flush=True)
        try:
            conn.send(("error", text))
        except Exception:  # noqa: BLE001
            pass
        code = 1
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)

