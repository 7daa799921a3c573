"""Decode steps replayed as CUDA graphs: one graph per padded batch size, sharing one memory pool.

A decode-only step (every request adds exactly one token and samples) with at most the largest captured batch
copies its inputs into static buffers, pads to the next captured size (padding rows write no KV: slot -1, and attend
to one stale slot whose output is dropped) and replays the graph, which runs the whole forward and the logits.
Attention is captured with max_seq_len = max_model_len, which only steers the kernel's launch shape; each row
still stops at its own seq_len.
"""
from __future__ import annotations

import logging

import torch

from engine.model import AttentionMetadata

log = logging.getLogger(__name__)

# vLLM's sizes: a decode batch pads by at most 7 rows (at batch ~500 the GEMMs are compute-bound: padding costs).
CAPTURE_SIZES = (1, 2, 4) + tuple(range(8, 513, 8))


class DecodeGraphs:
    def __init__(self, runner, max_num_seqs: int, max_model_len: int):
        self.runner = runner
        self.sizes = [s for s in CAPTURE_SIZES if s <= max_num_seqs] or [1]
        if self.sizes[-1] < max_num_seqs and max_num_seqs <= CAPTURE_SIZES[-1]:
            self.sizes.append(max_num_seqs)
        self.max_batch = self.sizes[-1]
        self.max_model_len = max_model_len
        dev = runner.device
        B = self.max_batch
        max_blocks = -(-max_model_len // runner.block_size)
        self.input_ids = torch.zeros(B, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(B, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((B,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(B, max_blocks, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(B, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(B + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Every graph writes its logits into one buffer (a kept output per graph would hold ~5 GB at 7B scale).
        self.logits = torch.empty(B, runner.hf_config.vocab_size, dtype=runner.dtype, device=dev)
        self._capture()

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:b], self.block_tables[:b], self.seq_lens[:b],
                                 self.query_start_loc[: b + 1], 1, self.max_model_len)

    def _forward(self, b: int) -> torch.Tensor:
        model = self.runner.model
        hidden = model(self.input_ids[:b], self.positions[:b], self.runner.kv_layers, self._meta(b))
        return model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.sizes):
                self._forward(b)  # warm-up outside the graph: kernel compilation and autotuning
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    self.logits[:b].copy_(self._forward(b))
                pool = g.pool()
                self.graphs[b] = g
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_batch

    def run(self, input_ids, positions, slot_mapping, block_tables, seq_lens) -> torch.Tensor:
        """Inputs of n decode rows (device tensors); returns logits [n, vocab]."""
        n = input_ids.shape[0]
        b = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.slot_mapping[n:b].fill_(-1)
        self.block_tables[:n, : block_tables.shape[1]].copy_(block_tables)
        self.seq_lens[:n].copy_(seq_lens)
        self.seq_lens[n:b].fill_(1)
        self.graphs[b].replay()
        return self.logits[:n]
