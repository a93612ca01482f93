#!/usr/bin/env bash
# The GPU checks in one run (at most about 9.5 minutes on one H100 or H200: one device call of 600 s): the CUDA tests, then
# `flt bench speed --device cuda` in three passes sized to the time, each with its own time
# limit so that one pass that runs long does not cost the others. Logs and each pass's
# speed-cuda.json go to $OUT (default: flt-out/gpu), its tables to stdout. Runs from a
# checkout without installing it (PYTHONPATH=src).
#
#   bash scripts/gpu_check.sh
set -uo pipefail
OUT=${OUT:-flt-out/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"

# 0. The Triton kernels against the PyTorch path, case by case (bfloat16 and segments; the band in float64).
timeout 130 $PY scripts/gpu_diag_triton.py 2>&1 | grep -v -i warn | tee "$OUT/diag.log"

# 1. Every CUDA test (float64 identities, bf16, decoding, Triton kernels, Flex score_mod, sparse pairs).
timeout 100 $PY -m pytest -m cuda -q -p no:cacheprovider -n 8 tests/test_cuda.py tests/test_ops_pairs.py \
    2>&1 | tee "$OUT/pytest-cuda.log" | tail -40

bench() {  # name, time limit, bench arguments...
    local name=$1 limit=$2
    shift 2
    timeout "$limit" $PY -m flt bench speed --device cuda --precisions bf16 --out-dir "$WORK/$name" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v "^|" | tail -5
    cp "$WORK/$name/speed-cuda.json" "$OUT/$name.json" 2>/dev/null
}
WORK=$(mktemp -d)
# 2. The shape at N = 4k and 16k (width 512, batch 4: 65,536 tokens at 16k): uncompiled rows.
bench batch 100 --shapes batch --lengths 4096 16384 \
    --rows "flt-logit eager" "flt-logit triton" "flt-mult triton" "flt-logit band8 triton" "performer triton" sdpa
# 3. One sequence of 65,536 tokens, width 512, fwd+bwd: the targets' comparison with Flex + T5 and SDPA.
bench wide 110 --shapes wide --lengths 65536 --modes fwd+bwd \
    --rows "flt-logit triton" "flt-logit band8 triton" "flt-logit compiled" "flt-logit band8 compiled" sdpa
# 4. The compiled forms at 4k and 8k: where plain and banded FLT cross flash attention.
bench compiled 110 --shapes batch --lengths 4096 8192 --modes fwd+bwd \
    --rows "flt-logit compiled" "flt-logit band8 compiled" sdpa
for f in "$WORK"/*/speed-cuda.md; do echo "== $f"; grep "^|\|^Shape\|^GPU" "$f"; done
