"""Owns the model, the KV cache tensor and the sampler; turns a SchedulerOutput into sampled tokens.

step_inputs flattens the scheduled requests into one token batch (prefill chunks and decodes together) in two
packed host buffers, device_inputs copies them to the device as the inputs and the attention metadata (a
tensor-parallel worker receives rank 0's buffers and runs the same two steps); execute runs the model, computes
logits only for the requests whose scheduled tokens reach their end, and samples one token for each of them.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from engine.collectives import RankError, gather_heads, min_over_ranks, scatter_heads, share_tokens
from engine.config import EngineConfig, resolve_dtype
from engine.cpu_linear import pack_linears, packing_ok
from engine.host_kv import apply_copies, host_tensors_for
from engine.loader import ResolvedModel, build_model
from engine.model import AttentionMetadata, LayerKV
from engine.request import Request
from engine.sampler import DeviceSample, Sampler, SamplerOutput, to_device_nowait
from engine.scheduler import SchedulerOutput
from engine.utils import cdiv
from kernels.quant_int8 import INT8_ROW_PAD, int8_cache_views

log = logging.getLogger(__name__)

GiB = 1 << 30
FP8_KV_HEADROOM = 4.0  # K and V may grow 4-8x past the calibration prompt's before fp8 saturates


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype == "int8":
        return torch.int8
    return torch.float8_e4m3fn if kv_cache_dtype.startswith("fp8") else model_dtype


def kv_row_bytes(kv_dtype: torch.dtype, head_dim: int) -> int:
    """Bytes of one (slot, KV head) row of K or V in the cache: an int8 row's share includes its float32 scale (stored
    in its block after the block's values, kernels/quant_int8.py)."""
    if kv_dtype == torch.int8:
        return head_dim + INT8_ROW_PAD
    return head_dim * torch.empty((), dtype=kv_dtype).element_size()


def allocate_kv_cache(num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                      kv_dtype: torch.dtype, device, zero: bool = False) -> torch.Tensor:
    """The engine's KV cache, one contiguous tensor [num_blocks, num_layers, 2, block_size, num_kv_heads, row]:
    row = head_dim values, or for int8 head_dim + 4 bytes (each (block, layer, K/V) region its values, then their
    float32 scales: kernels/quant_int8.int8_cache_views). Each block's bytes (its scales included) are one
    contiguous range: prefix caching shares blocks by id and every KV transfer path moves
    block bytes, so the scales go wherever their values go."""
    if kv_dtype == torch.int8 and head_dim % 4:
        raise ValueError(f"kv_cache_dtype=int8: head_dim={head_dim} must be a multiple of 4 (each block's float32 "
                         "scales are stored after its values, 4-byte aligned); use auto or fp8")
    row = head_dim + INT8_ROW_PAD if kv_dtype == torch.int8 else head_dim
    alloc = torch.zeros if zero else torch.empty
    return alloc(num_blocks, num_layers, 2, block_size, num_kv_heads, row, dtype=kv_dtype, device=device)


def layer_kv_views(kv_cache: torch.Tensor, k_scales: list[float] | None = None,
                   v_scales: list[float] | None = None) -> list[LayerKV]:
    """Each layer's K/V views of an allocate_kv_cache tensor (with an int8 cache's per-slot scale views)."""
    num_layers = kv_cache.shape[1]
    k_scales, v_scales = k_scales or [1.0] * num_layers, v_scales or [1.0] * num_layers
    layers = []
    for l in range(num_layers):
        if kv_cache.dtype == torch.int8:
            (kc, ks), (vc, vs) = int8_cache_views(kv_cache[:, l, 0]), int8_cache_views(kv_cache[:, l, 1])
            layers.append(LayerKV(kc, vc, k_scale_cache=ks, v_scale_cache=vs))
        else:
            layers.append(LayerKV(kv_cache[:, l, 0], kv_cache[:, l, 1], k_scales[l], v_scales[l]))
    return layers


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] rows of the hidden states to sample from
    sampled_requests: list[Request]


