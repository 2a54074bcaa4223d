#!/usr/bin/env bash
# GPU checks for the offload path, on one CUDA device, in well under 8 minutes:
#   1. the CUDA-marked tests (pytest -m cuda): pinned buffers, device-tier gathers, device grads -> CPU Adam;
#   2. infinity profile --quick: this machine's memcpy / NVMe / CPU Adam / collective bandwidths;
#   3. one offloaded training run (ZeRO-3, params + optimizer on NVMe, grads on host), a few steps,
#      with its per-step stats and a Chrome trace of step 1; then the same with optimizer.overlap_backward.
# Logs go to $OUT when set (else ./gpu_check_out). Exit status: non-zero if any part failed.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}
LOG_DIR=${OUT:-./gpu_check_out}
mkdir -p "$LOG_DIR"
SWAP=$(mktemp -d "${TMPDIR:-/tmp}/infinity_gpu_check.XXXXXX")
trap 'rm -rf "$SWAP"' EXIT
status=0

run() {   # run NAME TIMEOUT_S CMD...: log to $LOG_DIR/NAME.log, remember failures
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*" | tee -a "$LOG_DIR/summary.log"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$LOG_DIR/$name.log" 2>&1
    local rc=$?
    echo "   rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG_DIR/summary.log"
    tail -n 5 "$LOG_DIR/$name.log" | sed 's/^/   | /' | tee -a "$LOG_DIR/summary.log"
    [ "$rc" -eq 0 ] || status=1
}

"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" \
    | tee "$LOG_DIR/summary.log"
run cuda_tests 240 "$PY" -m pytest -q -m cuda tests/
run profile 120 "$PY" -m infinity.cli profile --quick --json --out "$LOG_DIR/profile"
cat >"$SWAP/offload.yaml" <<YAML
zero: {stage: 3}
precision: {param_dtype: bf16}
offload: {optimizer: nvme, params: nvme, grads: host}
tiers: {nvme_path: $SWAP/swap, host_bytes: 4GiB, device_bytes: 2GiB}
prefetch: {bytes: 256MiB, max_live_bytes: 1GiB}
YAML
run offload_train 120 "$PY" -m infinity.cli train --config "$SWAP/offload.yaml" --model 125m --steps 3 \
    --swap-dir "$SWAP/swap" --batch-size 4 --seq-len 512 --metrics "$LOG_DIR/offload_metrics.jsonl" --trace "$LOG_DIR/offload_trace.json" \
    --trace-step 1 --no-progress --json
# the same step with each unit's update started in backward (optimizer.overlap_backward)
sed 's/^zero: {stage: 3}$/zero: {stage: 3}\noptimizer: {overlap_backward: true}/' "$SWAP/offload.yaml" >"$SWAP/overlap.yaml"
run offload_train_overlap 120 "$PY" -m infinity.cli train --config "$SWAP/overlap.yaml" --model 125m --steps 3 \
    --swap-dir "$SWAP/swap" --batch-size 4 --seq-len 512 --metrics "$LOG_DIR/overlap_metrics.jsonl" --no-progress --json
echo "overall: $([ $status -eq 0 ] && echo PASS || echo FAIL)" | tee -a "$LOG_DIR/summary.log"
exit $status
