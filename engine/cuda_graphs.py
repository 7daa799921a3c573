"""Steps replayed as CUDA graphs, so the host launches one graph instead of ~20 kernels per layer.

Decode steps (every request adds one token and samples) replay a graph per (padded batch size, context bound): the
inputs go into static buffers, padding rows write no KV (slot -1) and attend to one stale slot whose output is
dropped. Attention is captured with max_seq_len = the bound, which only steers the kernel's launch shape (each row
still stops at its own seq_len): max_model_len, and a short bound (kernels/paged_attention.py
decode_graph_lengths) at the batch sizes where the kernel launches differently for short contexts. A step replays
the smallest bound at least its longest context.

Steps with prompt tokens (prefill chunks, maybe with decodes: vLLM's full graphs for mixed batches) replay a graph
per (padded token count, sequence rows). The attention kernel maps its programs to sequences on the device (from
query_start_loc), so a graph captured for T tokens and S rows runs any step of at most T tokens and S - 1
sequences: the step's tokens fill the first rows, the rest of the T tokens form one padding sequence (no KV
written, output dropped), and the remaining rows are empty sequences (no queries: their programs return at once).
A short prefill of a large model takes the host longer to launch eagerly than the GPU takes to run its kernels
(measured: bench/RESULTS.md); the graph takes the host's part out of TTFT.

All graphs share one memory pool (one graph replays at a time) and write their logits into one buffer per kind.
"""
from __future__ import annotations

import logging
import time

import torch

from engine.model import AttentionMetadata
from engine.utils import cdiv
from kernels._checks import FP8_DTYPE, sm_count
from kernels.paged_attention import decode_graph_lengths

log = logging.getLogger(__name__)

# vLLM's sizes up to 512: a decode batch pads by at most 7 rows (at batch ~500 the GEMMs are compute-bound: padding
# costs); then every 16 up to 1024, so that --max-num-seqs 1024 (short prompts, an fp8 cache) does not decode its
# largest batches eagerly, launch-bound on the host. Padding 15 rows at 528+ is under 3%. Only the sizes <=
# --max-num-seqs are captured.
CAPTURE_SIZES = (1, 2, 4) + tuple(range(8, 513, 8)) + tuple(range(528, 1025, 16))
# Steps with prompt tokens: token counts (powers of two, then every 128: at most 25% padding past 256 tokens) ...
PREFILL_TOKEN_SIZES = (16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)
# ... and sequence rows, one or more of them padding (an idle prefill is 1 sequence: 2 rows).
PREFILL_SEQ_SIZES = (2, 8, 32, 128)


def _capture(graphs: dict, keys, forward, pool, what: str, prepare=None):
    """Captures forward(key) for each key (largest first, so smaller graphs reuse the pool's blocks), after
    prepare(key) (outside the graph: it sets the static inputs to valid values for that key); returns the pool."""
    t0 = time.perf_counter()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for key in keys:
            if prepare is not None:
                prepare(key)
            forward(key)  # warm-up outside the graph: kernel compilation and autotuning
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=stream):
                forward(key)
            pool = g.pool()
            graphs[key] = g
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    log.info("captured %d %s CUDA graphs in %.1f s", len(keys), what, time.perf_counter() - t0)
    return pool


