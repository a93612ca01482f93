#!/usr/bin/env bash
# The GPU checks, in parts that each keep their own time limit (so that one part that runs
# long does not cost the others):
#   cuda   every CUDA test (at most 100 s)
#   bench  `flt bench speed --device cuda` in three passes (at most 410 s): the compiled
#          layers against flash attention at N = 4096 and 8192 (the crossovers), the
#          forward of one 65,536-token sequence with Flex + T5, and the Triton kernels at
#          N = 4096 (their progress: 10-18x slower than eager when last measured)
#   diag   the Triton kernels against the PyTorch path, one case per process (at most 130 s)
#   split  the feature-split Triton kernels (`backend="triton-split"`): their CUDA tests, then
#          their first timing, forward and forward+backward at N = 4096 and 16384 beside the
#          eager PyTorch row, the band (near_field=8) and the multiplicative coupling (beside
#          its eager row) on them too (at most 470 s)
#   presets  the ListOps and longlm `base` presets, FLT and softmax + T5, seeds 0 and 1: eight
#          trainings at once on the one GPU (each about 7 minutes alone on an H200 by the step
#          times measured there), each stopped at PRESET_LIMIT seconds (default 540); their
#          summaries (or, for a run stopped early, its last logged lines) go to
#          $OUT/presets.jsonl and $OUT/presets.log. Meant as its own device call; if eight
#          at once would not finish, PRESET_TASKS=listops (then longlm) runs four per call.
#          PRESET=smoke PRESET_DEVICE=cpu PRESET_STEPS=2 checks the plumbing without a GPU.
#   qm9    the QM9 `base` preset's training step of each model, 200 steps each on a sample
#          CSV of QM9 rows (QM9_SAMPLE, default .gpu/qm9-sample.csv; the qm9pack wheel is
#          too large to carry to a device machine), median step time (at most 300 s; DimeNet++ took 32 s on an H200)
# The default, `cuda bench`, fits one device call of 600 s. Logs and each pass's results go
# to $OUT (default: flt-out/gpu; a device call returns at most 8 files): speed-cuda.json when
# a pass finished, else the speed-cuda.jsonl of what it measured before its limit.
# Runs from a checkout without installing it (PYTHONPATH=src).
#
#   bash scripts/gpu_check.sh                 # cuda and bench
#   bash scripts/gpu_check.sh diag qm9        # the parts named
set -uo pipefail
OUT=${OUT:-flt-out/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"

PARTS=${*:-cuda bench}
for p in $PARTS; do
    case $p in diag|cuda|qm9|bench|split|presets) ;; *) echo "unknown part '$p': choose from diag cuda qm9 bench split presets" >&2; exit 2 ;; esac
done
part() { [[ " $PARTS " == *" $1 "* ]]; }
STATUS=0
note() {  # part name, exit status of its command: a failure or a time limit is said, and kept for the exit status
    if [ "$2" -eq 124 ]; then echo "== $1: stopped at its time limit"; STATUS=1
    elif [ "$2" -ne 0 ]; then echo "== $1: failed (exit $2)"; STATUS=1; fi
}

bench() {  # name, time limit, bench arguments...
    local name=$1 limit=$2
    shift 2
    echo "== pass $name" >> "$OUT/bench.log"
    timeout -k 10 "$limit" $PY -m flt bench speed --device cuda --precisions bf16 --out-dir "$WORK/$name" "$@" 2>&1 \
        | tee -a "$OUT/bench.log" | grep -v "^|" | grep -v -i "warn" | tail -12
    note "bench $name" "${PIPESTATUS[0]}"
    cp "$WORK/$name/speed-cuda.json" "$OUT/$name.json" 2>/dev/null || cp "$WORK/$name/speed-cuda.jsonl" "$OUT/$name.jsonl" 2>/dev/null
}
WORK=$(mktemp -d)

if part diag; then
# 0. The Triton kernels against the PyTorch path, case by case (bfloat16 and segments; the band in float64).
timeout -k 10 130 $PY scripts/gpu_diag_triton.py 2>&1 | tee "$OUT/diag.log" | grep -v -i warn
note diag "${PIPESTATUS[0]}"
fi

if part cuda; then

# 1. Every CUDA test (float64 identities, bf16, decoding, Triton kernels, Flex score_mod, sparse pairs).
timeout -k 10 100 $PY -m pytest -m cuda -q -p no:cacheprovider -n 8 tests/library/test_cuda.py tests/library/test_ops_pairs.py \
    2>&1 | tee "$OUT/pytest-cuda.log" | tail -40
note "cuda tests" "${PIPESTATUS[0]}"
fi

