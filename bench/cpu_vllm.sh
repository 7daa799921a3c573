#!/usr/bin/env bash
# Tandem beside vLLM on the CPU, back to back on one machine (bench/RESULTS.md, "CPU: Tandem beside vLLM"):
# vLLM's CPU build (`vllm serve`), `tandem up` (router + 1 prefill + 1 decode) and `tandem up --colocated`, each
# started alone and driven by vLLM's own client with the issue's workload, then stopped; ROUNDS rounds, each with
# its own --seed (fresh prompts: no prefix-cache hits from an earlier run), `uptime` beside every number.
#
#   bash bench/cpu_vllm.sh [ROUNDS]      (VLLM_VENV: vLLM's venv, default ../vllm-venv: bench/vllm_cpu_setup.sh)
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

wait_ready() {  # URL LOG
  for _ in $(seq 1 900); do curl -sf "$1" >/dev/null && return 0; sleep 1; done
  echo "not ready: $1 (see $2)" >&2; return 1
}

client() {  # NAME PORT SEED
  echo "$1 seed $3 load before: $(uptime)" | tee -a "$OUT/load.txt"
  VLLM_TARGET_DEVICE=cpu "$VENV/bin/vllm" bench serve --backend openai --base-url "http://127.0.0.1:$2" \
    --model "$MODEL_DIR" --served-model-name smollm2 --dataset-name random --random-input-len 128 \
    --random-output-len 32 --num-prompts 16 --request-rate inf --ignore-eos --seed "$3" \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
    --save-result --result-dir "$OUT" --result-filename "$1-seed$3.json" > "$OUT/$1-seed$3.log" 2>&1
  echo "$1 seed $3 load after: $(uptime)" | tee -a "$OUT/load.txt"
}

stop() { kill -INT "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }

for round in $(seq 1 "$ROUNDS"); do
  seed=$((round * 100))
  VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2 "$VENV/bin/vllm" serve "$MODEL_DIR" --dtype float32 \
    --served-model-name smollm2 --port 8100 > "$OUT/vllm-serve.log" 2>&1 &
  pid=$!; wait_ready http://127.0.0.1:8100/v1/models "$OUT/vllm-serve.log"; client vllm 8100 $seed; stop $pid
  for mode in disaggregated colocated; do
    flag=(); [ "$mode" = colocated ] && flag=(--colocated)
    "$PY" -m cli up --model smollm2 --dtype float32 "${flag[@]}" > "$OUT/tandem-$mode.log" 2>&1 &
    pid=$!; wait_ready http://127.0.0.1:8000/health "$OUT/tandem-$mode.log"; client "tandem-$mode" 8000 $seed
    stop $pid
  done
done
"$PY" - "$OUT" <<'PY'
import json, pathlib, sys
rows = []
for f in sorted(pathlib.Path(sys.argv[1]).glob("*-seed*.json")):
    d = json.loads(f.read_text())
    rows.append(f"| {f.stem} | {d['completed']} | {d['request_throughput']:.2f} | {d['output_throughput']:.1f} | "
                f"{d['median_ttft_ms']:.0f} / {d['p99_ttft_ms']:.0f} | {d['median_itl_ms']:.0f} / {d['p99_itl_ms']:.0f} |")
print("| run | ok | req/s | out tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) |\n|---|---|---|---|---|---|")
print("\n".join(rows))
PY
