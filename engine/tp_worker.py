"""Tensor parallelism driven by the engine (vLLM's multiproc executor, simplified): rank 0 is the engine process,
ranks 1..tp-1 are worker processes, each holding its shard of the model and of the KV cache (its own KV heads).

Start-up. Rank 0's ModelRunner spawns the workers (multiprocessing "spawn"), each with one socket pair to rank 0,
then builds its own shard while they build theirs (engine/loader.build_model splits each layer as it loads). Each
worker reports that it has built (or sends its traceback and exits); once every rank has, they join one process
group (NCCL on CUDA, rank r on cuda:base+r; gloo on the CPU; a file rendezvous in a temp dir) and run the same
collectives in the same order: the CUDA memory profile (a forward), the all-reduce MIN of the KV blocks each rank's
budget holds (so block ids mean the same on every rank), the fp8 KV calibration (a forward; each rank calibrates its
own heads), then, when rank 0 captures its CUDA graphs, the same captures (it sends the call first).

A step. Rank 0 schedules and packs the step's inputs into two host buffers (ModelRunner.step_inputs), picks the
path (a prefill graph's key, the decode graphs, or eager) and sends header + buffers to every worker as one
message over its socket (on a shared 2-core CPU, tp=2, decode batch 8: packing 7 us, sending 36 us median, 47 us
p90; the whole step 7.8 ms against 1.8 ms at tp=1, the rest being gloo's collectives). Every rank copies
the same buffers to its device and runs the same forward; the row-parallel linears all-reduce. Only rank 0
computes logits and samples. With async scheduling an input may be the previous step's sampled token, still on
rank 0's device: rank 0 broadcasts each step's sampled tokens over the group and the workers keep them for the
next step's inputs.

Failures. A worker that dies breaks the group: rank 0 sees it when it sends the next step (the socket is closed),
or as an error inside a collective (gloo), and raises WorkerError (the engine does not swallow it as a bad batch);
the other workers are killed and every worker is reaped. A worker whose rank 0 is gone sees its socket close and
exits. A worker dying while rank 0 waits on the GPU for an NCCL collective is only seen when NCCL's watchdog times
out. Shutdown (LLMEngine.close, also at interpreter exit): every rank destroys its CUDA graphs (NCCL will not destroy a
communicator a live graph captured), rank 0 sends stop, all ranks pass a barrier and destroy the group, the workers leave with os._exit (interpreter teardown with gloo's threads winding down aborted a rank
now and then: tests/engine/test_tp.py).
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from multiprocessing.connection import Connection, wait

import numpy as np
import torch
import torch.distributed as dist

from engine.config import DeviceConfig
from engine.model_runner import ModelRunner, StepInputs, _offsets, warm_up_attention

log = logging.getLogger(__name__)

_STEP, _CALL, _STOP = 1, 2, 3
# A message's int64 header: kind, then (steps) num_tokens, num_seqs, num_sampled, num_fill, max_blocks,
# max_query_len, max_seq_len, path kind, path tokens, path rows, share (rank 0 broadcasts the sampled tokens).
_HEADER = 12


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or the group broke: this engine cannot run another step."""


def _init_group(rank: int, world: int, device: torch.device, init_method: str) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world)


def _barrier(device: torch.device) -> None:
    """An all-reduce every rank waits for (dist.barrier on NCCL guesses the device)."""
    t = torch.zeros(1, device=device)
    dist.all_reduce(t)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def min_over_ranks(n: int, device: torch.device) -> int:
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def share_tokens(token_ids: torch.Tensor) -> None:
    """Rank 0: sends a step's sampled tokens [num_sampled] int64 to the workers (worker_step receives them)."""
    assert token_ids.dtype == torch.int64 and token_ids.is_contiguous(), (token_ids.dtype, token_ids.stride())
    dist.broadcast(token_ids, 0)


def encode_step(step: StepInputs, path: tuple[int, int, int], share: bool) -> bytes:
    header = np.array([_STEP, step.num_tokens, step.num_seqs, step.num_sampled, step.num_fill, step.max_blocks,
                       step.max_query_len, step.max_seq_len, *path, int(share)], dtype=np.int64)
    return b"".join((header.data, step.i64.data, step.i32.data))


