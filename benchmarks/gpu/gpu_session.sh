#!/usr/bin/env bash
# One call on a lent GPU machine (docs/gpu.md): the GPU check, then the GPU contrastive study, within SECONDS
# (default 540), results packed into OUT as they come.
#
#   bash benchmarks/gpu/gpu_session.sh OUT [SECONDS] [STUDY_SECONDS]
#
# Needs, prepared on a machine with the network: `make gpu-wheels` (.whl/: gguf and the MiniLM encoder in
# float16, benchmarks/gpu/gpu_assets.py). Then, one after the other (each has the machine alone: side by side, the
# suite's workers and the study's processes starve each other of CPU, and the suite runs out of time):
#   1. the check (benchmarks/gpu/gpu_check.sh), stopped at SECONDS - STUDY_SECONDS (default: a third of SECONDS
#      for the study), with whatever it finished;
#   2. the study (benchmarks/studies/contrastive_study.py --gpu: 3 seeds in parallel processes) until SECONDS are
#      spent; it stops with Ctrl-C (each cell checkpoints) and continues in a later call on the same machine.
# OUT gets check.tgz (the check's folder), study.tgz (the study's WORK without models and checkpoints: its JSON
# and logs) and session.log, re-packed every 15 s, so that a call stopped at its limit still brings back what was
# done.
set -uo pipefail
OUT=${1:?usage: bash benchmarks/gpu/gpu_session.sh OUT [SECONDS] [STUDY_SECONDS]}
BUDGET=${2:-540}
STUDY_SECONDS=${3:-$(( BUDGET / 3 ))}
cd "$(dirname "$0")/.."
started=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - started) )); }
PY=${PYTHON:-python3}
CHECK=/tmp/upcycle-gpu-check
WORK=/tmp/upcycle-gpu-study
mkdir -p "$OUT" "$CHECK" "$WORK"
exec > >(tee -a "$OUT/session.log") 2>&1

$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/upcycle-site \
    .whl/*.whl || exit 1
$PY benchmarks/gpu/gpu_assets.py unpack .whl/minilm16 /tmp/upcycle-minilm || exit 1
STUDY_PATH=$PWD/src:/tmp/upcycle-minilm:/tmp/upcycle-site${PYTHONPATH:+:$PYTHONPATH}

pack() {
    tar -C "$(dirname $CHECK)" -czf "$OUT/.check.tgz" "$(basename $CHECK)" 2>/dev/null && mv "$OUT/.check.tgz" "$OUT/check.tgz"
    tar -C "$(dirname $WORK)" -czf "$OUT/.study.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' \
        "$(basename $WORK)" 2>/dev/null && mv "$OUT/.study.tgz" "$OUT/study.tgz"
}
( while sleep 15; do pack; done ) &
PACKER=$!

echo "[session] check: $(date -u +%T), $(left) s left"
GPU_CHECK_SECONDS=$(( $(left) - STUDY_SECONDS - 10 )) timeout $(( $(left) - STUDY_SECONDS )) \
    bash benchmarks/gpu/gpu_check.sh "$CHECK"
[ -f "$CHECK/summary.json" ] || $PY benchmarks/gpu/gpu_summary.py "$CHECK"      # the check stopped at its time limit
echo "[session] study: $(date -u +%T), $(left) s left"
if [ "$(left)" -gt 40 ]; then
    PYTHONPATH=$STUDY_PATH PYTHONUNBUFFERED=1 $PY benchmarks/studies/contrastive_study.py --gpu --work "$WORK" \
        --deadline $(( $(left) - 30 )) --results "$WORK/collected" >> "$WORK/runner.log" 2>&1
fi
echo "[session] study stopped: $(date -u +%T), $(left) s left"
kill "$PACKER" 2>/dev/null
pack
head -c 2500 "$CHECK/summary.json"
echo; tail -n 3 "$WORK/runner.log"
