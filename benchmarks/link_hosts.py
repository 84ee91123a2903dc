"""A sync over a real shaped link: measured transfer time vs the link model's and the planner's prediction.

Three hosts on one box (`edit_train/sim/hosts.py`: network namespaces on a bridge, every link shaped to
100 Mbit/s both ways with `tc tbf`; tbf has no latency): the Lighthouse on `lh`, cluster `a` on host `a`,
cluster `b` on host `b`, started with the README's multi-host recipe (`edit-train-lighthouse` +
`launchers/torchrun_multinode.sh`). The clusters run `algo=edit` with `sync.mode=at_end`, so each sync is one
blocking step — the norm exchange, the pseudo-gradient exchange (every byte of the model, fp32, one way each
direction at once) and the vote — and the sync event's `blocked_s` is the time spent on the network.

Per sync of `a` and `b`, this prints and saves

* `bytes`: the cluster's cross-cluster bytes of that sync (its `sync` event);
* `measured_s`: the seconds the cluster blocked in it (the slower cluster's ranks; the `sync` event's `blocked_s`);
* `link_model_s`: `LinkModel(100, 0).seconds(bytes)` — what the simulated link on loopback would charge;
* `planner_s`: the planner's blocked time of the same sync (`Fed.sync_cost` for edit / at_end / none at
  100 Mbit/s, latency 0, default profile): the exchange, the transfer and the vote; `planner_xfer_s` is
  its transfer alone, `planner_bytes` its byte count;
* the ratios measured / predicted.

Before the federation, one 12.5 MB TCP transfer from `a` to `b` measures the link's ceiling (Mbit/s), the same
both ways at once checks the link under a sync's traffic pattern, and a bare gloo all_gather of the first
model's parameters between the two hosts (no edit-train) separates the transport from the sync's own work.

    PYTHONPATH=$PWD python benchmarks/link_hosts.py [--quick] [--out results/link_hosts.json]

Needs root, `ip netns`, `tc tbf` and `unshare`; where hosts cannot be built it prints one line and exits 0.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MULTINODE = REPO / "launchers" / "torchrun_multinode.sh"
RATE_MBIT = 100.0
TCP_BYTES = 12_500_000  # one second at 100 Mbit/s

SERVER = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
print("listening", flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if t0 is None: t0 = time.perf_counter()
    n += len(b)
print(n, time.perf_counter() - t0, flush=True)
"""
GLOO = r"""
import sys, time, torch, torch.distributed as dist
rank, master, numel, reps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("gloo", init_method=f"tcp://{master}:29610", rank=rank, world_size=2)
x = torch.randn(numel); out = [torch.empty(numel) for _ in range(2)]
small = [torch.empty(1) for _ in range(2)]; dist.all_gather(small, torch.zeros(1))  # connect
for _ in range(reps):
    dist.barrier(); t0 = time.perf_counter(); dist.all_gather(out, x); print(time.perf_counter() - t0, flush=True)
dist.destroy_process_group()
"""
CLIENT = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
c.sendall(b"\0" * int(sys.argv[3])); c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
"""


def env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("EDIT_TRAIN_CLUSTER", "EDIT_DRY", "KEY_FILE"))}
    from edit_train.federation import auth

    out.pop(auth.KEY_ENV, None)
    return {**out, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def corpus(root: Path) -> str:
    """`data.source` glob of ~30 stdlib modules (as tests/conftest.py's small_corpus)."""
    out = root / "corpus"
    out.mkdir(parents=True, exist_ok=True)
    total = n = 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if 5_000 <= f.stat().st_size <= 40_000:
            shutil.copyfile(f, out / f.name)
            total, n = total + f.stat().st_size, n + 1
            if n >= 30 and total >= 300_000:
                break
    return f"{out}/*.py"


def tcp_ceiling(net: Any, nbytes: int) -> dict[str, Any]:
    """One `nbytes` TCP transfer a -> b: seconds from the first byte received to EOF, Mbit/s."""
    port = "29600"
    srv = net.popen("b", [sys.executable, "-c", SERVER, net.address("b"), port], stdout=subprocess.PIPE, text=True)
    assert srv.stdout is not None
    assert srv.stdout.readline().strip() == "listening"
    net.run("a", [sys.executable, "-c", CLIENT, "b", port, str(nbytes)], check=True, timeout=60)
    got, secs = srv.stdout.readline().split()
    srv.wait(timeout=10)
    return {"bytes": int(got), "seconds": float(secs), "mbit_s": int(got) * 8 / float(secs) / 1e6}


def tcp_both_ways(net: Any, nbytes: int) -> dict[str, float]:
    """`nbytes` a -> b and b -> a at once (a sync's pattern), Mbit/s of each direction."""
    srvs = {}
    for h, port in (("b", "29601"), ("a", "29602")):
        p = net.popen(h, [sys.executable, "-c", SERVER, net.address(h), port], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.readline().strip() == "listening"
        srvs[h] = p
    clients = [net.popen("a", [sys.executable, "-c", CLIENT, "b", "29601", str(nbytes)]),
               net.popen("b", [sys.executable, "-c", CLIENT, "a", "29602", str(nbytes)])]
    for c in clients:
        c.wait(timeout=60)
    out = {}
    for h, p in srvs.items():
        got, secs = p.stdout.readline().split()  # type: ignore[union-attr]
        p.wait(timeout=10)
        out[f"to_{h}_mbit_s"] = int(got) * 8 / float(secs) / 1e6
    return out


def gloo_all_gather(net: Any, numel: int, reps: int) -> list[float]:
    """Seconds of a bare gloo all_gather of `numel` fp32 values between a and b (each sends 4·numel bytes)."""
    argv = lambda r: [sys.executable, "-c", GLOO, str(r), net.address("a"), str(numel), str(reps)]  # noqa: E731
    procs = [net.popen(h, argv(r), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
             for r, h in enumerate(("a", "b"))]
    outs = [p.communicate(timeout=120) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"gloo probe failed: {outs[0][1][-1500:]} {outs[1][1][-1500:]}")
    times = [[float(x) for x in o.split()] for o, _ in outs]
    return [max(t) for t in zip(*times)]


def predictions(model: str, interval: int, compression: str) -> dict[str, float]:
    """The link model's rate and the planner's sync cost (per cluster) for 2 clusters at RATE_MBIT, latency 0."""
    import numpy as np

    from edit_train.plan.costs import resolve
    from edit_train.plan.profile import Profile
    from edit_train.plan.spec import Candidate, scenario_from_dict

    scn = scenario_from_dict({"name": "link-hosts", "model": model, "steps": 64,
                              "clusters": [{"name": n, "ranks": 1, "step_s": 0.1} for n in ("a", "b")],
                              "link": {"bandwidth_mbps": RATE_MBIT, "latency_ms": 0.0}})
    prof = Profile.default()
    fed = resolve(scn, prof)
    cost = fed.sync_cost(np.array([0, 1]), Candidate("edit", "at_end", compression, interval=interval))
    xfer = float(np.asarray(cost["at_end"]).max())  # the units, one at a time (pipeline.py)
    return {"planner_bytes": float(np.asarray(cost["bytes"])[0]), "planner_xfer_s": xfer,
            "planner_s": float(cost["exchange"]) + xfer + float(cost["vote"]),
            "planner_quorum_s": prof.quorum_s}


def start_lighthouse(net: Any, logs: Path, key: str, clusters: int) -> Any:
    """`edit-train-lighthouse` on host lh (port 29510), once it serves; the caller kills host lh after."""
    lh_log = logs / "lh.log"
    house = net.popen("lh", ["edit-train-lighthouse", "--bind", f"{net.address('lh')}:29510",
                             f"federation.key_file={key}", f"federation.min_clusters={clusters}"],
                      stdout=open(lh_log, "w"), stderr=subprocess.STDOUT, env=env())  # noqa: SIM115
    deadline = time.time() + 60
    while "serving at" not in lh_log.read_text():
        if house.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"the Lighthouse did not start:\n{lh_log.read_text()[-2000:]}")
        time.sleep(0.1)
    return house


def run_clusters(net: Any, names: list[str], overrides: list[str], key: str, logs: Path, cwd: Path,
                 timeout: float) -> float:
    """One cluster job per host of `names` (`launchers/torchrun_multinode.sh`, 1 rank each, the Lighthouse on
    lh), all with `overrides`; waits for them (raises naming the first that failed); returns the wall time."""
    procs = {}
    t0 = time.time()
    for name in names:
        e = env(CLUSTER=name, LIGHTHOUSE="lh:29510", NNODES="1", NODE_RANK="0", NPROC_PER_NODE="1",
                RDZV_ENDPOINT=f"{name}:29500", KEY_FILE=key, MAX_RESTARTS="0")
        procs[name] = net.popen(name, ["bash", str(MULTINODE), *overrides], stdout=open(logs / f"{name}.log", "w"),  # noqa: SIM115
                                stderr=subprocess.STDOUT, env=e, cwd=cwd)
    try:
        for name, p in procs.items():
            rc = p.wait(timeout=max(1.0, timeout - (time.time() - t0)))
            if rc != 0:
                raise RuntimeError(f"cluster {name} exited {rc}:\n{(logs / f'{name}.log').read_text()[-3000:]}")
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the federation did not finish within {timeout:.0f} s:\n"
                           + (logs / f"{names[0]}.log").read_text()[-2000:]) from None
    return time.time() - t0


def federation(net: Any, work: Path, key: str, data: str, model: str, interval: int, syncs: int,
               compression: str, timeout: float) -> tuple[list[dict[str, Any]], float]:
    """Lighthouse on lh, clusters a and b on their hosts; returns the sync events of a and b (both together)."""
    run_dir = work / f"run-{model}"
    logs = work / f"logs-{model}"
    logs.mkdir(parents=True, exist_ok=True)
    start_lighthouse(net, logs, key, 2)
    steps = interval * syncs
    overrides = [*C.BASE_OVERRIDES, "algo=edit", f"algo.interval={interval}", "sync.mode=at_end",
                 f"sync.compression={compression}", f"model={model}", "train.seq_len=32", "train.batch_size=2",
                 "train.eval_every=0", "train.eval_batches=1", "train.log_every=4", "train.threads=1",
                 f"train.steps={steps}", "cluster=local", "cluster.link.bandwidth_mbps=0", "cluster.link.latency_ms=0",
                 "cluster.clusters=[{name:a,ranks:1},{name:b,ranks:1}]",
                 "federation.min_clusters=2", "federation.heartbeat_timeout_s=5", "federation.join_timeout_s=30",
                 "federation.collective_timeout_s=120", f"data.source={data}", f"run.dir={run_dir}"]
    try:
        wall = run_clusters(net, ["a", "b"], overrides, key, logs, work, timeout)
    finally:
        net.kill("lh")
    events = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [e for e in events if e.get("event") == "sync" and sorted(e.get("quorum", [])) == ["a", "b"]], wall


def measure(net: Any, work: Path, key: str, data: str, model: str, interval: int, syncs: int, compression: str,
            timeout: float) -> dict[str, Any]:
    from edit_train.federation.link import LinkModel

    link = LinkModel(RATE_MBIT, 0.0)
    pred = predictions(model, interval, compression)
    print(f"[{time.strftime('%H:%M:%S')}] model={model}: {syncs} syncs of H={interval}, sync.mode=at_end, "
          f"compression={compression}", flush=True)
    events, wall = federation(net, work, key, data, model, interval, syncs, compression, timeout)
    rows = []
    for e in sorted(events, key=lambda e: (e["sync"], e["cluster"])):
        lm = link.seconds(int(e["bytes"]))
        rows.append({"model": model, "sync": e["sync"], "cluster": e["cluster"], "bytes": int(e["bytes"]),
                     "measured_s": float(e["blocked_s"]), "link_model_s": lm, **pred,
                     "measured_over_link_model": float(e["blocked_s"]) / lm if lm > 0 else None,
                     "measured_over_planner": float(e["blocked_s"]) / pred["planner_s"]})
    # the first sync also waits for the slower start-up of the other cluster: the headline leaves it out
    steady = [r for r in rows if r["sync"] != min(r["sync"] for r in rows)] or rows
    med = lambda k: statistics.median(r[k] for r in steady) if steady else None  # noqa: E731
    return {"model": model, "interval": interval, "compression": compression, "syncs": rows, "wall_s": wall,
            "median_excluding_first": {k: med(k) for k in ("bytes", "measured_s", "link_model_s", "planner_s",
                                                          "planner_xfer_s", "measured_over_link_model",
                                                          "measured_over_planner")}}


def main() -> int:
    ap = C.parser(__doc__, out="link_hosts.json", timeout=900.0)
    ap.add_argument("--quick", action="store_true", help="model=tiny only, 4 syncs (~2 minutes on 2 cores)")
    ap.add_argument("--models", default=None, help="comma-separated (default: tiny; tiny,small without --quick)")
    ap.add_argument("--syncs", type=int, default=None, help="syncs per model (default 4 quick, 5 full)")
    ap.add_argument("--interval", type=int, default=8, help="algo.interval (H)")
    ap.add_argument("--compression", default="none")
    args = C.parse(ap)
    if args.smoke:  # the hosts need root and minutes: the link model's and the planner's side of one tiny sync
        pred = predictions("tiny", args.interval, args.compression)
        print(f"link_hosts --smoke: no namespace hosts (root, minutes); predicted tiny sync: {pred}")
        C.write_json(args.out, {"benchmark": "link_hosts", "smoke": True, "rate_mbit": RATE_MBIT, "predicted": pred})
        return 0
    if sys.platform != "linux":
        print("link_hosts: skipped — needs Linux network namespaces")
        return 0
    from edit_train.sim import hosts as sim_hosts

    why = sim_hosts.unavailable()
    if why is not None:
        print(f"link_hosts: skipped — {why}")
        return 0
    from edit_train.federation import auth

    models = (args.models or ("tiny" if args.quick else "tiny,small")).split(",")
    syncs = args.syncs or (4 if args.quick else 5)
    t0 = time.time()
    results: dict[str, Any] = {"benchmark": "link_hosts", "quick": args.quick, "rate_mbit": RATE_MBIT,
                               "latency_ms": 0.0, "environment": C.environment(), "runs": []}
    with tempfile.TemporaryDirectory(prefix="link-hosts-") as tmp:
        work = Path(tmp)
        key = str(auth.new_key(work / "fed.key"))
        data = corpus(work)
        with sim_hosts.Hosts(["lh", "a", "b"], rate_mbit=RATE_MBIT) as net:
            tcp = tcp_ceiling(net, TCP_BYTES)
            print(f"TCP a -> b: {tcp['bytes'] / 1e6:.1f} MB in {tcp['seconds']:.3f} s = {tcp['mbit_s']:.1f} Mbit/s "
                  f"(tbf rate {RATE_MBIT:g} Mbit/s)", flush=True)
            results["tcp"] = tcp
            results["tcp_both_ways"] = both = tcp_both_ways(net, TCP_BYTES)
            print(f"TCP both ways at once: a -> b {both['to_b_mbit_s']:.1f}, b -> a {both['to_a_mbit_s']:.1f} Mbit/s",
                  flush=True)
            from edit_train.plan import hardware

            numel = hardware.model_facts(models[0]).total_params
            g = gloo_all_gather(net, numel, 3)
            results["gloo_all_gather"] = {"model": models[0], "bytes_each_way": 4 * numel, "seconds": g,
                                          "link_model_s": 4 * numel * 8 / (RATE_MBIT * 1e6)}
            print(f"gloo all_gather of {models[0]}'s parameters ({4 * numel / 1e6:.2f} MB each way): "
                  + ", ".join(f"{t:.3f}" for t in g) + f" s (link model {4 * numel * 8 / (RATE_MBIT * 1e6):.3f} s)",
                  flush=True)
            for model in models:
                results["runs"].append(measure(net, work, key, data, model, args.interval, syncs, args.compression,
                                               args.timeout))
    results["wall_s"] = time.time() - t0
    cols = [("model", "model", ""), ("sync", "sync", "d"), ("cluster", "cl", ""), ("bytes", "bytes", ",d"),
            ("measured_s", "measured s", ".3f"), ("link_model_s", "link model s", ".3f"),
            ("planner_s", "planner s", ".3f"), ("measured_over_link_model", "meas/link", ".2f"),
            ("measured_over_planner", "meas/planner", ".2f")]
    print()
    print(C.table([r for run in results["runs"] for r in run["syncs"]], cols))
    print(f"\nTCP ceiling a -> b: {tcp['mbit_s']:.1f} Mbit/s; both ways at once {both['to_b_mbit_s']:.1f} / "
          f"{both['to_a_mbit_s']:.1f} Mbit/s")
    for run in results["runs"]:
        m = run["median_excluding_first"]
        if m["measured_s"] is None:
            continue
        eff = m["bytes"] * 8 / m["measured_s"] / 1e6
        print(f"{run['model']}: median sync (first left out) {m['bytes'] / 1e6:.2f} MB in {m['measured_s']:.3f} s "
              f"({eff:.1f} Mbit/s); link model {m['link_model_s']:.3f} s (x{m['measured_over_link_model']:.2f}), "
              f"planner {m['planner_s']:.3f} s (x{m['measured_over_planner']:.2f}; its transfer alone "
              f"{m['planner_xfer_s']:.3f} s)")
    C.write_json(args.out, results)
    print(f"wrote {args.out} ({results['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
