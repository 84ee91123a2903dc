#!/usr/bin/env bash
# One cluster of an edit-train federation: run this on every node of the cluster (same arguments on
# every node, NODE_RANK differs). Each cluster is its own job with its own rendezvous and restarts;
# clusters meet only at torchft's Lighthouse (start one with edit-train-lighthouse, see
# launchers/README.md).
#
#   CLUSTER=a LIGHTHOUSE=lh0:29510 NNODES=2 NODE_RANK=0 NPROC_PER_NODE=8 RDZV_ENDPOINT=a0:29500 \
#     launchers/torchrun_multinode.sh cluster=real 'cluster.clusters=[{name:a,ranks:16},{name:b,ranks:8}]' algo=a_edit
#
# Environment:
#   CLUSTER         this cluster's name (one of cluster.clusters, or a new name: it joins the
#                   running federation and heals from a peer)                          (required)
#   LIGHTHOUSE      host:port of the federation's Lighthouse, reachable from every node  (required)
#   NNODES          nodes in this cluster                                                (required)
#   NODE_RANK       this node's rank in the cluster, 0..NNODES-1                         (required)
#   NPROC_PER_NODE  worker processes on this node (one per GPU); the same on all nodes   (required)
#   RDZV_ENDPOINT   host:port of this cluster's node rank 0 (its own rendezvous)         (required)
#   KEY_FILE        the federation key (edit-train-keygen PATH; the same file for every cluster and the
#                   Lighthouse; passed to the workers as EDIT_TRAIN_FEDERATION_KEY_FILE) (required unless
#                   LIGHTHOUSE is this host's loopback or federation.insecure=true is given)
#   ROSTER_FILE     the federation's roster, signed by its operator (edit-train-keygen federation DIR makes
#                   DIR/roster.json; the same file for every cluster and the Lighthouse; passed to the
#                   workers as EDIT_TRAIN_ROSTER_FILE)                        (optional, with IDENTITY_FILE)
#   IDENTITY_FILE   this cluster's identity (DIR/$CLUSTER.identity, mode 0600; on this cluster's nodes
#                   only; passed to the workers as EDIT_TRAIN_IDENTITY_FILE)  (optional, with ROSTER_FILE)
#   HOST_ADDR       this node's address as the other clusters reach it; its cross-cluster traffic (the
#                   leader's lane store, the gloo lanes) binds to it (EDIT_TRAIN_HOST). Default: the
#                   source address the kernel picks for a route to the Lighthouse (a UDP connect, no
#                   packet sent); behind NAT, set this node's VPN address. Refused when it resolves to
#                   a loopback address and the Lighthouse is not on loopback           (optional)
#   RDZV_ID         rendezvous id                                           (default: edit-$CLUSTER)
#   MAX_RESTARTS    times torchrun restarts this cluster's workers after a failure; a
#                   restarted cluster heals from a live peer, the others never stop   (default: 3)
#   RDZV_BACKEND    static (node rank = NODE_RANK) | c10d (elastic)          (default: static)
#   RDZV_CONF       extra --rdzv-conf key=value pairs (comma separated)      (optional)
#   PYTHON          the Python with edit_train installed: it runs the checks, torchrun (python -m
#                   torch.distributed.run) and so every worker                       (default: python3)
#   TORCHRUN_LOG    where torchrun's own output goes: everything torchrun and the workers print is appended
#                   there; the console shows all of it but torchrun's failure report (the workers' one line
#                   says what happened)        (default: <run.dir>/clusters/$CLUSTER.node$NODE_RANK.torchrun.log)
#   EDIT_DRY_RUN=1  print the command (one shell-quoted line) instead of running it
#   EDIT_SKIP_TOPOLOGY_CHECK=1  do not compose the config to check the cluster's rank count
#   EDIT_SKIP_KEY_CHECK=1  do not ask the Lighthouse whether it holds KEY_FILE's key before starting
#
# Every other argument is a Hydra override, passed through. Every worker gets EDIT_TRAIN_CLUSTER=$CLUSTER
# (operators find a cluster's processes by it). run.dir defaults to runs/edit-train: clusters that
# share a filesystem share the run directory (one metrics.jsonl, one summary.json with every cluster,
# checkpoints/<cluster>/); clusters on separate filesystems each write their own.
set -euo pipefail

me=torchrun_multinode.sh
die() { echo "$me: error: $*" >&2; exit 2; }
is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }

