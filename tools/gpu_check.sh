#!/usr/bin/env bash
# GPU checks for the offload path on one CUDA device, in stages, each writing STAGE.json into the
# output directory ($1, else $OUT, else ./gpu_check_out); summary.json lists every stage's outcome.
#   1. smoke    (60 s): imports, one pinned round trip, one NCCL world-size-1 all-reduce, one offloaded
#                       step against the in-memory engine's
#   2. cuda_tests (135 s): pytest -m cuda (every CUDA test carries the marker; tests/test_markers.py)
#   3. loss     (120 s): offloaded 125M run (auto budgets) against the in-memory run, loss by loss, with
#                       pinned bytes vs host budget and device peak vs device budget
#   4. race      (75 s): producing and copy streams delayed with torch.cuda._sleep; results bitwise equal
#                       (copier, gradient folds, training with host and NVMe gradients, accumulation)
#   5. profile   (60 s): one offloaded step under torch.profiler: do copies overlap kernels?
# Stage limits add to 450 s (7.5 min), well inside a 15-minute device session with room to rerun one
# stage: `tools/gpu_check.sh DIR STAGE...` runs only the named stages.
# Exit status: non-zero if any stage failed or timed out. The stages' python is tools/gpu_check.py.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}
OUT_DIR=${1:-${OUT:-./gpu_check_out}}
[ $# -gt 0 ] && shift
STAGES=${*:-smoke cuda_tests loss race profile}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
summary=()

limit_of() {   # the stage's timeout in seconds
    case $1 in
        smoke) echo 60 ;; cuda_tests) echo 135 ;; loss) echo 120 ;; race) echo 75 ;; profile) echo 60 ;;
        *) echo 0 ;;
    esac
}

stage_json_missing() {   # NAME RC WALL_S: a stage that died before writing its JSON still leaves one
    printf '{"stage": "%s", "ok": false, "error": "exited with status %s after %s s without writing its JSON%s"}\n' \
        "$1" "$2" "$3" "$([ "$2" -eq 124 ] && echo ' (timed out)')" >"$OUT_DIR/$1.json"
}

run_stage() {   # NAME: run it under its timeout, log to NAME.log, remember the outcome
    local name=$1 limit t0 rc
    limit=$(limit_of "$name")
    if [ "$limit" -eq 0 ]; then
        echo "unknown stage $name (valid: smoke cuda_tests loss race profile)" >&2
        status=1
        return
    fi
    rm -f "$OUT_DIR/$name.json"
    t0=$SECONDS
    echo "== $name (limit ${limit} s)"
    if [ "$name" = cuda_tests ]; then
        timeout "$limit" "$PY" -m pytest -q -m cuda -p no:cacheprovider --junitxml="$OUT_DIR/cuda_tests.xml" tests \
            >"$OUT_DIR/$name.log" 2>&1
        rc=$?
        "$PY" - "$OUT_DIR/cuda_tests.xml" "$rc" >"$OUT_DIR/cuda_tests.json" 2>>"$OUT_DIR/$name.log" <<'PY'
import json, sys
import xml.etree.ElementTree as ET
path, rc = sys.argv[1], int(sys.argv[2])
suite = ET.parse(path).getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
cases = suite.findall("testcase")
def outcome(c):
    return next((t for t in ("failure", "error", "skipped") if c.find(t) is not None), "passed")
counts = {k: sum(outcome(c) == k for c in cases) for k in ("passed", "failure", "error", "skipped")}
failed = [f"{c.get('classname')}::{c.get('name')}" for c in cases if outcome(c) in ("failure", "error")]
print(json.dumps({"stage": "cuda_tests", "ok": rc == 0 and counts["passed"] > 0, "rc": rc, **counts,
                  "failed": failed}))
PY
    else
        timeout "$limit" "$PY" tools/gpu_check.py "$name" --out "$OUT_DIR" >"$OUT_DIR/$name.log" 2>&1
        rc=$?
    fi
    [ -s "$OUT_DIR/$name.json" ] || stage_json_missing "$name" "$rc" "$((SECONDS - t0))"
    # the stage's verdict is its JSON's top-level "ok" (a test run that skipped everything exits 0)
    local ok=false
    "$PY" -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1])).get("ok") is True else 1)' \
        "$OUT_DIR/$name.json" 2>/dev/null && [ "$rc" -eq 0 ] && ok=true
    echo "   rc=$rc ok=$ok in $((SECONDS - t0)) s"
    tail -n 3 "$OUT_DIR/$name.log" | cut -c1-300 | sed 's/^/   | /'
    [ "$ok" = true ] || status=1
    summary+=("{\"stage\": \"$name\", \"ok\": $ok, \"rc\": $rc, \"wall_s\": $((SECONDS - t0)), \"limit_s\": $limit}")
}

PYTHONPATH="$PWD/tools:$PYTHONPATH" "$PY" -c "import torch; from hardware_note import line; \
from infinity.precision import hardware_record; print(line(hardware_record('cuda' if torch.cuda.is_available() else 'cpu')))"
for stage in $STAGES; do
    run_stage "$stage"
done
{
    printf '{"ok": %s, "stages": [' "$([ $status -eq 0 ] && echo true || echo false)"
    (IFS=,; printf '%s' "${summary[*]}")
    printf ']}\n'
} >"$OUT_DIR/summary.json"
echo "overall: $([ $status -eq 0 ] && echo PASS || echo FAIL) (JSON in $OUT_DIR)"
exit $status