# Which forward a step runs (StepPath's kind); every tensor-parallel rank runs the one rank 0 picked.
EAGER, DECODE_GRAPH, PREFILL_GRAPH = 0, 1, 2


@dataclass
class StepInputs:
    """One step's inputs on the host, packed into two buffers: what every tensor-parallel rank needs to run the same
    forward (engine/tp_executor.py sends it to the workers as it is)."""
    i64: np.ndarray  # input_ids, positions, slots [num_tokens] each, logits rows [num_sampled], fill dst/src [num_fill]
    i32: np.ndarray  # seq_lens [num_seqs], query_start_loc [num_seqs + 1], block tables [num_seqs * max_blocks]
    num_tokens: int
    num_seqs: int
    num_sampled: int
    num_fill: int  # inputs that are the previous step's sampled tokens, still on the device (async scheduling)
    max_blocks: int
    max_query_len: int
    max_seq_len: int
    sampled_requests: list[Request] = field(default_factory=list)  # rank 0 only

    def lengths(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The segments' lengths in i64 and in i32, in order."""
        t, s, f = self.num_tokens, self.num_seqs, self.num_fill
        return (t, t, t, self.num_sampled, f, f), (s, s + 1, s * self.max_blocks)


def _offsets(lengths, dtype) -> tuple[list[int], int]:
    """Where each segment starts in its packed buffer, and the buffer's length: each segment starts 16-byte aligned.
    Triton specializes kernels on pointer alignment, and a view whose alignment changed from step to step would
    compile a second variant mid-run, stalling that step for the compile."""
    align = 16 // np.dtype(dtype).itemsize
    offsets, total = [], 0
    for n in lengths:
        offsets.append(total)
        total += cdiv(n, align) * align
    return offsets, max(total, 1)


class ModelRunner:
    def __init__(self, config: EngineConfig, resolved: ResolvedModel, eos_token_id: int | None, rank: int = 0,
                 link=None):
        """With tensor_parallel_size > 1 every rank's runner gets a `link`, which join_group()s the process group
        once this rank has built its shard: on rank 0 the engine's TPDriver (engine/tp_executor.py), spawned before
        this runner builds so that the workers build their shards meanwhile, and kept in self.driver to send each
        step; on rank r > 0 the worker's line to rank 0 (engine/tp_worker.py)."""
        self.config = config
        self.rank, self.tp_size = rank, config.parallel.tensor_parallel_size
        assert (link is not None) == (self.tp_size > 1), (self.tp_size, link)
        self.device = rank_device(config, rank)
        use_device(self.device)
        self.driver = link if rank == 0 else None
        self.share_sampled_tokens = False  # the engine's async scheduling: workers then receive each step's tokens
        self._build(config, resolved, eos_token_id, link)

    def _build(self, config: EngineConfig, resolved: ResolvedModel, eos_token_id: int | None, link) -> None:
        hf_config = resolved.config
        self.dtype = resolve_dtype(config.model.dtype, hf_config, self.device)
        # Built on the meta device, each part allocated in its dtype as it loads (fp8 linears as fp8): the peak is
        # about the final model, not a float32 copy of it (engine/loader.build_model). With tensor parallelism each
        # layer is split for this rank as it loads.
        model = build_model(resolved, self.dtype, self.device, config.model.quantization, config.model.seed,
                            self.rank, self.tp_size)
        model.eval()
        if packing_ok(self.device, self.dtype):
            pack_linears(model)
        self.model = model
        self.hf_config = hf_config
        self.num_layers = hf_config.num_hidden_layers
        self.num_heads = hf_config.num_attention_heads // self.tp_size  # this rank's
        self.num_kv_heads = hf_config.num_key_value_heads // self.tp_size  # this rank's: its KV cache holds these
        self.head_dim = model.head_dim
        self.block_size = config.cache.block_size
        self.kv_dtype = kv_cache_torch_dtype(config.cache.kv_cache_dtype, self.dtype)
        self.sampler = Sampler(hf_config.vocab_size, eos_token_id)
        if link is not None:
            # Every rank has built its shard: from here on, every rank runs the same collectives in the same order.
            link.join_group(self.device)
        self.cpu_group = link.cpu_group if link is not None else None  # gloo, for host objects (collective_rpc)
        self.num_blocks = self._num_blocks()
        if self.tp_size > 1:  # block ids mean the same on every rank
            self.num_blocks = min_over_ranks(self.num_blocks, self.device)
        # [num_blocks, num_layers, 2, block_size, num_kv_heads, row]: one block's bytes for all layers together.
        # Unwritten slots are never read as valid: attention masks (and on the CPU clears) everything past seq_lens.
        self.kv_cache = allocate_kv_cache(self.num_blocks, self.num_layers, self.block_size, self.num_kv_heads,
                                          self.head_dim, self.kv_dtype, self.device)
        # fp8 KV stores x / scale: per-layer scales calibrated once here (see calibrate_kv_scales), 1.0 otherwise.
        # With tensor parallelism every rank runs the calibration forward and takes the scales over all KV heads.
        self.k_scales, self.v_scales = (self.calibrate_kv_scales() if self.kv_dtype == torch.float8_e4m3fn
                                        else ([1.0] * self.num_layers, [1.0] * self.num_layers))
        # DecodeGraphs and PrefillGraphs, captured by enable_cuda_graphs() once the engine knows max_model_len
        self.graphs = None
        self.prefill_graphs = None
        self.kv_layers = layer_kv_views(self.kv_cache, self.k_scales, self.v_scales)

    def release_cuda_graphs(self) -> None:
        """Destroys the captured CUDA graphs. Before a tensor-parallel group is torn down: NCCL (>= 2.26) will not
        destroy a communicator while a graph that captured one of its collectives exists (commDestroySync polls
        until they are gone), so destroy_process_group with the graphs alive hung the engine's close() on the
        H200s. reset() frees each graph whatever still refers to it (the engine's startup objects are gc-frozen)."""
        for graphs in (self.graphs, self.prefill_graphs):
            if graphs is not None:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                for g in graphs.graphs.values():
                    g.reset()
                graphs.graphs.clear()
        self.graphs = self.prefill_graphs = None

    # ---- a worker's host KV tier: rank 0's HostKVTier decides, every rank copies its own heads --------------------
    def enable_host_kv(self, num_blocks: int) -> None:
        """A worker: host blocks for its share of the KV (rank 0's HostKVTier holds as many)."""
        self.host_kv = host_tensors_for([self.kv_cache], num_blocks)

    def host_kv_copies(self, ops: list[tuple[int, int, int]]) -> None:
        """A worker: the copies rank 0's HostKVTier.flush() issued, between its device and host blocks."""
        apply_copies(ops, [self.kv_cache], self.host_kv)

    # ---- KV blocks as a KV transfer moves them: every KV head, on rank 0 ------------------------------------------
    def _block_index(self, block_ids: list[int]) -> torch.Tensor:
        if not all(0 <= b < self.num_blocks for b in block_ids):
            raise ValueError(f"block_ids: must lie in [0, {self.num_blocks})")
        return torch.tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)

    def _collective(self, what: str, fn, *args):
        """fn(*args) on this rank; on rank 0 a failure breaks the group (the workers are already inside fn)."""
        if self.driver is None:
            return fn(*args)
        try:
            return fn(*args)
        except Exception as e:
            raise self.driver.fail(f"rank 0's {what} failed: {e!r}") from e

    def collective_rpc(self, fn, args: tuple = ()) -> list | None:
        """fn(runner, *args) on every rank (fn: a module-level function, sent by reference; vLLM's collective_rpc):
        on rank 0 the results in rank order, None on the others. A rank's exception is carried back, not raised
        where it happened (every rank finishes the call), and rank 0 raises RankError naming the rank."""
        if self.tp_size == 1:
            return [fn(self, *args)]
        if self.driver is not None:
            self.driver.call("collective_rpc", fn, args)
        try:
            out = (fn(self, *args), None)
        except Exception as e:  # noqa: BLE001 - carried back to rank 0
            out = (None, RankError.of(self.rank, e))
        gathered = [None] * self.tp_size if self.rank == 0 else None
        self._collective("collective_rpc", dist.gather_object, out, gathered, 0, self.cpu_group)
        if self.rank != 0:
            return None
        for _, err in gathered:
            if err is not None:
                raise err
        return [result for result, _ in gathered]

    def gather_kv_blocks(self, block_ids: list[int]) -> torch.Tensor | None:
        """Blocks `block_ids` with every rank's KV heads, [n, num_layers, 2, block_size, num_kv_heads * tp, row], on
        rank 0 (None on the other ranks): what a KV transfer sends. Every rank runs it, rank 0 sending the call
        first, so it runs in order with the steps on every rank."""
        index = self._block_index(block_ids)  # (checked before the workers are asked: they would wait forever)
        if self.driver is not None:
            self.driver.call("gather_kv_blocks", block_ids)
        local = self.kv_cache.index_select(0, index)
        if self.tp_size == 1:
            return local
        return self._collective("KV gather", gather_heads, local, self.rank, self.tp_size)

    def scatter_kv_blocks(self, block_ids: list[int], blocks: torch.Tensor | None) -> None:
        """kv_cache[block_ids] = this rank's KV heads of `blocks` (rank 0's, shaped as gather_kv_blocks returns
        them; None on the other ranks): what a KV transfer receives."""
        shape = (len(block_ids), *self.kv_cache.shape[1:])
        if self.rank == 0:
            full = (shape[0], *shape[1:4], shape[4] * self.tp_size, shape[5])
            if tuple(blocks.shape) != full or blocks.dtype != self.kv_cache.dtype:
                raise ValueError(f"blocks: {tuple(blocks.shape)} {blocks.dtype}, must be {full} {self.kv_cache.dtype}")
            blocks = blocks.to(self.device, non_blocking=True)
        index = self._block_index(block_ids)
        if self.driver is not None:
            self.driver.call("scatter_kv_blocks", block_ids, None)
        if self.tp_size > 1:
            blocks = self._collective("KV scatter", scatter_heads, blocks, shape, self.kv_cache.dtype, self.device,
                                      self.rank, self.tp_size)
        self.kv_cache.index_copy_(0, index, blocks.to(self.device, non_blocking=True))

    @property
    def kv_bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * kv_row_bytes(self.kv_dtype, self.head_dim)

    def _num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if cache.kv_cache_memory is not None or self.device.type != "cuda":
            budget = (cache.kv_cache_memory if cache.kv_cache_memory is not None else 1.0) * GiB
        else:
            budget = self._profile_cuda_budget()
        n = int(budget // self.kv_bytes_per_block)
        if n < 1:
            raise ValueError(f"the KV cache budget ({budget / GiB:.2f} GiB) holds no block of "
                             f"{self.kv_bytes_per_block} bytes: raise --kv-cache-memory or --gpu-memory-utilization")
        return n

    @torch.inference_mode()
    def _profile_cuda_budget(self) -> float:
        """vLLM's rule: memory for the KV cache = total * utilization - (weights + peak activations of the largest
        step), measured by running one step of max_num_batched_tokens tokens through the model."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = min(self.config.scheduler.max_num_batched_tokens, self.hf_config.max_position_embeddings)
        dummy_cache = allocate_kv_cache(1, self.num_layers, self.block_size, self.num_kv_heads, self.head_dim,
                                        self.kv_dtype, self.device, zero=True)
        layers = layer_kv_views(dummy_cache)
        meta = AttentionMetadata(
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=self.device),
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([1], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=self.device),
            max_query_len=1, max_seq_len=1)
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, torch.zeros_like(ids), layers, meta)
        self.model.compute_logits(hidden[: self.config.scheduler.max_num_seqs])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device)
        del hidden, dummy_cache
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        budget = total * self.config.cache.gpu_memory_utilization - peak - used_by_others
        log.info("CUDA memory: total %.1f GiB, peak of one step %.1f GiB, KV budget %.1f GiB",
                 total / GiB, peak / GiB, budget / GiB)
        return max(budget, 0.0)

    @staticmethod
    def _pack(segments, dtype) -> np.ndarray:
        """The segments in one host buffer, each at its _offsets place."""
        offsets, total = _offsets([len(seg) for seg in segments], dtype)
        host = np.zeros(total, dtype=dtype)
        for off, seg in zip(offsets, segments):
            host[off: off + len(seg)] = seg
        return host

    def _unpack(self, host: np.ndarray, lengths) -> list[torch.Tensor]:
        """A packed host buffer copied to the device at once; returns its segments' device views."""
        offsets, _ = _offsets(lengths, host.dtype)
        dev = to_device_nowait(torch.from_numpy(host), self.device)
        return [dev[off: off + n] for off, n in zip(offsets, lengths)]

    def prepare_inputs(self, sched: SchedulerOutput, block_tables: np.ndarray | list[list[int]],
                       prev: "StepHandle | None" = None) -> ModelInputs:
        """The step's inputs on the device (step_inputs, then device_inputs)."""
        step = self.step_inputs(sched, block_tables, prev)
        return self.device_inputs(step, prev.token_ids if step.num_fill else None)

    def step_inputs(self, sched: SchedulerOutput, block_tables: np.ndarray | list[list[int]],
                    prev: "StepHandle | None" = None) -> StepInputs:
        """block_tables: [num_seqs, max_blocks] int32, each scheduled request's block ids padded with 0
        (KVCacheManager.block_tables; lists of block ids are padded here). The scheduler has already advanced each
        request's num_computed_tokens past this step's tokens. An input token the host has not read yet (async
        scheduling: sampled by `prev`, still in flight) is taken from prev's sampled tokens on the device.
        Per request only the input ids and the token counts are gathered in Python; positions, slots, query starts and
        logits rows are computed over the batch in numpy."""
        bs = self.block_size
        if not isinstance(block_tables, np.ndarray):
            block_tables = padded_block_tables(block_tables)
        input_ids: list[int] = []
        ends: list[int] = []  # per request: its tokens with KV after this step (= seq_lens)
        counts: list[int] = []  # per request: its tokens in this step
        fill_dst: list[int] = []  # rows of input_ids that come from prev's sampled tokens ...
        fill_src: list[int] = []  # ... at these rows
        prev_rows = None
        for req, n in sched.scheduled:
            end = req.num_computed_tokens
            ends.append(end)
            counts.append(n)
            prompt, output = req.prompt_token_ids, req.output_token_ids
            known = len(prompt) + len(output)
            if end <= known:
                if n == 1:
                    p = end - 1
                    input_ids.append(prompt[p] if p < len(prompt) else output[p - len(prompt)])
                else:
                    input_ids.extend(req.token_slice(end - n, end))
            else:  # the last input is the token prev sampled
                assert end == known + 1 and prev is not None, (req, n)
                if prev_rows is None:
                    prev_rows = {r.request_id: i for i, r in enumerate(prev.requests)}
                if n > 1:
                    input_ids.extend(req.token_slice(end - n, known))
                fill_dst.append(len(input_ids))
                fill_src.append(prev_rows[req.request_id])
                input_ids.append(0)
        num_seqs = len(ends)
        seq_lens = np.array(ends, dtype=np.int64)  # [num_seqs]
        q_lens = np.array(counts, dtype=np.int64)  # [num_seqs]
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)  # [num_seqs + 1]
        np.cumsum(q_lens, out=qsl[1:])
        starts = seq_lens - q_lens
        if len(input_ids) == num_seqs:  # decodes only: one token per request
            rows, positions = np.arange(num_seqs), starts
        else:
            rows = np.repeat(np.arange(num_seqs), q_lens)  # [num_tokens] each token's request
            positions = np.arange(len(input_ids)) + np.repeat(starts - qsl[:-1], q_lens)  # [num_tokens]
        slots = block_tables[rows, positions // bs].astype(np.int64) * bs + positions % bs  # [num_tokens]
        samples = np.array(sched.samples, dtype=bool)
        logits_indices = qsl[1:][samples] - 1  # [num_sampled]
        sampled = [req for (req, _), s in zip(sched.scheduled, sched.samples) if s]
        max_blocks = block_tables.shape[1]
        # Two buffers: the int64 vectors packed together, and the int32 ones with the block tables.
        i64 = self._pack((input_ids, positions, slots, logits_indices, fill_dst, fill_src), np.int64)
        i32 = self._pack((seq_lens, qsl, block_tables.ravel()), np.int32)
        return StepInputs(i64, i32, len(input_ids), num_seqs, len(sampled), len(fill_dst), max_blocks,
                          int(q_lens.max()), int(seq_lens.max()), sampled)

    def device_inputs(self, step: StepInputs, prev_token_ids: torch.Tensor | None = None) -> ModelInputs:
        """Two copies to the device; the inputs that are the previous step's sampled tokens are taken from
        prev_token_ids (on the device)."""
        lengths64, lengths32 = step.lengths()
        ids, pos, slot_mapping, logits_idx, dst, src = self._unpack(step.i64, lengths64)
        seq_lens_d, qsl_d, tables_d = self._unpack(step.i32, lengths32)
        if step.num_fill:
            ids = ids.index_copy(0, dst, prev_token_ids.index_select(0, src))
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, block_tables=tables_d.view(step.num_seqs, step.max_blocks),
            seq_lens=seq_lens_d, query_start_loc=qsl_d, max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len)
        return ModelInputs(ids, pos, meta, logits_idx, step.sampled_requests)

    def enable_cuda_graphs(self, max_model_len: int, decode: bool = True) -> None:
        """decode=False (a prefill worker, whose steps never decode) captures only the graphs for prompt steps."""
        from engine.cuda_graphs import DecodeGraphs, PrefillGraphs

        if self.driver is not None:  # every rank captures the same graphs in the same order (their collectives too)
            self.driver.call("enable_cuda_graphs", max_model_len, decode)
        sched = self.config.scheduler
        pool = None
        if decode:
            self.graphs = DecodeGraphs(self, sched.max_num_seqs, max_model_len)
            pool = self.graphs.pool
        max_tokens = min(self.config.model.max_prefill_cudagraph_tokens, sched.max_num_batched_tokens)
        if max_tokens > 0:
            self.prefill_graphs = PrefillGraphs(self, max_tokens, sched.max_num_seqs, max_model_len, pool)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_tables: np.ndarray | list[list[int]],
                prev: "StepHandle | None" = None, before_mask=None) -> "StepHandle":
        """Launches the step and returns without waiting for the device: the handle reads the sampled tokens.
        before_mask: Sampler.sample's (called once the forward pass is queued, before a grammar row's mask).
        With tensor parallelism the step goes to the workers first; a failure after that breaks the group
        (engine/collectives.WorkerError)."""
        step = self.step_inputs(sched, block_tables, prev)
        path = self.step_path(step)
        if self.driver is None:
            return self._execute(step, path, prev, share=False, before_mask=before_mask)
        share = self.share_sampled_tokens and step.num_sampled > 0
        self.driver.send_step(step, path, share)
        try:
            return self._execute(step, path, prev, share, before_mask)
        except Exception as e:
            raise self.driver.fail(f"rank 0's step failed: {e!r}") from e

    def step_path(self, step: StepInputs) -> tuple[int, int, int]:
        """(kind, tokens, rows): a prefill graph's key, the decode graphs, or eager."""
        if self.prefill_graphs is not None and step.max_query_len > 1:
            key = self.prefill_graphs.key_for(step.num_tokens, step.num_seqs)
            if key is not None:
                return PREFILL_GRAPH, key[0], key[1]
        if (self.graphs is not None and step.max_query_len == 1 and step.num_sampled == step.num_seqs
                and self.graphs.can_run(step.num_seqs)):
            return DECODE_GRAPH, 0, 0
        return EAGER, 0, 0

    def _execute(self, step: StepInputs, path: tuple[int, int, int], prev: "StepHandle | None",
                 share: bool, before_mask=None) -> "StepHandle":
        inputs = self.device_inputs(step, prev.token_ids if step.num_fill else None)
        logits = self.forward(inputs, path)
        sampled = inputs.sampled_requests
        if not sampled:
            done = None
            if self.device.type == "cuda":
                done = torch.cuda.Event()
                done.record()
            return StepHandle([], None, done)
        sample = self.sampler.sample(logits.float(), sampled, before_mask)
        if share:  # the workers' next inputs may be these tokens (engine/tp_worker.py)
            share_tokens(sample.token_ids)
        return StepHandle(sampled, sample)

    def forward(self, inputs: ModelInputs, path: tuple[int, int, int], logits: bool = True) -> torch.Tensor | None:
        """Runs the step on `path`; returns the sampled rows' logits (graphs always compute them; eagerly only
        when `logits`: a tensor-parallel worker needs none)."""
        m = inputs.meta
        kind, t, s = path
        if kind == PREFILL_GRAPH:
            return self.prefill_graphs.run((t, s), inputs.input_ids, inputs.positions, m, inputs.logits_indices)
        if kind == DECODE_GRAPH:
            return self.graphs.run(inputs.input_ids, inputs.positions, m.slot_mapping, m.block_tables, m.seq_lens,
                                   m.max_seq_len)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_layers, m)
        if logits and inputs.logits_indices.shape[0]:
            return self.model.compute_logits(hidden[inputs.logits_indices])
        return None

    @torch.inference_mode()
    def calibrate_kv_scales(self, token_ids: list[int] | None = None,
                            headroom: float = FP8_KV_HEADROOM) -> tuple[list[float], list[float]]:
        """Per-layer fp8 (e4m3) KV scales: the largest |K| and |V| each layer writes for token_ids (default: 256
        seeded random tokens) times headroom, mapped to at most 448 by a power of two (so x / scale and back are
        exact in every float format). e4m3 keeps 3 mantissa bits from 2**-6 to 448 whatever the scale: the scale
        only keeps values out of the subnormals below (40% of SmolLM2's layer-0 V values with scale 1.0) and from
        saturating above (a model with |K| past 448). Random tokens gave amaxes within 1.6x of real text on SmolLM2,
        hence the headroom. The prompt runs through the model into a scratch cache of the model's dtype; call this
        before CUDA graphs are captured (they keep the scales they were captured with)."""
        if token_ids is None:
            n = min(256, self.hf_config.max_position_embeddings)
            gen = torch.Generator().manual_seed(0)
            token_ids = torch.randint(0, self.hf_config.vocab_size, (n,), generator=gen).tolist()
        n, bs, dev = len(token_ids), self.block_size, self.device
        if n < 1:
            raise ValueError("token_ids: empty, the calibration needs at least one token")
        nb = cdiv(n, bs)
        cache = torch.zeros(nb, self.num_layers, 2, bs, self.num_kv_heads, self.head_dim, dtype=self.dtype,
                            device=dev)
        layers = [LayerKV(cache[:, l, 0], cache[:, l, 1]) for l in range(self.num_layers)]
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=dev), block_tables=torch.arange(nb, dtype=torch.int32,
                                                                                device=dev)[None],
            seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev), max_query_len=n, max_seq_len=n)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=dev)
        self.model(ids, torch.arange(n, device=dev), layers, meta)
        amax = cache.float().abs().amax(dim=(0, 3, 4, 5))  # [num_layers, 2]: (K, V) of each layer
        if self.tp_size > 1:
            # Every rank takes the largest over all KV heads, as one process would: the scales are the same whatever
            # the tensor-parallel size, so a KV transfer between engines of different sizes keeps its meaning.
            dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        amax = amax.tolist()
        del cache
        scales = [[2.0 ** math.ceil(math.log2(a * headroom / 448.0)) if math.isfinite(a) and a > 0 else 1.0
                   for a in layer] for layer in amax]
        log.info("fp8 KV scales (K, V) per layer: %s", [(round(k, 4), round(v, 4)) for k, v in scales])
        return [k for k, _ in scales], [v for _, v in scales]


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Tensor-parallel rank `rank`'s device: cuda:(base + its place on its host), base being the configured index or
    else the current device; the CPU for every rank otherwise."""
    device = config.device.torch_device
    if device.type != "cuda":
        return device
    base = device.index if device.index is not None else torch.cuda.current_device()
    return torch.device("cuda", base + rank % config.parallel.ranks_per_node)


def use_device(device: torch.device) -> None:
    """Makes `device` the calling thread's current CUDA device (a no-op on the CPU). Triton launches, CUDA graph
    replays and events go to the thread's current device, not to their tensors': a runner on cuda:1 stepped from a
    thread left on cuda:0 would launch its kernels on the wrong GPU. Every thread that steps an engine calls this."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def padded_block_tables(tables: list[list[int]]) -> np.ndarray:
    """[len(tables), the longest's length] int32: the block id lists, zero-padded."""
    out = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return out