for var in CLUSTER LIGHTHOUSE NNODES NODE_RANK NPROC_PER_NODE RDZV_ENDPOINT; do
    [[ -n ${!var:-} ]] ||
        die "$var is not set (need CLUSTER, LIGHTHOUSE, NNODES, NODE_RANK, NPROC_PER_NODE, RDZV_ENDPOINT; see the top of $0)"
done
RDZV_ID=${RDZV_ID:-edit-$CLUSTER}
MAX_RESTARTS=${MAX_RESTARTS:-3}
RDZV_BACKEND=${RDZV_BACKEND:-static}
RDZV_CONF=${RDZV_CONF:-}

[[ $CLUSTER =~ ^[A-Za-z0-9._-]+$ ]] || die "CLUSTER may only contain letters, digits, '.', '_' and '-', got '$CLUSTER'"
is_uint "$NNODES" && ((10#$NNODES >= 1)) || die "NNODES must be a positive integer, got '$NNODES'"
is_uint "$NPROC_PER_NODE" && ((10#$NPROC_PER_NODE >= 1)) ||
    die "NPROC_PER_NODE must be a positive integer (the same on every node), got '$NPROC_PER_NODE'"
is_uint "$NODE_RANK" && ((10#$NODE_RANK < 10#$NNODES)) ||
    die "NODE_RANK must be an integer in 0..$((10#$NNODES - 1)), got '$NODE_RANK'"
is_uint "$MAX_RESTARTS" || die "MAX_RESTARTS must be a non-negative integer, got '$MAX_RESTARTS'"
NNODES=$((10#$NNODES)) NPROC_PER_NODE=$((10#$NPROC_PER_NODE)) NODE_RANK=$((10#$NODE_RANK)) MAX_RESTARTS=$((10#$MAX_RESTARTS))
hostport='^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]+)$'
[[ $RDZV_ENDPOINT =~ $hostport ]] && ((10#${BASH_REMATCH[2]} >= 1 && 10#${BASH_REMATCH[2]} <= 65535)) ||
    die "RDZV_ENDPOINT must be host:port (this cluster's node rank 0, e.g. a0:29500), got '$RDZV_ENDPOINT'"
[[ ${LIGHTHOUSE#http://} =~ $hostport ]] ||
    die "LIGHTHOUSE must be host:port of the federation's Lighthouse (e.g. lh0:29510), got '$LIGHTHOUSE'"
[[ $RDZV_ID =~ ^[A-Za-z0-9._-]+$ ]] || die "RDZV_ID may only contain letters, digits, '.', '_' and '-', got '$RDZV_ID'"
case $RDZV_BACKEND in
    static | c10d) ;;
    *) die "RDZV_BACKEND must be static or c10d, got '$RDZV_BACKEND'" ;;
esac

overrides=("$@")
has_run_dir=0 insecure=0 run_dir=runs/edit-train
for a in "${overrides[@]}"; do
    case $a in
        -m | --multirun) die "Hydra multirun (-m) cannot run under torchrun; launch one job per configuration" ;;
        run.dir=* | +run.dir=* | ++run.dir=*) has_run_dir=1 run_dir=${a#*run.dir=} run_dir=${run_dir#[\'\"]} run_dir=${run_dir%[\'\"]} ;;
        federation.lighthouse=* | cluster.only=*) die "$a: set LIGHTHOUSE / CLUSTER instead (this script passes them)" ;;
        federation.key_file=*) die "$a: set KEY_FILE instead (this script passes it)" ;;
        federation.identity_file=* | federation.roster_file=*) die "$a: set IDENTITY_FILE / ROSTER_FILE instead (this script passes them)" ;;
        federation.insecure=true | federation.insecure=True) insecure=1 ;;
    esac
done
KEY_FILE=${KEY_FILE:-${EDIT_TRAIN_FEDERATION_KEY_FILE:-}}
lh_host=${LIGHTHOUSE#http://}
lh_port=${lh_host##*:}
lh_host=${lh_host%:*}
lh_loopback=0
[[ $lh_host =~ ^(localhost|127\.[0-9.]+|\[::1\])$ ]] && lh_loopback=1
if [[ -n $KEY_FILE ]]; then
    [[ -r $KEY_FILE ]] || die "KEY_FILE=$KEY_FILE cannot be read on this node (copy the federation key here, mode 0600)"
elif ((insecure == 0 && lh_loopback == 0)); then
    die "KEY_FILE is not set: a federation across hosts needs a key so that only its members can join, steer or read it (make one with edit-train-keygen PATH, give every cluster and the Lighthouse the same file), or pass federation.insecure=true"
fi
IDENTITY_FILE=${IDENTITY_FILE:-${EDIT_TRAIN_IDENTITY_FILE:-}}
ROSTER_FILE=${ROSTER_FILE:-${EDIT_TRAIN_ROSTER_FILE:-}}
if [[ -n $IDENTITY_FILE || -n $ROSTER_FILE ]]; then
    [[ -n $IDENTITY_FILE && -n $ROSTER_FILE ]] ||
        die "set both IDENTITY_FILE (this cluster's, DIR/$CLUSTER.identity) and ROSTER_FILE (DIR/roster.json), or neither"
    [[ -r $IDENTITY_FILE ]] || die "IDENTITY_FILE=$IDENTITY_FILE cannot be read on this node (copy this cluster's identity here, mode 0600)"
    [[ -r $ROSTER_FILE ]] || die "ROSTER_FILE=$ROSTER_FILE cannot be read on this node (copy the federation's roster.json here)"
fi
trust_env=()
if [[ -n $KEY_FILE ]]; then trust_env+=(EDIT_TRAIN_FEDERATION_KEY_FILE="$KEY_FILE"); fi
if [[ -n $ROSTER_FILE ]]; then trust_env+=(EDIT_TRAIN_ROSTER_FILE="$ROSTER_FILE" EDIT_TRAIN_IDENTITY_FILE="$IDENTITY_FILE"); fi
((has_run_dir)) || overrides+=("run.dir=runs/edit-train")
overrides+=("federation.lighthouse=${LIGHTHOUSE#http://}")

python=${PYTHON:-python3}
# Every python this script starts (the checks below, torchrun, its workers) imports the installed edit_train, never
# an edit_train/ in the working directory (started inside another checkout: two code versions in one job).
export PYTHONSAFEPATH=1
if [[ ${EDIT_DRY_RUN:-0} != 1 ]]; then # the first line at once, not after the checks and torch's import
    echo "$me: cluster $CLUSTER, node $NODE_RANK/$NNODES: checking the configuration and the Lighthouse, then starting $NPROC_PER_NODE worker(s) with torchrun"
fi

# This node's cross-cluster address: HOST_ADDR, or the source address of this node's route to the
# Lighthouse (connecting a UDP socket picks the route and sends nothing). Never a loopback address when
# the Lighthouse is elsewhere: the other clusters could not reach it (a Debian host name is 127.0.1.1).
HOST_ADDR=$("$python" - "$lh_host" "$lh_port" "${HOST_ADDR:-}" "$lh_loopback" "$LIGHTHOUSE" <<'PY'
import ipaddress, socket, sys
host, port, given, lh_loopback, lighthouse = sys.argv[1].strip("[]"), int(sys.argv[2]), *sys.argv[3:]
def fail(msg):
    print(f"torchrun_multinode.sh: error: {msg}: set HOST_ADDR to this node's address as the other clusters reach it",
          file=sys.stderr)
    raise SystemExit(2)
addr, what = given, f"HOST_ADDR={given}"
if not addr:
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            addr = s.getsockname()[0]
    except OSError as exc:
        fail(f"cannot find this node's address towards the Lighthouse {lighthouse} ({exc.strerror or exc})")
    what = f"HOST_ADDR={addr} (this node's source address towards the Lighthouse)"
if lh_loopback != "1":
    try:
        ip = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as exc:
        fail(f"{what} does not resolve on this node ({exc.strerror or exc})")
    kind = ipaddress.ip_address(ip.split("%")[0])
    if kind.is_loopback or kind.is_unspecified:
        is_ = "is" if ip == addr else f"resolves to {ip},"
        fail(f"{what} {is_} {'a loopback' if kind.is_loopback else 'an unspecified'} address, but the Lighthouse "
             f"{lighthouse} is not on loopback")
print(addr)
PY
) || exit 2

# Check the cluster's size before starting NNODES x NPROC_PER_NODE workers (a mismatch would otherwise
# fail in every worker, and torchrun would restart them MAX_RESTARTS times for nothing).
ranks=$((NNODES * NPROC_PER_NODE))
if [[ ${EDIT_SKIP_TOPOLOGY_CHECK:-0} != 1 ]]; then
    want=$(EDIT_TRAIN_CLUSTER=$CLUSTER "$python" - "${overrides[@]}" <<'PY'
import os, sys
try:
    from edit_train.cli.common import compose, one_line
    from edit_train.config import cluster_specs
    from edit_train.sim.switch import check_real_network
except Exception as exc:  # noqa: BLE001
    print(f"torchrun_multinode.sh: error: cannot import edit_train ({exc}); install it (pip install -e .) on every node",
          file=sys.stderr)
    raise SystemExit(2)
try:
    cfg = compose(sys.argv[1:])
    check_real_network(cfg)  # a real cluster job simulates no link / slowdown / faults unless sim.force=true
    specs = cluster_specs(cfg)
except Exception as exc:  # noqa: BLE001
    print(f"torchrun_multinode.sh: error: {one_line(exc)}", file=sys.stderr)
    raise SystemExit(2)
name = os.environ["EDIT_TRAIN_CLUSTER"]
print(next((s.ranks for s in specs if s.name == name), 0), ",".join(s.name for s in specs))
PY
    ) || exit 2
    read -r want_ranks names <<<"$want"
    if ((want_ranks == 0)); then
        echo "$me: cluster $CLUSTER is not in the configured clusters ($names): it joins the federation as a new cluster of $ranks rank(s)" >&2
    else
        ((want_ranks == ranks)) ||
            die "cluster $CLUSTER has $want_ranks rank(s) in the config but NNODES ($NNODES) x NPROC_PER_NODE ($NPROC_PER_NODE) = $ranks processes; fix cluster.clusters or the node counts"
    fi
    echo "$me: cluster $CLUSTER, node $NODE_RANK/$NNODES: cluster ranks $((NODE_RANK * NPROC_PER_NODE))..$(((NODE_RANK + 1) * NPROC_PER_NODE - 1)) of $ranks, Lighthouse $LIGHTHOUSE, cross-cluster address $HOST_ADDR" >&2
fi

# Does the Lighthouse hold this cluster's key (and accept its identity)? A signed hello, before any rank
# starts: a job holding another key, or an identity / roster that is missing, too open or not this cluster's,
# stops here with one line (a refusing gate: after federation.join_timeout_s + 20 s of refusals) instead of
# being restarted MAX_RESTARTS times by torchrun; so does a Lighthouse address nobody listens on (start the
# Lighthouse first). A worker that fails with a configuration error (exit 2) is not restarted either: the wrapper
# below stops torchrun (edit_train/cli/torchrun_wrap.py).
if [[ ${EDIT_DRY_RUN:-0} != 1 && ${EDIT_SKIP_KEY_CHECK:-0} != 1 ]]; then
    env EDIT_TRAIN_CLUSTER="$CLUSTER" EDIT_TRAIN_NODE_RANK="$NODE_RANK" EDIT_TRAIN_HOST="$HOST_ADDR" "${trust_env[@]}" "$python" -m edit_train.cli.key_check "${overrides[@]}" || exit 2
fi

# torchrun of the python that ran the checks above: its workers import the same edit_train (a `torchrun` first on
# PATH may belong to another Python, with another edit_train installed)
cmd=("$python" -m torch.distributed.run)
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
envs=(EDIT_TRAIN_CLUSTER="$CLUSTER" EDIT_TRAIN_HOST="$HOST_ADDR" "${trust_env[@]}")

if [[ ${EDIT_DRY_RUN:-0} == 1 ]]; then
    printf '%q ' env "${envs[@]}" "${cmd[@]}" | sed 's/ $//'
    echo
    exit 0
fi
# torchrun under our wrapper (edit_train/cli/torchrun_wrap.py): its own failure report goes to TORCHRUN_LOG only,
# it dies with this process (kill -9 of the launcher leaves no worker behind), signals are passed on to it
log_dir=$run_dir/clusters
[[ $run_dir == *'$'* ]] && log_dir=${TMPDIR:-/tmp}  # run.dir=${…}: Hydra resolves it, not this script
TORCHRUN_LOG=${TORCHRUN_LOG:-$log_dir/$CLUSTER.node$NODE_RANK.torchrun.log}
exec env "${envs[@]}" "$python" -m edit_train.cli.torchrun_wrap "$TORCHRUN_LOG" -- "${cmd[@]}"
