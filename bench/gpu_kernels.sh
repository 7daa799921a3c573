#!/usr/bin/env bash
# One device call for issue 4's kernels: the CUDA kernel tests (full shapes, every prefill candidate), the engine's
# fp32/bf16/fp8 parity tests, then, alone on the GPU, attention timings (decode at batch 64 x 4k, prefill at 4k
# chunks) and the prefill sweep. Logs and JSON go to $OUT; a summary table is printed last.
#   COMMIT=<hash> bash bench/gpu_kernels.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TANDEM_CACHE_DIR=/tmp/tandem-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
echo "commit ${COMMIT:-?}  $(date -u +%FT%TZ)" | tee "$OUT/meta.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader | tee -a "$OUT/meta.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/meta.txt"

# Phase 1, side by side (correctness only, nothing timed): kernel tests in two processes, the engine parity tests,
# and every launch phase 2 will time, once (fills Triton's cache, so phase 2 times compiled kernels only).
run() {  # name timeout command...
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/$name.log"
}
run test_candidates 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_paged_attention.py -k candidates &
run test_kernels 200 python3 -m pytest -q -p no:cacheprovider tests/kernels -k "not candidates" &
run parity 210 python3 -m pytest -q -s -p no:cacheprovider tests/engine/test_cuda_parity.py &
run compile 150 python3 bench/kernels.py --only attention --quick --sweep --compile-only &
wait
echo "phase 1 done after $(( $(date +%s) - t0 )) s"

# Phase 2, alone on the GPU: timings.
run bench 90 python3 bench/kernels.py --only attention --quick --sweep --json "$OUT/kernels.json"
echo "phase 2 done after $(( $(date +%s) - t0 )) s"

python3 - "$OUT" <<'EOF'
import re, sys
from pathlib import Path
out = Path(sys.argv[1])
def tail(name, pat):
    p = out / f"{name}.log"
    return [l for l in p.read_text().splitlines() if re.search(pat, l)] if p.exists() else [f"({name}.log missing)"]
print("\n===== summary =====")
print(*tail("meta", "."), sep="\n")
for name in ("test_candidates", "test_kernels", "parity", "compile"):
    res = tail(name, r"passed|failed|error|^exit|^FAILED|^ERROR")
    print(f"{name:16s} " + " | ".join(res[-6:]))
print(*tail("parity", r"bf16 vs fp32|transformers bf16|fp8 vs bf16|yardstick|top-2|fp8 KV scales"), sep="\n")
print(*tail("bench", r"measured copy|^decode_attn|^prefill_attn|compiled:|^BEST|^exit"), sep="\n")
EOF
