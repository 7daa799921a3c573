#!/usr/bin/env bash
# One device call: engine checks on CUDA, then latency, throughput and the decode-step profile. Logs go to $OUT.
#   TANDEM_COMMIT=<sha> bash bench/gpu_engine.sh [stage ...]
# stages: parity latency perf profile (the default: these four), checks (kernel tests + parity side by side), kvx
# (KV transfer paths), ttft (idle disaggregated stack, through bench/gpu_serve.sh), build (the engine's model build
# on CUDA: build_model's tests, fp8 checkpoints, and the build's peak GPU memory against the final model's size),
# w4 (4-bit AWQ weights against bf16), swap (a preempting workload, swap vs recompute), hosttier (8k-prefix TTFT
# from the host KV tier), trtprofile (issue 19: profiles of TensorRT-LLM's workloads' decode and prompt steps), trt
# (issue 19: bench/trtllm.py's four workloads, per KV dtype)
# Env: NP/OL/IL (throughput prompts, output and input length), BACKENDS ("tandem hf"), MNS (max_num_seqs list,
# e.g. "256 512"), MBT (max_num_batched_tokens), VARIANTS (engine flag sets for latency and perf, separated by
# ";", e.g. VARIANTS=";--kv-cache-dtype fp8;--quantization fp8 --kv-cache-dtype fp8": "" is the bf16 default).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TANDEM_CACHE_DIR=/tmp/tandem-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import torch, triton, transformers, google.protobuf as pb, grpc; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'protobuf', pb.__version__, 'grpc', grpc.__version__, torch.cuda.get_device_name())"
stages=${*:-parity latency perf profile}
M="--model random:qwen2.5-7b --dtype bfloat16"
for stage in $stages; do
  t0=$SECONDS
  case $stage in
    checks)  # correctness only, side by side: the CUDA kernel tests (not the prefill candidates) and engine parity
      # (in parallel the kernel tests take ~200 s on the H200: 113 of 121 ran in 150 s)
      timeout ${CHECKS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider tests/kernels -k "not candidates" \
        > "$OUT/test_kernels.log" 2>&1 &
      timeout ${CHECKS_TIMEOUT:-300} python3 -m pytest -q -s -p no:cacheprovider tests/engine/test_cuda_parity.py \
        > "$OUT/parity.log" 2>&1 &
      wait
      tail -2 "$OUT/test_kernels.log"; grep -E "passed|failed|bf16 vs|agree|^E " "$OUT/parity.log" | tail -12 ;;
    build)
      timeout ${BUILD_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider tests/engine/test_build_model.py \
        tests/engine/test_quant.py 2>&1 | tee "$OUT/build.log" | grep -E "passed|failed|^E " | tail -8
      timeout 200 python3 -c "
import torch
from engine.loader import build_model, resolve_model
r = resolve_model('random:qwen2.5-7b')
torch.cuda.reset_peak_memory_stats()
m = build_model(r, torch.bfloat16, 'cuda', None, 0)
size = sum(t.numel() * t.element_size() for t in {id(p): p for p in m.parameters()}.values())
print(f'build: model {size / 2**30:.2f} GiB, peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB')
" 2>&1 | tail -2 ;;
    parity)
      timeout 300 python3 -m pytest -q -s tests/engine/test_cuda_parity.py -p no:cacheprovider 2>&1 | tee "$OUT/parity.log" \
        | grep -E "passed|failed|Error|bf16 vs|agree|^E " | tail -25 ;;
    latency)
      IFS=';' read -ra variants <<< "${VARIANTS:-}"; [[ ${#variants[@]} == 0 ]] && variants=("")
      for a in ${LAT_MODES:-async-scheduling no-async-scheduling}; do for v in "${variants[@]}"; do
        tag="$a${v// /}"
        timeout 200 python3 bench/latency.py $M --$a $v --json "$OUT/latency-$tag.json" 2>&1 | tee "$OUT/latency-$tag.log" | tail -4
      done; done ;;
    perf)
      first=1
      IFS=';' read -ra variants <<< "${VARIANTS:-}"; [[ ${#variants[@]} == 0 ]] && variants=("")
      for mns in ${MNS:-256}; do for mbt in ${MBT:-8192}; do for v in "${variants[@]}"; do
        b=${BACKENDS:-tandem}; [[ $first == 1 ]] || b=tandem; first=0
        echo "-- max_num_seqs $mns, max_num_batched_tokens $mbt ${v:-(bf16)}"
        timeout 400 python3 bench/throughput.py $M --num-prompts ${NP:-500} --input-len ${IL:-512} \
          --output-len ${OL:-256} --max-num-seqs $mns --max-num-batched-tokens $mbt --backend $b $v \
          --out-dir "$OUT" 2>&1 | tee "$OUT/throughput-$mns-$mbt${v// /}.log" | grep -v "^ *$" | tail -7
      done; done; done ;;
    kvx)  # both KV transfer paths (bench/kv_transfer.py's own defaults: 512 and 8192 tokens)
      timeout ${KVX_TIMEOUT:-150} python3 bench/kv_transfer.py $M --device cuda ${KVX_ARGS:-} --json "$OUT/kv_transfer.json" 2>&1 \
        | tee "$OUT/kv_transfer.log" | tail -12 ;;
    ttft)  # the idle disaggregated stack: TTFT of 512-token prompts one at a time, and one short rate
      MODES=disaggregated RATES=${TTFT_RATES:-8} NUM_PROMPTS=${TTFT_PROMPTS:-40} IDLE_PROBES=10 DEADLINE=${TTFT_DEADLINE:-170} \
        OUT="$OUT/serve" COMMIT=${TANDEM_COMMIT:-unknown} bash bench/gpu_serve.sh 2>&1 | tail -8 ;;
    w4)  # issue 17: a random AWQ Qwen2.5-7B (bench/w4_checkpoint.py) against bf16: batch-1 decode, then 500 x 512/256
      W4=/tmp/qwen2.5-7b-awq; [[ -d $W4 ]] || timeout 300 python3 bench/w4_checkpoint.py --preset qwen2.5-7b --out $W4
      for m in "$M" "--model $W4 --quantization awq --dtype float16"; do
        tag=$([[ $m == *awq* ]] && echo w4 || echo bf16)
        timeout 200 python3 bench/latency.py $m --async-scheduling --json "$OUT/latency-$tag.json" 2>&1 \
          | tee "$OUT/latency-$tag.log" | tail -3
        timeout 300 python3 bench/throughput.py $m --num-prompts ${NP:-500} --input-len ${IL:-512} \
          --output-len ${OL:-256} --max-num-seqs ${MNS:-256} --max-num-batched-tokens ${MBT:-8192} --out-dir "$OUT" \
          2>&1 | tee "$OUT/throughput-$tag.log" | grep -v "^ *$" | tail -4
      done ;;
    swap)  # issue 17: a workload that preempts (a small pool, the admission watermark off): swap vs recompute
      for mode in swap recompute; do
        echo "-- preemption-mode $mode"
        timeout 300 python3 bench/throughput.py $M --num-prompts ${SWAP_NP:-300} --input-len 512 --output-len 256 \
          --max-num-seqs 256 --num-gpu-blocks-override ${SWAP_BLOCKS:-2000} --new-token-ratio 0 \
          --swap-space ${SWAP_GIB:-16} --preemption-mode $mode --out-dir "$OUT" 2>&1 \
          | tee "$OUT/swap-$mode.log" | grep -v "^ *$" | tail -4
      done ;;
    hosttier)  # issue 17: TTFT of an 8k-token prefix from the host tier vs recomputing it
      timeout 300 python3 bench/host_tier.py $M --prefix-len ${PREFIX:-8192} --swap-space 8 --num-iters 3 \
        --json "$OUT/host_tier.json" 2>&1 | tee "$OUT/host_tier.log" | tail -8 ;;
    profile)
      for b in ${BATCH:-256}; do
        timeout ${PROFILE_TIMEOUT:-300} python3 bench/profile_decode.py $M --batch $b --input-len 512 \
          --steps ${PROFILE_STEPS:-30} --prefill-tokens ${PREFILL_TOKENS:-8192} \
          --json "$OUT/profile-$b.json" 2>&1 | tee "$OUT/profile-$b.log" | grep -v "^ *$" | tail -${PROFILE_LINES:-40}
      done ;;
    trtprofile)  # issue 19: TensorRT-LLM's workloads' steps, Llama-3-8B shape, fp8 weights, per KV dtype: decode at
      # batch ~980 with 128-token prompts (128/128's steady state) and a prompt step of 4 x 2048 tokens (2048/128's)
      for kv in ${KV:-fp8 auto}; do
        timeout ${PROFILE_TIMEOUT:-300} python3 bench/profile_decode.py --model random:llama-3-8b --quantization fp8 \
          --kv-cache-dtype $kv --batch ${TRT_BATCH:-980} --max-num-seqs 1024 --input-len 128 --steps 20 \
          --prefill-tokens 8192 --json "$OUT/trt-decode-$kv.json" 2>&1 | tee "$OUT/trt-decode-$kv.log" \
          | grep -v "^ *$" | tail -${PROFILE_LINES:-40}
        timeout ${PROFILE_TIMEOUT:-300} python3 bench/profile_decode.py --model random:llama-3-8b --quantization fp8 \
          --kv-cache-dtype $kv --batch 4 --input-len 2048 --steps 5 --prefill-tokens 8192 \
          --json "$OUT/trt-prefill-$kv.json" 2>&1 | tee "$OUT/trt-prefill-$kv.log" | grep -A12 "prefill step"
      done ;;
    trt)  # issue 19: TensorRT-LLM's four workloads at the published prompt counts (~5 min per KV dtype on the H200);
      # SCALE=0.25 for a quick A/B, TRT_WORKLOADS to pick some
      for kv in ${KV:-fp8 auto}; do
        timeout ${TRT_TIMEOUT:-420} python3 bench/trtllm.py --kv-cache-dtype $kv --scale ${SCALE:-1} \
          ${TRT_WORKLOADS:+--workloads $TRT_WORKLOADS} --out-dir "$OUT" 2>&1 | tee "$OUT/trt-$kv.log" \
          | grep -E "built in|decode |prefill/mixed|^ *[0-9]+/[0-9]+ "
      done ;;
  esac
  echo "== stage $stage: $((SECONDS - t0)) s"
done
