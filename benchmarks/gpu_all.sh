#!/usr/bin/env bash
# Every GPU figure of edit-train in one command, sized for ~8 minutes of one lent H100/H200:
#
#   bash benchmarks/gpu_all.sh [OUT_DIR]        # default OUT_DIR: docs/
#
# 1. gpu_step rows at the widths that matter (benchmarks/gpu_step.py): ling_lite_slice and ling_1b, compiled and
#    eager, grouped experts, bf16, no activation checkpointing -> OUT_DIR/gpu_step_<device>.json
# 2. the profile of the slice's compiled step (benchmarks/gpu_profile.py) -> OUT_DIR/gpu_profile_<device>.txt
# 3. pytest -m cuda (every test marked cuda: tests/test_cuda.py, tests/test_experts.py, ...)
# 4. the same gpu_step rows with full activation checkpointing, appended to the JSON
# Each stage has a wall-clock limit (seconds; override with LIMIT_STEP, LIMIT_PROFILE, LIMIT_TESTS, LIMIT_CKPT) and
# the next stage runs whatever the last one did; gpu_step writes each row as it finishes, so a stage cut short
# keeps what it measured. Logs: OUT_DIR/gpu_all_<stage>.log. PYTHON picks the interpreter (default: python).
# Without a CUDA device it refuses with one line (exit 2).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs}
PY=${PYTHON:-python}
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_all: no CUDA device here (torch.cuda.is_available() is false); run it on a GPU machine" >&2
    exit 2
fi
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
failed=0

stage() {  # stage NAME LIMIT_S COMMAND...
    local name=$1 limit=$2 start rc
    shift 2
    echo "== $name (limit ${limit}s): $*"
    start=$(date +%s)
    timeout --signal=INT --kill-after=30 "$limit" "$@" 2>&1 | tee "$OUT/gpu_all_$name.log"
    rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $(( $(date +%s) - start ))s"
    [ "$rc" -eq 0 ] || failed=1
}

ROWS=(--models ling_lite_slice ling_1b --modes compiled eager --experts grouped --out-dir "$OUT")
stage step "${LIMIT_STEP:-180}" "$PY" benchmarks/gpu_step.py "${ROWS[@]}" --checkpointing none
stage profile "${LIMIT_PROFILE:-60}" "$PY" benchmarks/gpu_profile.py --out-dir "$OUT"
stage tests "${LIMIT_TESTS:-120}" "$PY" -m pytest -m cuda -q -p no:cacheprovider tests
stage ckpt "${LIMIT_CKPT:-100}" "$PY" benchmarks/gpu_step.py "${ROWS[@]}" --checkpointing full --append

echo "== summary"
"$PY" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for f in sorted(out.glob("gpu_step_*.json")):
    d = json.loads(f.read_text())
    print(f"{f}: {d['device']}, torch {d['torch']}")
    for r in d["rows"]:
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else r["status"]
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") else "-"
        print(f"  {r['model']:<16} L{r['layers']:<3} {'compile' if r['compile'] else 'eager':<8}"
              f"{r['checkpointing']:<5} {tps:>10} tok/s  MFU {mfu:>6}  peak {peak} / plan {r['plan_gib']:.1f} GiB"
              + (f"  {r['error']}" if r.get("error") else ""))
for f in sorted(out.glob("gpu_profile_*.txt")):
    print(f"{f}:")
    print("\n".join(line for line in f.read_text().splitlines() if line.startswith("#")))
PY
exit $failed
