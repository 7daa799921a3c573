#!/usr/bin/env bash
# Tandem beside vLLM on the CPU, back to back on one machine (bench/RESULTS.md, "CPU: Tandem beside vLLM"):
# vLLM's CPU build (`vllm serve`), `tandem up` (router + 1 prefill + 1 decode) and `tandem up --colocated`, each
# started alone and driven by vLLM's own client with the issue's workload, then stopped; ROUNDS rounds, each with
# its own --seed (fresh prompts: no prefix-cache hits from an earlier run), `uptime` beside every number.
#
#   bash bench/cpu_vllm.sh [ROUNDS]      (VLLM_VENV: vLLM's venv, default ../vllm-venv: bench/vllm_cpu_setup.sh;
#                                         FIRST_ROUND=3: more rounds into the same OUT, seeds 300, 400, ...;
#                                         VLLM_BINDS="auto 0-1": vLLM once per VLLM_CPU_OMP_THREADS_BIND value,
#                                         auto being its default, one compute core and one left to its server)
#
# Optional: nothing else in Tandem needs vLLM. bench/serve.py runs the same workload against any of the three
# (--dataset-name random --input-len 128 --output-len 32 --num-prompts 16 --request-rate inf); vLLM's client is
# used here so that every server is measured by the same code as vLLM measures itself.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${1:-2}"
VENV="${VLLM_VENV:-$(cd .. && pwd)/vllm-venv}"
PY="${PYTHON:-.venv/bin/python}"
OUT="${OUT:-bench/results/cpu-vllm}"
mkdir -p "$OUT"
MODEL_DIR=$("$PY" -c "from engine.loader import resolve_model; print(resolve_model('smollm2').weights_dir)")
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

source bench/cpu_client.sh

for round in $(seq 1 "$ROUNDS"); do
  seed=$(((round + ${FIRST_ROUND:-1} - 1) * 100))
  for bind in ${VLLM_BINDS:-auto}; do
    name=vllm; [ "$bind" = auto ] || name="vllm-bind-$bind"
    VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND="$bind" "$VENV/bin/vllm" serve \
      "$MODEL_DIR" --dtype float32 --served-model-name smollm2 --port 8100 > "$OUT/$name-serve.log" 2>&1 &
    pid=$!; wait_ready http://127.0.0.1:8100/v1/models "$OUT/$name-serve.log"; client "$name" 8100 $seed; stop $pid
  done
  for mode in disaggregated colocated; do
    flag=(); [ "$mode" = colocated ] && flag=(--colocated)
    "$PY" -m cli up --model smollm2 --dtype float32 "${flag[@]}" > "$OUT/tandem-$mode.log" 2>&1 &
    pid=$!; wait_ready http://127.0.0.1:8000/health "$OUT/tandem-$mode.log"; client "tandem-$mode" 8000 $seed
    stop $pid
  done
done
summary
