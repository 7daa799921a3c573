#!/usr/bin/env bash
# One device call: Tandem's disaggregated stack (one prefill and one decode worker sharing the GPU) against one
# engine serving both phases in the router process (`tandem up --colocated`), behind the same OpenAI HTTP API.
# For each: start it, wait until ready, an idle-TTFT probe (single 512-token requests one at a time), a Poisson rate
# sweep (bench/serve.py), stop it. One comparison table last. Logs and JSON go to $OUT.
#   COMMIT=<sha> bash bench/gpu_serve.sh                  # H200: random:qwen2.5-7b in bf16 (about 5 minutes)
#   DEVICE=cpu MODEL=random:tiny NUM_PROMPTS=6 RATES=4,8 IDLE_PROBES=2 INPUT_LEN=64 OUTPUT_LEN=8 \
#       PYTHON=.venv/bin/python bash bench/gpu_serve.sh  # the same steps on the CPU, small
# Knobs (environment): MODEL DEVICE DTYPE KV_GIB (each engine's KV cache, GiB) MAX_MODEL_LEN INPUT_LEN OUTPUT_LEN
# MODES ("disaggregated colocated") NUM_PROMPTS (per rate) RATES IDLE_PROBES SLO_TTFT_MS SLO_ITL_MS PORT READY_TIMEOUT BENCH_TIMEOUT DEADLINE PYTHON OUT.
# The GPU image lacks FastAPI and uvicorn: carry them as wheels in .whl/ (docs/operations.md says which); they are
# installed into /tmp/site when `import fastapi` fails.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TANDEM_CACHE_DIR=${TANDEM_CACHE_DIR:-/tmp/tandem-cache}
OUT=${OUT:-/tmp/gpu_serve}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-random:qwen2.5-7b}
if [[ $DEVICE == cpu ]]; then DTYPE=${DTYPE:-auto}; KV_GIB=${KV_GIB:-0.25}; MAX_MODEL_LEN=${MAX_MODEL_LEN:-}
else DTYPE=${DTYPE:-bfloat16}; KV_GIB=${KV_GIB:-24}; MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}; fi
INPUT_LEN=${INPUT_LEN:-512}; OUTPUT_LEN=${OUTPUT_LEN:-128}; NUM_PROMPTS=${NUM_PROMPTS:-100}; RATES=${RATES:-4,8,16,32}
IDLE_PROBES=${IDLE_PROBES:-10}; SLO_TTFT_MS=${SLO_TTFT_MS:-200}; SLO_ITL_MS=${SLO_ITL_MS:-30}
PORT=${PORT:-8000}; READY_TIMEOUT=${READY_TIMEOUT:-240}; BENCH_TIMEOUT=${BENCH_TIMEOUT:-200}
DEADLINE=${DEADLINE:-0}  # seconds the whole script may take (0: no limit); each step's timeout is cut to fit
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export TANDEM_COMMIT=${TANDEM_COMMIT:-$COMMIT}  # bench/common.py records it where the tree has no .git

if ! $PY -c "import fastapi, uvicorn" 2>/dev/null; then
  if ! compgen -G ".whl/*.whl" >/dev/null; then echo "gpu_serve.sh: no fastapi/uvicorn and no .whl/ to install them from"; exit 1; fi
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
$PY -c "import torch, triton, transformers, grpc, fastapi, uvicorn; print('commit $COMMIT; torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'grpc', grpc.__version__, 'fastapi', fastapi.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no cuda')"

engine_flags=(--device "$DEVICE" --model "$MODEL" --dtype "$DTYPE" --kv-cache-memory "$KV_GIB")
[[ -n $MAX_MODEL_LEN ]] && engine_flags+=(--max-model-len "$MAX_MODEL_LEN")