def decode_step(buf: bytearray) -> tuple[StepInputs, tuple[int, int, int], bool]:
    h = np.frombuffer(buf, np.int64, _HEADER).tolist()
    step = StepInputs(np.empty(0, np.int64), np.empty(0, np.int32), *h[1:8])
    lengths64, lengths32 = step.lengths()
    n64, n32 = _offsets(lengths64, np.int64)[1], _offsets(lengths32, np.int32)[1]
    step.i64 = np.frombuffer(buf, np.int64, n64, 8 * _HEADER)
    step.i32 = np.frombuffer(buf, np.int32, n32, 8 * (_HEADER + n64))
    return step, (h[8], h[9], h[10]), bool(h[11])


class TPDriver:
    """Rank 0's side: spawns the workers, sends them each step, stops them."""

    def __init__(self, config, resolved, eos_token_id, device: torch.device):
        """device: rank 0's (cuda:base, or cpu); rank r runs on cuda:base+r."""
        world = config.parallel.tensor_parallel_size
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError(f"tensor_parallel_size={world}: this process already has a torch.distributed group "
                               "(another engine with tensor_parallel_size > 1 still open?): close() it first")
        self.world, self.device = world, device
        self._threads = torch.get_num_threads()  # restored at shutdown
        if device.type != "cuda":
            # The ranks share the host's cores: each takes its part (with every rank's OpenMP threads on all cores,
            # their spinning starved the others' collectives: a tp=2 step of random:tiny took 94 ms instead of 12).
            torch.set_num_threads(max(1, self._threads // world))
        self.closed = False
        self.joined = False  # the process group exists
        self.broken: str | None = None  # why the group can run no more steps
        self.send_seconds, self.num_steps = 0.0, 0  # the per-step cost of sending steps (bench/tests read it)
        self._dir = tempfile.mkdtemp(prefix="tandem-tp-")
        self._init_method = f"file://{self._dir}/rendezvous"
        # The workers' config names rank 0's device exactly ('cuda' alone would be each process's current device).
        config = replace(config, device=DeviceConfig(str(device)))
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        atexit.register(self.shutdown)
        for rank in range(1, world):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=worker_main, name=f"tandem-tp-rank{rank}", daemon=True,
                            args=(rank, config, resolved, eos_token_id, self._init_method, theirs))
            p.start()
            theirs.close()  # the worker's end lives in the worker only: its death closes the socket
            self.conns.append(ours)
            self.procs.append(p)

    def _describe_dead(self, timeout: float) -> str:
        """The workers that exited (waiting up to `timeout` for one to), reaped, with the error each sent."""
        wait([p.sentinel for p in self.procs], timeout)
        dead = []
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), 1):
            if p.is_alive():
                continue
            p.join()
            why = ""
            try:
                if conn.poll():
                    msg = conn.recv()
                    why = f": {msg[1].strip().splitlines()[-1]}" if msg[0] == "error" and msg[1].strip() else ""
            except (EOFError, OSError):
                pass
            dead.append(f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}{why}")
        return "; ".join(dead)

    def join_group(self, device: torch.device) -> None:
        """Waits until every worker has built its shard (raising with a worker's traceback if one failed), then
        joins the process group."""
        pending = dict(enumerate(self.conns, 1))
        while pending:
            ready = wait(list(pending.values()) + [self.procs[r - 1].sentinel for r in pending])
            for rank, conn in list(pending.items()):
                if conn not in ready and self.procs[rank - 1].sentinel not in ready:
                    continue
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    msg = ("error", "")
                if msg[0] != "built":
                    raise self.fail(f"rank {rank} failed while building its shard: {msg[1].strip()[-2000:]}")
                del pending[rank]
        _init_group(0, self.world, self.device, self._init_method)
        self.joined = True  # (the store stays until shutdown: NCCL exchanges its ids through it later)

    def _send(self, msg: bytes) -> None:
        if self.broken is not None:
            raise WorkerError(self.broken)
        try:
            for conn in self.conns:
                conn.send_bytes(msg)
        except OSError as e:
            raise self.fail(f"sending to a worker failed ({e!r})") from e

    def send_step(self, step: StepInputs, path: tuple[int, int, int], share: bool) -> None:
        t0 = time.perf_counter()
        self._send(encode_step(step, path, share))
        self.send_seconds += time.perf_counter() - t0
        self.num_steps += 1

    def call(self, name: str, *args) -> None:
        """Every worker runs runner.<name>(*args) (rank 0 then runs it too: same collectives, same order)."""
        self._send(np.array([_CALL] + [0] * (_HEADER - 1), np.int64).tobytes() + pickle.dumps((name, args)))

    def fail(self, what: str) -> WorkerError:
        """Marks the group broken, kills and reaps the workers; returns the error to raise."""
        if self.broken is None:
            dead = self._describe_dead(timeout=2.0)
            self.broken = f"tensor-parallel group broken: {what}" + (f"; worker {dead}" if dead else "")
            log.error("%s", self.broken)
            self.shutdown(graceful=False)
        return WorkerError(self.broken)

    def shutdown(self, graceful: bool = True) -> None:
        """Stops the workers and leaves the group: a stop message and a barrier when every rank is well, else the
        workers are killed. Every worker is reaped."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.shutdown)
        graceful = (graceful and self.joined and self.broken is None
                    and all(p.is_alive() for p in self.procs))
        if graceful:
            try:
                stop = np.array([_STOP] + [0] * (_HEADER - 1), np.int64).tobytes()
                for conn in self.conns:
                    conn.send_bytes(stop)
                _barrier(self.device)
            except Exception:  # noqa: BLE001 - a worker died meanwhile: kill the rest
                log.exception("tensor-parallel shutdown: a worker did not answer; killing the workers")
                graceful = False
        if self.joined and (graceful or self.device.type != "cuda"):
            # (NCCL's teardown with a peer gone may wait on it: after a failure the group is left to the process)
            dist.destroy_process_group()
        for p in self.procs:
            if graceful:
                p.join(timeout=30)
            if p.is_alive():
                p.kill()
            p.join()
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self._dir, ignore_errors=True)
        torch.set_num_threads(self._threads)


class _WorkerLink:
    """A worker's side of ModelRunner's start-up: says it has built, then joins the group."""

    def __init__(self, rank: int, world: int, init_method: str, conn: Connection):
        self.rank, self.world, self.init_method, self.conn = rank, world, init_method, conn

    def join_group(self, device: torch.device) -> None:
        self.conn.send(("built", ""))
        _init_group(self.rank, self.world, device, self.init_method)


@torch.inference_mode()
def worker_step(runner: ModelRunner, step: StepInputs, path: tuple[int, int, int], share: bool,
                prev_tokens: torch.Tensor | None) -> torch.Tensor | None:
    """Runs rank 0's step on this rank's shard; returns the step's sampled tokens when rank 0 shares them (the next
    step's inputs may be some of them)."""
    runner.forward(runner.device_inputs(step, prev_tokens), path, logits=False)
    if not share:
        return None
    tokens = torch.empty(step.num_sampled, dtype=torch.int64, device=runner.device)
    dist.broadcast(tokens, 0)
    return tokens


