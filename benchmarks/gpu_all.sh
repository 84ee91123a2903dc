#!/usr/bin/env bash
# Every GPU figure of edit-train's issues 52 and 67 in one command, sized for 9 minutes of one lent H100/H200:
#
#   bash benchmarks/gpu_all.sh [OUT_DIR]        # default OUT_DIR: results/
#   FULL=1 bash benchmarks/gpu_all.sh           # also issue 40's grid, profile and checkpointing rows (+~6 min)
#
# 1. train (270 s): benchmarks/gpu_train.py -> OUT_DIR/gpu_step_<device>.json: the Trainer itself on the Ling-Lite
#    slice (compiled, grouped experts, bf16) at grad_accum 1 and 4, the harness row at the same shape, and two
#    ling_1b clusters on the one GPU through three syncs (each cluster's peak vs its plan)
# 2. ling2 (180 s): benchmarks/gpu_train.py --model ling_mini_2_slice: the same trainer (grad_accum 1 and 4) and
#    harness rows on Ling-mini-2.0's layers (conf/model/ling_mini_2_slice.yaml: 256 experts of 512 top-8 in groups,
#    sigmoid routing with an expert bias, QK-norm, half RoPE, the MTP layer; 2 x 4096 tokens), appended
# 3. tests (90 s): pytest -m cuda (tests/integration/test_cuda.py, tests/train/test_step_sync_free.py's sync-debug twin, ...)
# With FULL=1 also: gpu_step.py's rows (ling_lite_slice, ling_mini_2_slice and ling_1b, compiled and eager, no
# checkpointing, then full checkpointing appended) and benchmarks/gpu_profile.py -> OUT_DIR/gpu_profile_<device>.txt.
# Each stage has a wall-clock limit (seconds; override with LIMIT_TRAIN, LIMIT_LING2, LIMIT_TESTS, LIMIT_STEP,
# LIMIT_PROFILE, LIMIT_CKPT) and the next stage runs whatever the last one did; rows are written as they finish, so a stage cut
# short keeps what it measured. Logs: OUT_DIR/gpu_all_<stage>.log. PYTHON picks the interpreter (default: python).
# Without a CUDA device it refuses with one line (exit 2).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results}
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

stage train "${LIMIT_TRAIN:-270}" "$PY" benchmarks/gpu_train.py --out-dir "$OUT"
stage ling2 "${LIMIT_LING2:-180}" "$PY" benchmarks/gpu_train.py --model ling_mini_2_slice --rows trainer harness \
    --out-dir "$OUT"
stage tests "${LIMIT_TESTS:-90}" "$PY" -m pytest -m cuda -q -p no:cacheprovider tests
if [ "${FULL:-0}" = 1 ]; then
    ROWS=(--models ling_lite_slice ling_mini_2_slice ling_1b --modes compiled eager --experts grouped --out-dir "$OUT"
          --append)
    stage step "${LIMIT_STEP:-180}" "$PY" benchmarks/gpu_step.py "${ROWS[@]}" --checkpointing none
    stage profile "${LIMIT_PROFILE:-60}" "$PY" benchmarks/gpu_profile.py --out-dir "$OUT"
    stage ckpt "${LIMIT_CKPT:-100}" "$PY" benchmarks/gpu_step.py "${ROWS[@]}" --checkpointing full
fi

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
        what = f"{r.get('what', 'harness')} ga{r.get('grad_accum', 1)}"
        print(f"  {what:<14} {r['model']:<16} L{r.get('layers') or '-':<3} {'compile' if r['compile'] else 'eager':<8}"
              f"{r['checkpointing']:<5} {tps:>10} tok/s  MFU {mfu:>6}  peak {peak} / plan {r.get('plan_gib') or 0:.1f} GiB"
              + (f"  {r['error']}" if r.get("error") else ""))
        for name, c in (r.get("clusters") or {}).items():
            print(f"      {name}: syncs {c['syncs']}, peak {c['peak_gib']} / plan {c['plan_gib']} GiB")
for f in sorted(out.glob("gpu_profile_*.txt")):
    print(f"{f}:")
    print("\n".join(line for line in f.read_text().splitlines() if line.startswith("#")))
PY
exit $failed
