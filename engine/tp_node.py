"""A host other than node 0 of an engine whose tensor-parallel ranks span several hosts (`--nnodes N --node-rank k
--master-addr A --master-port P`, torchrun's and a Kubernetes LeaderWorkerSet's convention).

Node k runs ranks k * n .. (k + 1) * n - 1 (n = tensor_parallel_size / nnodes) as worker processes
(engine/tp_worker.py), rank k * n + r on cuda:base+r; it serves nothing itself. Every rank meets at node 0's TCP
rendezvous (A:P) and joins the engine's process group (NCCL on GPUs, gloo on the CPU); rank 0 then sends each step
to every rank over a gloo control group instead of a pipe (engine/collectives.send_message). The node's process
waits for its ranks: they exit 0 when rank 0 stops the engine; when one fails (rank 0 gone: its connections close)
the others are killed and the node exits 1, so that the host's supervisor (Kubernetes) restarts the group.
"""
from __future__ import annotations

import logging
import signal
import sys
from multiprocessing.connection import wait

from engine.config import EngineConfig
from engine.loader import resolve_model
from engine.tp import check_tensor_parallel
from engine.model_runner import rank_device
from engine.tp_worker import spawn_workers

log = logging.getLogger(__name__)


def run_node(config: EngineConfig) -> int:
    """Runs this node's ranks until rank 0 stops them (0) or one of them fails (1)."""
    parallel = config.parallel
    parallel.check()
    if parallel.node_rank == 0:
        raise ValueError("node_rank=0: node 0 runs the engine itself (LLMEngine), not run_node")
    resolved = resolve_model(config.model.model)
    local = parallel.ranks_per_node
    first = parallel.node_rank * local
    check_tensor_parallel(resolved.config, parallel.tensor_parallel_size, rank_device(config, first), local)
    procs, conns = [], []
    # (eos None: only rank 0 samples)
    spawn_workers(range(first, first + local), config, resolved, None, parallel.init_method, procs, conns)
    log.info("node %d of %d: ranks %d..%d started, meeting at %s", parallel.node_rank, parallel.nnodes, first,
             first + local - 1, parallel.init_method)
    code = 0
    # SIGTERM (a supervisor stopping the host): the ranks are killed on the way out, not orphaned.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        left = list(procs)
        while left:
            for sentinel in wait([p.sentinel for p in left]):
                p = next(p for p in left if p.sentinel == sentinel)
                p.join()
                left.remove(p)
                if p.exitcode != 0 and code == 0:
                    log.error("node %d: %s exited with code %s: stopping this node's ranks", parallel.node_rank,
                              p.name, p.exitcode)
                    code = 1
                    for q in left:
                        q.kill()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        for c in conns:
            c.close()
    log.info("node %d: its ranks stopped (exit %d)", parallel.node_rank, code)
    return code
