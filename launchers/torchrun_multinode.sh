#!/usr/bin/env bash
# Multi-node edit-train: run this once on every node (same arguments everywhere, NODE_RANK differs).
#
#   NNODES=4 NODE_RANK=0 NPROC_PER_NODE=8 RDZV_ENDPOINT=a0:29500 RDZV_ID=job42 \
#     launchers/torchrun_multinode.sh cluster.groups=2 cluster.shard_size=16 algo=a_edit train.steps=20000
#
# Environment:
#   NNODES          number of nodes in the job                                   (required)
#   NODE_RANK       this node's rank, 0..NNODES-1, in cluster order               (required)
#   NPROC_PER_NODE  worker processes on this node (one per GPU); same on all nodes (required)
#   RDZV_ENDPOINT   host:port of node rank 0, reachable from every node           (required)
#   RDZV_ID         job id shared by all nodes; also names the default run.dir    (default: edit-train)
#   MAX_RESTARTS    times torchrun restarts the workers after a failure           (default: 3)
#   RDZV_BACKEND    static (node rank = NODE_RANK, fixed) | c10d (elastic)        (default: static)
#   RDZV_CONF       extra --rdzv-conf key=value pairs (comma separated)           (optional)
#   EDIT_DRY_RUN=1  print the torchrun command (one shell-quoted line) instead of running it
#   EDIT_SKIP_TOPOLOGY_CHECK=1  do not compose the config to check cluster.groups x cluster.shard_size
#
# Every other argument is a Hydra override for edit-train, passed through unchanged. run.dir defaults
# to runs/$RDZV_ID (relative to the current directory); it must be one directory on a filesystem that
# every node sees (checkpoints, metrics.jsonl and summary.json are written there by all nodes).
#
# Why static rendezvous by default: world rank = NODE_RANK * NPROC_PER_NODE + LOCAL_RANK and worker
# group = rank // cluster.shard_size, so with a fixed node rank a group is always the same whole nodes
# (node ranks in cluster order => a group never straddles two clusters). c10d rendezvous re-assigns
# node ranks itself (sorted by host name, then agent pid), so the node -> group mapping is whatever the
# host names sort to. See launchers/README.md.
set -euo pipefail

me=torchrun_multinode.sh
die() { echo "$me: error: $*" >&2; exit 2; }
is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }

for var in NNODES NODE_RANK NPROC_PER_NODE RDZV_ENDPOINT; do
    [[ -n ${!var:-} ]] || die "$var is not set (need NNODES, NODE_RANK, NPROC_PER_NODE, RDZV_ENDPOINT; see the top of $0)"
done
RDZV_ID=${RDZV_ID:-edit-train}
MAX_RESTARTS=${MAX_RESTARTS:-3}
RDZV_BACKEND=${RDZV_BACKEND:-static}
RDZV_CONF=${RDZV_CONF:-}

