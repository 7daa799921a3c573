#!/usr/bin/env bash
# One device call: engine checks on CUDA, then throughput and latency. Logs go to $OUT.
#   bash bench/gpu_engine.sh [all|parity|perf|latency]
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TANDEM_CACHE_DIR=/tmp/tandem-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import torch, triton, transformers, google.protobuf as pb, grpc; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'protobuf', pb.__version__, 'grpc', grpc.__version__, torch.cuda.get_device_name())"
stage=${1:-all}
if [[ $stage == all || $stage == parity ]]; then
  timeout 300 python3 -m pytest -q -s tests/engine/test_cuda_parity.py -p no:cacheprovider 2>&1 | tee "$OUT/parity.log" | grep -E "passed|failed|Error|bf16 vs|agree|^E " | tail -25
fi
if [[ $stage == all || $stage == latency ]]; then
  timeout 200 python3 bench/latency.py --model random:qwen2.5-7b --dtype bfloat16 --json "$OUT/latency.json" 2>&1 | tee "$OUT/latency.log" | tail -5
fi
if [[ $stage == all || $stage == perf ]]; then
  timeout 400 python3 bench/throughput.py --model random:qwen2.5-7b --dtype bfloat16 --num-prompts ${NP:-200} \
      --input-len 512 --output-len ${OL:-128} --backend ${BACKENDS:-tandem} --out-dir "$OUT" 2>&1 | tee "$OUT/throughput.log" | tail -15
fi