def _serve(runner: ModelRunner, conn: Connection) -> None:
    buf = bytearray(1 << 16)
    prev_tokens = None
    while True:
        try:
            n = conn.recv_bytes_into(buf)
        except mp.BufferTooShort as e:
            buf = bytearray(e.args[0])
            n = len(buf)
        kind = int(np.frombuffer(buf, np.int64, 1)[0])
        if kind == _STEP:
            step, path, share = decode_step(buf)
            prev_tokens = worker_step(runner, step, path, share, prev_tokens)
        elif kind == _CALL:
            name, args = pickle.loads(bytes(buf[8 * _HEADER: n]))
            getattr(runner, name)(*args)
        else:
            assert kind == _STOP, kind
            _barrier(runner.device)
            return


def worker_main(rank: int, config, resolved, eos_token_id, init_method: str, conn: Connection) -> None:
    """A worker process: build the shard, serve rank 0's steps until told to stop (or rank 0 is gone)."""
    code = 0
    try:
        world = config.parallel.tensor_parallel_size
        if config.device.torch_device.type != "cuda":
            torch.set_num_threads(max(1, torch.get_num_threads() // world))
        link = _WorkerLink(rank, world, init_method, conn)
        runner = ModelRunner(config, resolved, eos_token_id, rank=rank, link=link)
        if runner.device.type == "cuda":
            warm_up_attention(runner)
        _serve(runner, conn)
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

