# Sourced by bench/cpu_vllm.sh and bench/cpu_overlap.sh: vLLM's own client with the issue's CPU workload (random
# prompts, 128 in / 32 out, 16 of them at --request-rate inf), `uptime` beside every run, and the table of results.
# Needs OUT (results folder), VENV (vLLM's venv: bench/vllm_cpu_setup.sh) and MODEL_DIR (the tokenizer's directory).

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

summary() {  # a row per result file in OUT
  "$PY" - "$OUT" <<'PY'
import json, pathlib, statistics, sys
rows = []
for f in sorted(pathlib.Path(sys.argv[1]).glob("*-seed*.json")):
    d = json.loads(f.read_text())
    rows.append(f"| {f.stem} | {d['completed']} | {d['request_throughput']:.2f} | {d['output_throughput']:.1f} | "
                f"{d['median_ttft_ms']:.0f} / {d['p99_ttft_ms']:.0f} | {d['median_itl_ms']:.0f} / {d['p99_itl_ms']:.0f} |")
print("| run | ok | req/s | out tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) |\n|---|---|---|---|---|---|")
print("\n".join(rows))
runs = {}
for f in pathlib.Path(sys.argv[1]).glob("*-seed*.json"):
    runs.setdefault(f.stem.rsplit("-seed", 1)[0], []).append(json.loads(f.read_text()))
med = lambda ds, k: statistics.median(d[k] for d in ds)
print("\n| server (median of runs) | runs | req/s | TTFT p50 (ms) | ITL p50 (ms) |\n|---|---|---|---|---|")
for name, ds in sorted(runs.items()):
    print(f"| {name} | {len(ds)} | {med(ds, 'request_throughput'):.2f} | {med(ds, 'median_ttft_ms'):.0f} | "
          f"{med(ds, 'median_itl_ms'):.0f} |")
PY
}