class StepHandle:
    """A launched step: the requests that sample, in row order, and their tokens (on the device, and being copied
    to the host). Once `result()` returns, all of the step's device work is complete, its KV writes included."""

    def __init__(self, requests: list[Request], sample: DeviceSample | None, done: torch.cuda.Event | None = None):
        self.requests = requests
        self.sample = sample
        self._done = done  # a step that samples nothing: its end on the device
        # The next step's sampling must see this step's tokens on the host (penalties count output tokens,
        # min_tokens masks by output length): the engine reads this step before scheduling the next. (A grammar
        # needs them only by the next step's mask: LLMEngine.step reads them there.)
        self.needs_sync = sample is not None and sample.needs_host_tokens

    @property
    def token_ids(self) -> torch.Tensor:
        return self.sample.token_ids

    def result(self) -> SamplerOutput:
        """Waits for this step's tokens (not for steps launched after it)."""
        if self.sample is None:
            if self._done is not None:
                self._done.synchronize()
            return SamplerOutput(token_ids=[], logprobs=[])
        return self.sample.result()


def warm_up_attention(runner: ModelRunner) -> None:
    """Compiles every row-tile variant the prefill attention may pick, so that no step of a running server stalls
    on Triton's compiler (each variant is a compile; measured: bench/RESULTS.md)."""
    from kernels.paged_attention import paged_attention_triton, prefill_configs

    kv = runner.kv_layers[0]
    h = runner.num_heads  # this rank's
    dev = runner.device
    q = torch.zeros(32, h, runner.head_dim, dtype=runner.dtype, device=dev)
    # The step's own keys and values, as the model passes them (the kernel may read the chunk's keys from them).
    k = torch.zeros(32, runner.num_kv_heads, runner.head_dim, dtype=runner.dtype, device=dev)
    v = torch.zeros_like(k)
    tables = torch.zeros(1, 4, dtype=torch.int32, device=dev)
    seq_lens = torch.tensor([32], dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, 32], dtype=torch.int32, device=dev)
    kv_fp8 = runner.kv_dtype == torch.float8_e4m3fn
    for cfg in prefill_configs(h // runner.num_kv_heads, runner.head_dim, q.element_size(), kv_fp8=kv_fp8):
        try:
            paged_attention_triton(q, kv.k_cache, kv.v_cache, tables, seq_lens, qsl, 32, 32, 1.0, kv.k_scale,
                                   kv.v_scale, config=cfg, k=k, v=v, k_scale_cache=kv.k_scale_cache,
                                   v_scale_cache=kv.v_scale_cache)
        except Exception as e:  # a variant this head size cannot use (e.g. shared memory): never picked either
            log.debug("attention warm-up: block_m=%d skipped (%s)", cfg["block_m"], e)
    torch.cuda.synchronize()