is_uint "$NNODES" && ((10#$NNODES >= 1)) || die "NNODES must be a positive integer, got '$NNODES'"
is_uint "$NPROC_PER_NODE" && ((10#$NPROC_PER_NODE >= 1)) ||
    die "NPROC_PER_NODE must be a positive integer (the same on every node), got '$NPROC_PER_NODE'"
is_uint "$NODE_RANK" && ((10#$NODE_RANK < 10#$NNODES)) ||
    die "NODE_RANK must be an integer in 0..$((10#$NNODES - 1)), got '$NODE_RANK'"
is_uint "$MAX_RESTARTS" || die "MAX_RESTARTS must be a non-negative integer, got '$MAX_RESTARTS'"
NNODES=$((10#$NNODES)) NPROC_PER_NODE=$((10#$NPROC_PER_NODE)) NODE_RANK=$((10#$NODE_RANK)) MAX_RESTARTS=$((10#$MAX_RESTARTS))
[[ $RDZV_ENDPOINT =~ ^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]+)$ ]] && ((10#${BASH_REMATCH[2]} >= 1 && 10#${BASH_REMATCH[2]} <= 65535)) ||
    die "RDZV_ENDPOINT must be host:port (the address of node rank 0, e.g. a0:29500), got '$RDZV_ENDPOINT'"
[[ $RDZV_ID =~ ^[A-Za-z0-9._-]+$ ]] || die "RDZV_ID may only contain letters, digits, '.', '_' and '-', got '$RDZV_ID'"
case $RDZV_BACKEND in
    static | c10d) ;;
    *) die "RDZV_BACKEND must be static or c10d, got '$RDZV_BACKEND'" ;;
esac

overrides=("$@")
has_run_dir=0
for a in "${overrides[@]}"; do
    case $a in
        -m | --multirun) die "Hydra multirun (-m) cannot run under torchrun; launch one job per configuration" ;;
        run.dir=* | +run.dir=* | ++run.dir=*) has_run_dir=1 ;;
    esac
done
((has_run_dir)) || overrides+=("run.dir=runs/$RDZV_ID")

# Check the topology before starting NNODES x NPROC_PER_NODE workers (a mismatch would otherwise fail
# in every worker, and torchrun would restart them MAX_RESTARTS times for nothing).
python=${PYTHON:-python3}
world=$((NNODES * NPROC_PER_NODE))
flags_given=0
for a in "${overrides[@]}"; do [[ $a == -* ]] && flags_given=1; done
if [[ ${EDIT_SKIP_TOPOLOGY_CHECK:-0} != 1 && $flags_given == 0 ]]; then
    shape=$("$python" - "${overrides[@]}" <<'PY'
import sys
try:
    from edit_train.cli.common import compose, one_line
except Exception as exc:  # noqa: BLE001
    print(f"torchrun_multinode.sh: error: cannot import edit_train ({exc}); install it (pip install -e .) on every node",
          file=sys.stderr)
    raise SystemExit(2)
try:
    cfg = compose(sys.argv[1:])
except Exception as exc:  # noqa: BLE001
    print(f"torchrun_multinode.sh: error: {one_line(exc)}", file=sys.stderr)
    raise SystemExit(2)
print(cfg.cluster.groups, cfg.cluster.shard_size)
PY
    ) || exit 2
    read -r groups shard <<<"$shape"
    ((groups * shard == world)) ||
        die "cluster.groups ($groups) x cluster.shard_size ($shard) = $((groups * shard)) but NNODES ($NNODES) x NPROC_PER_NODE ($NPROC_PER_NODE) = $world processes; set cluster.groups=$((world / (shard > 0 ? shard : 1))) or adjust the overrides"
    ((shard % NPROC_PER_NODE == 0 || NPROC_PER_NODE % shard == 0)) ||
        die "cluster.shard_size ($shard) must be a multiple or a divisor of NPROC_PER_NODE ($NPROC_PER_NODE) so that no worker group straddles two nodes"
    if ((shard >= NPROC_PER_NODE)); then
        echo "$me: node $NODE_RANK/$NNODES: ranks $((NODE_RANK * NPROC_PER_NODE))..$(((NODE_RANK + 1) * NPROC_PER_NODE - 1)), worker group $((NODE_RANK * NPROC_PER_NODE / shard)) (nodes $((NODE_RANK * NPROC_PER_NODE / shard * shard / NPROC_PER_NODE))..$(((NODE_RANK * NPROC_PER_NODE / shard + 1) * shard / NPROC_PER_NODE - 1)))" >&2
    else
        echo "$me: node $NODE_RANK/$NNODES: ranks $((NODE_RANK * NPROC_PER_NODE))..$(((NODE_RANK + 1) * NPROC_PER_NODE - 1)), worker groups $((NODE_RANK * NPROC_PER_NODE / shard))..$((((NODE_RANK + 1) * NPROC_PER_NODE - 1) / shard))" >&2
    fi
fi

if command -v torchrun >/dev/null 2>&1; then
    cmd=(torchrun)
else
    cmd=("$python" -m torch.distributed.run)
fi
cmd+=(--nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" --rdzv-backend="$RDZV_BACKEND"
    --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="$RDZV_ID" --max-restarts="$MAX_RESTARTS")
if [[ $RDZV_BACKEND == static ]]; then
    cmd+=(--node-rank="$NODE_RANK")
    if [[ -n $RDZV_CONF ]]; then cmd+=(--rdzv-conf="$RDZV_CONF"); fi
else
    # c10d: torchrun ignores --node-rank; node rank 0 hosts the rendezvous store (no guessing by host name)
    if ((NODE_RANK == 0)); then host=true; else host=false; fi
    cmd+=(--rdzv-conf="is_host=$host${RDZV_CONF:+,$RDZV_CONF}")
fi
cmd+=(-m edit_train.cli.train "${overrides[@]}")

if [[ ${EDIT_DRY_RUN:-0} == 1 ]]; then
    printf '%q ' "${cmd[@]}" | sed 's/ $//'
    echo
    exit 0
fi
exec "${cmd[@]}"