class DecodeGraphs:
    def __init__(self, runner, max_num_seqs: int, max_model_len: int, pool=None):
        self.runner = runner
        self.sizes = [s for s in CAPTURE_SIZES if s <= max_num_seqs] or [1]
        if self.sizes[-1] < max_num_seqs and max_num_seqs <= CAPTURE_SIZES[-1]:
            self.sizes.append(max_num_seqs)
        self.max_batch = self.sizes[-1]
        self.max_model_len = max_model_len
        dev = runner.device
        B = self.max_batch
        max_blocks = cdiv(max_model_len, runner.block_size)
        self.input_ids = torch.zeros(B, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(B, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((B,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(B, max_blocks, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(B, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(B + 1, dtype=torch.int32, device=dev)
        kv = runner.kv_layers[0]
        _, _, num_kv_heads, head_dim = kv.k_cache.shape
        cfg = runner.hf_config
        queries_per_kv = cfg.num_attention_heads // getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
        shape = (num_kv_heads, queries_per_kv, head_dim, sm_count(dev, 4), runner.dtype.itemsize,
                 kv.k_cache.dtype == FP8_DTYPE, kv.k_scale_cache is not None)
        self.lengths = {b: decode_graph_lengths(max_model_len, b, *shape) for b in self.sizes}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # Every graph writes its logits into one buffer (a kept output per graph would hold ~5 GB at 7B scale).
        self.logits = torch.empty(B, runner.hf_config.vocab_size, dtype=runner.dtype, device=dev)
        keys = [(b, n) for b in reversed(self.sizes) for n in reversed(self.lengths[b])]
        with torch.inference_mode():
            self.pool = _capture(self.graphs, keys, self._forward, pool, "decode")

    def _meta(self, b: int, max_seq_len: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:b], self.block_tables[:b], self.seq_lens[:b],
                                 self.query_start_loc[: b + 1], 1, max_seq_len)

    def _forward(self, key: tuple[int, int]) -> None:
        b, max_seq_len = key
        model = self.runner.model
        hidden = model(self.input_ids[:b], self.positions[:b], self.runner.kv_layers, self._meta(b, max_seq_len))
        self.logits[:b].copy_(model.compute_logits(hidden))

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_batch

    def run(self, input_ids, positions, slot_mapping, block_tables, seq_lens, max_seq_len: int) -> torch.Tensor:
        """Inputs of n decode rows (device tensors) whose longest context is max_seq_len keys (a host int, this
        step's: every tensor-parallel rank has the same, so all replay the same graph); returns logits [n, vocab]."""
        n = input_ids.shape[0]
        b = next(s for s in self.sizes if s >= n)
        bound = next((m for m in self.lengths[b] if m >= max_seq_len), self.lengths[b][-1])
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.slot_mapping[n:b].fill_(-1)
        self.block_tables[:n, : block_tables.shape[1]].copy_(block_tables)
        self.seq_lens[:n].copy_(seq_lens)
        self.seq_lens[n:b].fill_(1)
        self.graphs[b, bound].replay()
        return self.logits[:n]


class PrefillGraphs:
    """Graphs for steps with prompt tokens, keyed by (tokens, sequence rows). capture=False runs the same padded
    forward eagerly (the CPU tests check the padding with it)."""

    def __init__(self, runner, max_tokens: int, max_num_seqs: int, max_model_len: int, pool=None,
                 capture: bool = True):
        self.runner = runner
        bs = runner.block_size
        max_blocks = cdiv(max_model_len, bs)
        # The padding sequence holds up to T tokens: its blocks must fit a block-table row.
        limit = min(max_tokens, max_blocks * bs)
        self.token_sizes = [t for t in PREFILL_TOKEN_SIZES if t < limit] + [limit] if limit >= 1 else []
        rows = [s for s in PREFILL_SEQ_SIZES if s <= max_num_seqs + 1]
        if max_num_seqs + 1 < PREFILL_SEQ_SIZES[-1] and (not rows or rows[-1] < max_num_seqs + 1):
            rows.append(max_num_seqs + 1)
        self.seq_sizes = rows
        self.max_tokens = self.token_sizes[-1] if self.token_sizes else 0
        self.max_model_len = max_model_len
        self.capture = capture
        dev = runner.device
        T, S = max(self.max_tokens, 1), self.seq_sizes[-1]
        self.input_ids = torch.zeros(T, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(T, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((T,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(S, max_blocks, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(S, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.zeros(S + 1, dtype=torch.int32, device=dev)
        self.logits_indices = torch.zeros(S, dtype=torch.int64, device=dev)
        self.logits = torch.empty(S, runner.hf_config.vocab_size, dtype=runner.dtype, device=dev)
        # (tokens, rows) pairs where every row could hold a sequence with at least one token
        self.keys = [(t, s) for t in reversed(self.token_sizes) for s in reversed(self.seq_sizes) if s - 1 <= t]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = pool
        if capture and self.keys:
            with torch.inference_mode():
                self.pool = _capture(self.graphs, self.keys, self._forward, pool, "prefill",
                                     prepare=lambda key: self._fill_padding(0, 0, *key))

    def _forward(self, key: tuple[int, int]) -> None:
        t, s = key
        model = self.runner.model
        meta = AttentionMetadata(self.slot_mapping[:t], self.block_tables[:s], self.seq_lens[:s],
                                 self.query_start_loc[: s + 1], t, self.max_model_len)
        hidden = model(self.input_ids[:t], self.positions[:t], self.runner.kv_layers, meta)
        self.logits[:s].copy_(model.compute_logits(hidden.index_select(0, self.logits_indices[:s])))

    def key_for(self, num_tokens: int, num_seqs: int) -> tuple[int, int] | None:
        """The smallest graph that runs a step of num_tokens tokens over num_seqs sequences, or None."""
        t = next((t for t in self.token_sizes if t >= num_tokens), None)
        s = next((s for s in self.seq_sizes if s >= num_seqs + 1), None)
        if t is None or s is None or s - 1 > t:
            return None
        return t, s

    def _fill_padding(self, n: int, num_seqs: int, t: int, s: int) -> None:
        """Tokens n..t form sequence row num_seqs (context-free, writes no KV); rows after it are empty."""
        self.slot_mapping[n:t].fill_(-1)
        self.seq_lens[num_seqs:num_seqs + 1].fill_(t - n)
        self.seq_lens[num_seqs + 1:s].fill_(0)
        self.query_start_loc[num_seqs + 1:s + 1].fill_(t)

    def run(self, key: tuple[int, int], input_ids, positions, meta: AttentionMetadata,
            logits_indices) -> torch.Tensor:
        """A step's inputs (device tensors) into the graph `key`; returns logits [len(logits_indices), vocab]."""
        t, s = key
        n, num_seqs, num_sampled = input_ids.shape[0], meta.seq_lens.shape[0], logits_indices.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:num_seqs, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.seq_lens[:num_seqs].copy_(meta.seq_lens)
        self.query_start_loc[: num_seqs + 1].copy_(meta.query_start_loc)
        self._fill_padding(n, num_seqs, t, s)
        self.logits_indices[:num_sampled].copy_(logits_indices)
        self.logits_indices[num_sampled:s].fill_(0)
        if self.capture:
            self.graphs[key].replay()
        else:
            self._forward(key)
        return self.logits[:num_sampled]