# cap SECONDS RESERVE: SECONDS, cut so that RESERVE seconds of DEADLINE are left afterwards (at least 10).
cap() {
  local t=$1
  if (( DEADLINE > 0 )); then local left=$((DEADLINE - SECONDS - $2)); (( left < t )) && t=$left; fi
  (( t < 10 )) && t=10
  echo $t
}

# serve_mode NAME RESERVE [tandem up flags...]: start, wait for ready, probe and sweep, stop; RESERVE seconds of the
# DEADLINE are kept for what comes after. Returns 1 on any failure.
serve_mode() {
  local name=$1 reserve=$2; shift 2
  local log="$OUT/$name.server.log" t0=$SECONDS status=0 ready_timeout bench_timeout
  ready_timeout=$(cap "$READY_TIMEOUT" $((reserve + 40)))
  $PY -m cli up "${engine_flags[@]}" --http-port "$PORT" --grpc-port $((PORT + 1)) \
      --worker-port $((PORT + 10)) --metrics-port $((PORT + 20)) "$@" >"$log" 2>&1 &
  local pid=$!
  until grep -q "tandem up: ready" "$log"; do
    if ! kill -0 $pid 2>/dev/null; then echo "$name: tandem up exited before ready:"; tail -25 "$log"; return 1; fi
    if (( SECONDS - t0 > ready_timeout )); then echo "$name: not ready after ${ready_timeout}s"; status=1; break; fi
    sleep 1
  done
  if (( status == 0 )); then
    echo "$name: ready after $((SECONDS - t0)) s"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader \
        | sed "s/^/$name: GPU memory used, total: /"
    local metrics=()
    [[ $name == disaggregated ]] && metrics=(--metrics-url "http://127.0.0.1:$PORT/metrics" --metrics-url "http://127.0.0.1:$((PORT + 20))/metrics")
    bench_timeout=$(cap "$BENCH_TIMEOUT" $((reserve + 20)))
    timeout "$bench_timeout" $PY bench/serve.py --base-url "http://127.0.0.1:$PORT" --model "$MODEL" \
        --dataset-name random --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --num-prompts "$NUM_PROMPTS" \
        --request-rates "$RATES" --idle-ttft-probes "$IDLE_PROBES" --idle-input-len "$INPUT_LEN" \
        --slo-ttft-ms "$SLO_TTFT_MS" --slo-itl-ms "$SLO_ITL_MS" "${metrics[@]}" \
        --result-file "$OUT/$name.json" >"$OUT/$name.bench.log" 2>&1
    status=$?
    (( status == 124 )) && echo "$name: bench/serve.py stopped after ${bench_timeout}s (DEADLINE / BENCH_TIMEOUT)"
    grep -E "^idle TTFT|^rate |^error|Error|Traceback" "$OUT/$name.bench.log" | sed "s/^/$name: /"
  fi
  kill -INT $pid 2>/dev/null; wait $pid
  grep -E "Traceback|ERROR|exited with status" "$log" | head -5 | sed "s/^/$name server: /"
  echo "$name: done after $((SECONDS - t0)) s (bench status $status)"
  return $status
}

# The colocated run needs about 60 s to start and as long to sweep: keep that much of the DEADLINE for it.
MODES=${MODES:-disaggregated colocated}
[[ " $MODES " == *" disaggregated "* ]] && serve_mode disaggregated $([[ " $MODES " == *" colocated "* ]] && echo 150 || echo 5) --prefill 1 --decode 1
[[ " $MODES " == *" colocated "* ]] && serve_mode colocated 5 --colocated

files=()
for name in disaggregated colocated; do [[ -f $OUT/$name.json ]] && files+=("$name=$OUT/$name.json"); done
echo
echo "## $MODEL on $DEVICE, commit $COMMIT: $NUM_PROMPTS requests per rate, $INPUT_LEN in / $OUTPUT_LEN out, KV ${KV_GIB} GiB per engine"
if (( ${#files[@]} )); then $PY bench/serve.py --compare "${files[@]}" | tee "$OUT/compare.md"; else echo "no results"; exit 1; fi
