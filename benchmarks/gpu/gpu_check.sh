#!/usr/bin/env bash
# The GPU check: every change to a GPU path is checked with this, in one call on a bare GPU machine whose python3
# has torch, transformers and accelerate but not this project's virtual environment (the device tool's H100/H200).
#
#   bash benchmarks/gpu/gpu_check.sh OUT [--quick]
#
# It installs nothing from the network: wheels the image lacks (gguf: `make gpu-wheels` fetches it here into .whl/)
# are installed from .whl/ when that folder is there, and the project runs from src/ on PYTHONPATH. Then, into OUT,
# speed first (a call stopped at its limit still brings the layer rows and the training step back), then the suite,
# then the rest, each later part only while GPU_CHECK_SECONDS (default 510) leaves it room (else it says so):
#   environment.json                   the machine, torch, CUDA, transformers
#   train_mfu.json                     real size first: SmolLM2-1.7B's shapes (Llama-3.2-1B's on a card under
#                                      100 GB), dense, upcycled every other block, transformers' Qwen3-MoE and
#                                      Mixtral, torchtitan's Qwen3-MoE: MFU, tokens/s, peak memory beside the plan
#   moe_layer_cuda_bfloat16.json       the MoE layer at the six (shape, tokens) rows, bf16, fwd and fwd+bwd
#   train_step_cuda.json               whole-model training step: dense, upcycle, stock Mixtral / Qwen3-MoE
#   profile_MODEL.json                 two steps of dense, upcycle every-block and Mixtral under torch.profiler:
#                                      the GPU's idle share and the top kernels
#   junit.xml, pytest.log              the non-slow suite (a test needing an embedded asset skips itself), in the
#                                      time left less 20 s (GPU_CHECK_SUITE_SECONDS overrides)
#   tests.jsonl                        each test's outcome as it finished (tests/live_report.py): what a suite
#                                      stopped at its time limit still tells
#   assert_hunt.log                    only if a device-side assert appeared: the suspect files rerun one at a time
#                                      with CUDA_LAUNCH_BLOCKING=1, to name the kernel launch that asserts
#   moe_layer_cuda_float32.json        the layer in float32 and TF32 at one size each (what float32 takes)
#   train_step_cuda_compile.json       the training step under torch.compile, dense and upcycle's every-block MoE
#   summary.json                       all of the above in one file (benchmarks/gpu/gpu_summary.py)
# On a machine without a GPU it runs the suite on the CPU and skips the benchmarks, saying so. --quick: fewer
# repetitions and tokens (a smoke run of the script itself).
# GPU_CHECK_WORKERS: the suite's pytest-xdist processes (default: the cores, at most 14).
set -uo pipefail
OUT=${1:?usage: bash benchmarks/gpu/gpu_check.sh OUT [--quick]}
QUICK=${2:-}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/upcycle-site \
        .whl/*.whl && export PYTHONPATH=/tmp/upcycle-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
started=$(date +%s)

$PY - > "$OUT/environment.json" <<'EOF'
import json, os, platform, torch, transformers
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "transformers": transformers.__version__, "cpus": os.cpu_count(), "gpu": None}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, gpu_memory_bytes=p.total_memory, capability=list(torch.cuda.get_device_capability(0)))
print(json.dumps(info, indent=1))
EOF
cat "$OUT/environment.json"
HAS_GPU=$($PY -c "import torch; print(int(torch.cuda.is_available()))")

# Speed first (the scarcest result: a call stopped at its limit still brings the layer rows and the training
# step back), then the suite, then the rest, each part only while GPU_CHECK_SECONDS (default 510) has room for it.
BUDGET=${GPU_CHECK_SECONDS:-510}
left() { echo $(( BUDGET - ($(date +%s) - started) )); }
# a part of at most $1 seconds: run it only if it fits in what is left, else say it was skipped and why
fits() { if [ "$(left)" -ge "$1" ]; then return 0; fi; echo "skipped ($2): $(left) s left, it needs up to $1 s"; return 1; }
if [ "$HAS_GPU" = 1 ]; then
    REPS="--reps 5 --min-seconds 1"; TOK="8192 32768"; STEPS="--steps 8 --warmup 3"
    [ "$QUICK" = "--quick" ] && { REPS="--reps 2 --min-seconds 0.2"; TOK="8192"; STEPS="--steps 3 --warmup 2"; }
    PRESET=$($PY -c "import torch; print('smollm2-1.7b' if torch.cuda.get_device_properties(0).total_memory > 100e9 else 'llama3.2-1b')")
    MFU_STEPS="--steps 6 --warmup 3"; [ "$QUICK" = "--quick" ] && MFU_STEPS="--steps 2 --warmup 1"
    timeout ${GPU_CHECK_MFU_SECONDS:-240} $PY benchmarks/speed/train_mfu.py --device cuda --preset "$PRESET" $MFU_STEPS \
        --out "$OUT/train_mfu.json" --profile "$OUT/mfu_profiles"
    timeout 150 $PY benchmarks/speed/moe_layer.py --device cuda --shapes smollm2 mixtral olmoe --tokens $TOK \
        --dtype bfloat16 $REPS --out "$OUT/moe_layer_cuda_bfloat16.json" --profile "$OUT"
    timeout 120 $PY benchmarks/speed/train_step.py --device cuda $STEPS --out "$OUT/train_step_cuda.json" \
        --profile "$OUT"
else
    echo "no CUDA GPU here: the benchmarks were skipped"
fi

WORKERS=1
if $PY -c "import xdist" 2>/dev/null; then WORKERS=${GPU_CHECK_WORKERS:-$(( $(nproc) > 14 ? 14 : $(nproc) ))}; fi
XDIST=""; [ "$WORKERS" -gt 1 ] && XDIST="-n $WORKERS"
# each worker computes on its share of the cores (tests/conftest.py does the same where OMP_NUM_THREADS is unset)
THREADS=$(( $(nproc) / WORKERS > 0 ? $(nproc) / WORKERS : 1 ))
TIMEOUT=""; $PY -c "import pytest_timeout" 2>/dev/null && TIMEOUT="--timeout 240"
SUITE=${GPU_CHECK_SUITE_SECONDS:-$(( $(left) > 21 ? $(left) - 20 : 1 ))}  # what is left, less the summary's
                                                         # time, never 0 (timeout 0 would mean no limit)
[ "$HAS_GPU" = 1 ] || SUITE=${GPU_CHECK_SUITE_SECONDS:-3600}  # without a GPU the suite is all there is to run
OMP_NUM_THREADS=$THREADS UPCYCLE_TEST_REPORT=$OUT/tests.jsonl timeout "$SUITE" $PY -m pytest tests -m "not slow" -q \
    -p no:cacheprovider -p live_report $XDIST $TIMEOUT -rs --junitxml "$OUT/junit.xml" > "$OUT/pytest.log" 2>&1
echo "pytest exit $? after $(( $(date +%s) - started )) s"
tail -5 "$OUT/pytest.log"

if grep -q "device-side assert" "$OUT/pytest.log"; then
    : > "$OUT/assert_hunt.log"
    for f in tests/package/test_cluster.py tests/commands/test_export.py tests/commands/test_compare.py; do
        fits 60 "assert hunt in $f" || break
        CUDA_LAUNCH_BLOCKING=1 timeout 60 $PY -m pytest "$f" -x -q -p no:cacheprovider >> "$OUT/assert_hunt.log" 2>&1
    done
fi

if [ "$HAS_GPU" = 1 ]; then
    fits 60 "float32 layer row" && timeout 60 $PY benchmarks/speed/moe_layer.py --device cuda --shapes smollm2 \
        --tokens 8192 --dtype float32 $REPS --out "$OUT/moe_layer_cuda_float32.json"
    fits 60 "TF32 layer row" && timeout 60 $PY benchmarks/speed/moe_layer.py --device cuda --shapes smollm2 \
        --tokens 8192 --dtype tf32 $REPS --out "$OUT/moe_layer_cuda_tf32.json"
    fits 150 "compiled training step" && timeout 150 $PY benchmarks/speed/train_step.py --device cuda $STEPS \
        --models dense upcycle_every_1 --compile --out "$OUT/train_step_cuda_compile.json"
fi
$PY benchmarks/gpu/gpu_summary.py "$OUT" "$(( $(date +%s) - started ))"
