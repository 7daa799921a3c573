#!/usr/bin/env bash
# One device call: the same two benchmarks on two source trees, interleaved on one GPU (before, after, before,
# after, ...), so that a change that should not move speed (a refactor) is checked against the spread of the runs
# themselves. Logs and JSON go to $OUT; the last lines are the table.
#   BEFORE=.carry/before BEFORE_COMMIT=<sha> AFTER_COMMIT=<sha> bash bench/gpu_compare.sh   # AFTER: this tree
# Make the other tree with `mkdir -p .carry/before && git archive <rev> | tar -x -C .carry/before` and carry .carry.
# Env: MODEL (random:qwen2.5-7b), DTYPE (bfloat16), ROUNDS (2), NP/IL/OL (500/512/256), MNS (256), MBT (8192).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TANDEM_CACHE_DIR=/tmp/tandem-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BEFORE=$(cd "${BEFORE:?BEFORE: the tree to compare with}" && pwd); AFTER=$(cd "${AFTER:-.}" && pwd)
M="--model ${MODEL:-random:qwen2.5-7b} --dtype ${DTYPE:-bfloat16}"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
for round in $(seq "${ROUNDS:-2}"); do
  for tag in before after; do
    dir=$BEFORE; export TANDEM_COMMIT=${BEFORE_COMMIT:-unknown}
    [[ $tag == after ]] && dir=$AFTER && export TANDEM_COMMIT=${AFTER_COMMIT:-unknown}
    t0=$SECONDS
    (cd "$dir" && timeout 200 python3 bench/latency.py $M --json "$OUT/latency-$tag-$round.json") \
      > "$OUT/latency-$tag-$round.log" 2>&1 || echo "latency $tag $round failed: $(tail -1 "$OUT/latency-$tag-$round.log")"
    (cd "$dir" && timeout 300 python3 bench/throughput.py $M --num-prompts "${NP:-500}" --input-len "${IL:-512}" \
      --output-len "${OL:-256}" --max-num-seqs "${MNS:-256}" --max-num-batched-tokens "${MBT:-8192}" \
      --backend tandem --out-dir "$OUT/throughput-$tag-$round") > "$OUT/throughput-$tag-$round.log" 2>&1 \
      || echo "throughput $tag $round failed: $(tail -1 "$OUT/throughput-$tag-$round.log")"
    echo "== $tag round $round: $((SECONDS - t0)) s"
  done
done
python3 - "$OUT" "${BEFORE_COMMIT:-}" "${AFTER_COMMIT:-}" <<'EOF'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = {}
for tag in ("before", "after"):
    lat = [json.loads(p.read_text()) for p in sorted(out.glob(f"latency-{tag}-*.json"))]
    tp = [json.loads(p.read_text()) for p in sorted(out.glob(f"throughput-{tag}-*/*.json"))]
    rows[tag] = ([r.get("decode_tokens_per_s") for r in lat], [r.get("ttft_ms") for r in lat],
                 [r.get("output_tokens_per_s") for r in tp],
                 # (the device machine's git metadata may be another commit's: the caller's word comes first)
                 sys.argv[2 if tag == "before" else 3] or (lat[0].get("commit") if lat else "?"))
print(f"{'tree':7s} {'commit':>10s} {'batch-1 tok/s':>28s} {'TTFT ms':>22s} {'offline out tok/s':>30s}")
for tag, (dec, ttft, tput, commit) in rows.items():
    f = lambda xs: " / ".join(f"{x:.1f}" for x in xs if x is not None) or "-"
    print(f"{tag:7s} {str(commit)[:10]:>10s} {f(dec):>28s} {f(ttft):>22s} {f(tput):>30s}")
b, a = rows["before"], rows["after"]
for name, i in (("batch-1 decode", 0), ("offline throughput", 2)):
    if b[i] and a[i] and all(x is not None for x in b[i] + a[i]):
        mb, ma = statistics.median(b[i]), statistics.median(a[i])
        print(f"{name}: after / before = {ma / mb:.4f} (medians {ma:.1f} vs {mb:.1f}); "
              f"spread within a tree: before {min(b[i]):.1f}-{max(b[i]):.1f}, after {min(a[i]):.1f}-{max(a[i]):.1f}")
EOF