if part presets; then
# Eight trainings side by side; the GPU is shared, so each one's s/step is not its speed alone.
PRESET=${PRESET:-base}
runs=()
for task in ${PRESET_TASKS:-listops longlm}; do
    for attention in flt "softmax:relative_bias=t5"; do
        for seed in 0 1; do
            name="$task-${attention%%:*}-s$seed"
            dir="$WORK/presets/$name"
            mkdir -p "$dir"
            steps=()
            [ -n "${PRESET_STEPS:-}" ] && steps=(--steps "$PRESET_STEPS")
            timeout -k 10 "${PRESET_LIMIT:-540}" $PY -m flt train "$task" --preset "$PRESET" --attention "$attention" --seed "$seed" \
                --device "${PRESET_DEVICE:-cuda}" "${steps[@]}" --no-plots --no-progress --out-dir "$dir/run" > "$dir/log" 2>&1 &
            runs+=("$!:$name")
        done
    done
done
for entry in "${runs[@]}"; do
    pid=${entry%%:*} name=${entry#*:}
    wait "$pid"
    note "presets $name" $?
    { echo "== $name"; tail -25 "$WORK/presets/$name/log"; } >> "$OUT/presets.log"
    $PY -c "import json, sys; s = json.load(open(sys.argv[1])); print(json.dumps({'run': sys.argv[2], **s}))" \
        "$WORK/presets/$name/run/summary.json" "$name" >> "$OUT/presets.jsonl" 2>/dev/null \
        || echo "{\"run\": \"$name\", \"finished\": false}" >> "$OUT/presets.jsonl"
    echo "presets $name: $(grep -a -h "s/step\|Error" "$WORK/presets/$name/log" | tail -1)"
done
fi

if part qm9; then
# The QM9 base preset's step (width 128, 4 layers, batch 64) of each model: step times only
# (200 steps on 2,000 sample molecules; accuracy needs the full split and 200,000 steps).
SAMPLE=${QM9_SAMPLE:-.gpu/qm9-sample.csv}
for model in "flt" "softmax" "performer" "schnet" "dimenet++"; do
    case $model in
        schnet|dimenet++) args=(--model "$model") ;;
        *) args=(--attention "$model") ;;
    esac
    run=$(mktemp -d)
    timeout -k 10 60 $PY -m flt train qm9 --preset base --device "${QM9_DEVICE:-cuda}" "${args[@]}" --data "$SAMPLE" \
        --data-opt num_train=2000 --data-opt num_valid=200 --data-opt num_test=200 \
        --steps "${QM9_STEPS:-200}" --eval-every 1000 --checkpoint-every 1000 --no-plots --no-progress \
        --out-dir "$run" > "$run.log" 2>&1
    note "qm9 $model" $?
    { echo "== $model"; cat "$run.log"; } >> "$OUT/qm9.log"
    $PY -c "import json, sys; s = json.load(open(sys.argv[1])); print(json.dumps({'model': sys.argv[2], **s}))" \
        "$run/summary.json" "$model" >> "$OUT/qm9.jsonl" 2>/dev/null
    echo "qm9 base $model: $(grep -h "s/step\|Error\|error" "$run.log" | tail -2)"
done
fi

if part bench; then
# 1. The compiled layers at 4k and 8k, width 512, batch 4, fwd+bwd: where plain and banded FLT
#    cross flash attention (16k and 65k were measured).
bench compiled 200 --shapes batch --lengths 4096 8192 --modes fwd+bwd \
    --rows "flt-logit compiled" "flt-logit band8 compiled" sdpa
# 2. One sequence of 65,536 tokens, forward: Flex + T5 (only its fwd+bwd was measured), banded FLT, flash.
bench wide 150 --shapes wide --lengths 65536 --modes fwd \
    --rows "flt-logit band8 compiled" sdpa "softmax+t5 flex compiled"
# 3. The Triton kernels at N = 4096, forward (the feature-split ones: part `split`).
bench triton 60 --shapes batch --lengths 4096 --modes fwd \
    --rows "flt-logit triton" "flt-logit band8 triton" "performer triton"
fi

if part split; then
# The feature-split kernels: correctness on the GPU first (m = 256 in blocks of 64, float64
# and float32, bf16 autocast), then forward and forward+backward at width 512, batch 4.
timeout -k 10 130 $PY -m pytest -m cuda -q -p no:cacheprovider tests/library/test_cuda.py -k "split" \
    2>&1 | tee "$OUT/pytest-split.log" | tail -15
note "split tests" "${PIPESTATUS[0]}"
bench split 340 --shapes batch --lengths 4096 16384 \
    --rows "flt-logit triton-split" "flt-logit eager" "performer triton-split" "flt-logit band8 triton-split" \
    "flt-mult triton-split" "flt-mult eager"
fi
for f in "$WORK"/*/speed-cuda.md; do [ -f "$f" ] && { echo "== $f"; grep "^|\|^Shape\|^GPU" "$f"; }; done
exit $STATUS
