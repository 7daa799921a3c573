"""Rank 0's side of tensor parallelism (vLLM's multiproc executor, simplified): TPDriver spawns the worker processes
(engine/tp_worker.py), sends them each step, notices when one dies, and stops them.

LLMEngine creates the driver before its ModelRunner, so that the workers build their shards while rank 0 builds its
own, and hands it to the runner, which sends each step through it (the runner imports neither this module nor the
worker's). engine/tp_worker.py's docstring tells the life of a step on both sides.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import shutil
import tempfile
import time
from dataclasses import replace
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist

from engine.collectives import WorkerError, barrier, init_group, send_message
from engine.config import DeviceConfig
from engine.model_runner import StepInputs, rank_device
from engine.tp import check_tensor_parallel
from engine.tp_worker import encode_call, encode_step, encode_stop, spawn_workers

log = logging.getLogger(__name__)


class TPDriver:
    """Rank 0's side: spawns the workers, sends them each step, stops them."""

    def __init__(self, config, resolved, eos_token_id):
        """Checks that the model splits over config.parallel.tensor_parallel_size ranks (ValueError naming the field
        otherwise), then spawns ranks 1..N-1; rank 0 runs on rank_device(config, 0), rank r on cuda:base+r."""
        parallel = config.parallel
        world, local = parallel.tensor_parallel_size, parallel.ranks_per_node
        if parallel.node_rank != 0:
            raise ValueError(f"node_rank={parallel.node_rank}: only node 0 runs the engine (the other nodes run "
                             "their ranks: engine/tp_node.py)")
        device = rank_device(config, 0)
        check_tensor_parallel(resolved.config, world, device, local)
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError(f"tensor_parallel_size={world}: this process already has a torch.distributed group "
                               "(another engine with tensor_parallel_size > 1 still open?): close() it first")
        self.world, self.device = world, device
        # Ranks on several hosts: every message goes to every rank over a gloo group (a pipe reaches only this host).
        self.nnodes, self.control = parallel.nnodes, None
        self.cpu_group = None  # the group's gloo twin (engine/collectives.init_group)
        self._threads = torch.get_num_threads()  # restored at shutdown
        if device.type != "cuda":
            # The ranks share the host's cores: each takes its part (with every rank's OpenMP threads on all cores,
            # their spinning starved the others' collectives: a step ran several times slower; bench/RESULTS.md).
            torch.set_num_threads(max(1, self._threads // local))
        self.closed = False
        self.joined = False  # the process group exists
        self.broken: str | None = None  # why the group can run no more steps
        self.send_seconds, self.num_steps = 0.0, 0  # the per-step cost of sending steps (bench/tests read it)
        self._dir = tempfile.mkdtemp(prefix="tandem-tp-")
        self._init_method = parallel.init_method or f"file://{self._dir}/rendezvous"
        # The workers' config names rank 0's device exactly ('cuda' alone would be each process's current device).
        config = replace(config, device=DeviceConfig(str(device)))
        self.conns: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        atexit.register(self.shutdown)
        # (node k > 0 starts ranks k * local .. itself: engine/tp_node.py)
        spawn_workers(range(1, local), config, resolved, eos_token_id, self._init_method, self.procs, self.conns)

    def _reap_dead(self, timeout: float) -> str:
        """The workers that died (waiting up to `timeout` for one to), reaped, with their exit codes and the error
        each sent. A worker is dead once its sentinel is ready (its end of the pipe closes as the process exits),
        and is then joined, not polled: a process whose files are closed (rank 0 may have seen its sockets close)
        can still be tearing down, and is_alive() says True until waitpid has its exit code."""
        ready = wait([p.sentinel for p in self.procs], timeout)
        dead = []
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), 1):
            if p.sentinel not in ready:
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
        self.cpu_group = init_group(0, self.world, self.device, self._init_method)
        self.control = self.cpu_group if self.nnodes > 1 else None
        self.joined = True  # (the store stays until shutdown: NCCL exchanges its ids through it later)

    def _send(self, msg: bytes) -> None:
        if self.broken is not None:
            raise WorkerError(self.broken)
        try:
            if self.control is not None:
                send_message(msg, self.control)
            else:
                for conn in self.conns:
                    conn.send_bytes(msg)
        except (OSError, RuntimeError) as e:  # (gloo: a rank on another host is gone)
            raise self.fail(f"sending to a worker failed ({e!r})") from e

    def send_step(self, step: StepInputs, path: tuple[int, int, int], share: bool) -> None:
        t0 = time.perf_counter()
        self._send(encode_step(step, path, share))
        self.send_seconds += time.perf_counter() - t0
        self.num_steps += 1

    def call(self, name: str, *args) -> None:
        """Every worker runs runner.<name>(*args) (rank 0 then runs it too: same collectives, same order)."""
        self._send(encode_call(name, args))

    def fail(self, what: str) -> WorkerError:
        """Marks the group broken, kills and reaps the workers; returns the error to raise. A worker that died
        is named with its exit code however rank 0 noticed it first (a closed socket, an error inside a collective,
        a failed build)."""
        if self.broken is None:
            dead = self._reap_dead(timeout=2.0)
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
                self._send(encode_stop())
                barrier(self.device)
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
