"""What authentication costs a sync: the seconds every cluster spent computing and checking HMAC-SHA256 /
Poly1305 tags (`summary.json` per_cluster `auth_s`, measured inside the run by `federation.auth`) and, since
issue 37, signing and checking Ed25519 signatures and hashing its anchor (`trust_s`: `federation.identity` and
`local_sgd.healing`), against the seconds its syncs took (the `sync` + `blocked` time buckets, which contain
them). Every run is a local run, so each has its run's key, roster and per-cluster identities.

Runs (each with the run's own federation key, as every local run has):
  * demo      — plain `edit-train` (the default config: A-EDiT, two clusters of different speed over a
                simulated 100 Mbit/s, 50 ms link; the verified rule gathers both contributions);
  * gather3   — `algo=edit cluster.count=3` on the raw loopback (no simulated link): every contribution of
                three clusters gathered and tagged, the worst case for the tags' share.

Targets: tags ≤ 1 % of a sync's time on the default demo (issue 21); signatures and digests on the sync's path ≤ 1 %
(issue 37): the anchor digest, the quorum request's signature and the checks of the quorum's records. The
leader's heartbeat signs and checks one request and answer every 0.5 s on its own thread whether or not a sync
runs: reported apart, as a share of wall time (and, for comparison, everything over sync time).
`micro` times each check alone on this machine: an Ed25519 signature and its check, the anchor digest of the
demo's model (SHA-256 over its 1.76 M fp32 parameters), the finiteness check of a checkpoint of that size.
The box's load (os.getloadavg) before and after each run is recorded.

    python benchmarks/auth_cost.py            # both runs, ~3 min on 2 cores
    python benchmarks/auth_cost.py --quick    # shorter runs
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import _common as C

RUNS = {
    "demo": [],
    "gather3": ["algo=edit", "cluster=local", "cluster.count=3", "cluster.ranks=1", "algo.interval=8"],
}


def measure(summary: dict) -> dict:
    rows = {}
    for name, c in summary["per_cluster"].items():
        t = c.get("time", {})
        sync_s = float(t.get("sync", 0.0)) + float(t.get("blocked", 0.0))
        syncs = max(int(c["syncs"]), 1)
        trust = float(c.get("trust_s", 0.0))
        background = float(c.get("trust_background_s", 0.0))  # the heartbeat thread's signatures: off every sync
        rows[name] = {"auth_s": c["auth_s"], "trust_s": trust, "sync_s": sync_s, "syncs": c["syncs"],
                      "auth_ms_per_sync": 1e3 * c["auth_s"] / syncs, "trust_ms_per_sync": 1e3 * trust / syncs,
                      "sync_ms_per_sync": 1e3 * sync_s / syncs,
                      "share": c["auth_s"] / sync_s if sync_s > 0 else None,
                      "trust_share": trust / sync_s if sync_s > 0 else None,
                      "trust_background_s": background,
                      "trust_sync_path_ms_per_sync": 1e3 * (trust - background) / syncs,
                      "trust_sync_path_share": (trust - background) / sync_s if sync_s > 0 else None,
                      "trust_background_share_of_wall": background / max(float(c["wall_s"]), 1e-9),
                      "bytes_per_sync": c["cross_cluster_bytes"] / syncs}
    return rows


def micro(params: int = 1_757_312, repeat: int = 20) -> dict:
    """Each check alone, one thread (milliseconds: the fastest of `repeat`, what it costs on a quiet core, and
    the median, what it cost on this box as loaded as it was)."""
    import statistics

    import torch
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from edit_train.federation.identity import Identity, verify
    from edit_train.local_sgd.sync.healing import anchor_digest
    from edit_train.train.checkpoint import check_tensors

    def ms(fn) -> dict:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return {"min": min(times), "median": statistics.median(times)}

    torch.set_num_threads(1)
    ident = Identity("c0", "cluster", Ed25519PrivateKey.generate(), b"")
    record = {"name": "c0", "sync": 12, "size": 1, "store": "10.0.0.1:40000",
              "data": {"fp": "f" * 16, "anchor": "d" * 32, "local_steps": 8, "total_steps": 96, "incarnation": "i" * 12}}
    sig = ident.sign("member", record)
    anchor = {"outer/m/anchor/0": torch.randn(params)}
    return {"ed25519_sign_ms": ms(lambda: ident.sign("member", record)),
            "ed25519_verify_ms": ms(lambda: verify(ident.public, "member", record, sig)),
            "anchor_digest_ms": ms(lambda: anchor_digest(anchor)),
            "checkpoint_finite_check_ms": ms(lambda: check_tensors("outer", anchor, Path("x"))), "params": params}


def main() -> None:
    ap = C.parser(__doc__, out="auth_cost.json", workdir="auth_cost")
    ap.add_argument("--quick", action="store_true")
    a = C.parse(ap)
    steps = ["train.steps=120"] if a.quick else []
    out: dict = {"setup": {"quick": a.quick, "env": C.environment(), "cpu_count": os.cpu_count()}, "runs": {},
                 "load": {}}
    out["micro"] = micro(params=4096, repeat=2) if a.smoke else micro()
    print("micro (ms, fastest / median): " + ", ".join(f"{k} {v['min']:.3f} / {v['median']:.3f}"
                                                      for k, v in out["micro"].items() if k != "params"), flush=True)
    for run, overrides in RUNS.items() if not a.smoke else [("demo", RUNS["demo"])]:  # a smoke: one cluster
        run_dir = a.workdir / run
        before = os.getloadavg()
        C.run_job(run, run_dir, [*overrides, *steps, "train.eval_every=0"])
        out["load"][run] = {"before": before, "after": os.getloadavg()}
        rows = measure(C.read_summary(run_dir))
        out["runs"][run] = rows
        for name, r in rows.items():
            print(f"{run:8s} {name}: tags {r['auth_ms_per_sync']:.2f} ms/sync, signatures+digests "
                  f"{r['trust_ms_per_sync']:.2f} ms/sync of {r['sync_ms_per_sync']:.1f} ms ({100 * (r['share'] or 0):.3f} "
                  f"%, {100 * (r['trust_share'] or 0):.3f} %; on the sync's path {r['trust_sync_path_ms_per_sync']:.2f} "
                  f"ms = {100 * (r['trust_sync_path_share'] or 0):.3f} %, heartbeat signatures "
                  f"{100 * r['trust_background_share_of_wall']:.3f} % of wall), {r['bytes_per_sync'] / 1e6:.2f} MB/sync, "
                  f"{r['syncs']} syncs", flush=True)
    worst = max(r["share"] or 0.0 for r in out["runs"]["demo"].values())
    trust = max(r["trust_sync_path_share"] or 0.0 for r in out["runs"]["demo"].values())
    total = max(r["trust_share"] or 0.0 for r in out["runs"]["demo"].values())
    beat = max(r["trust_background_share_of_wall"] for r in out["runs"]["demo"].values())
    out["targets"] = {"tags <= 1% of sync time (demo)": {"value": worst, "pass": worst <= 0.01},
                      "signatures and digests on the sync's path <= 1% of sync time (demo)":
                          {"value": trust, "pass": trust <= 0.01},
                      "(report) every signature and digest, heartbeats included, over sync time (demo)":
                          {"value": total, "pass": None},
                      "(report) heartbeat signatures over wall time (demo)": {"value": beat, "pass": None}}
    C.write_json(a.out, out)
    print(f"targets on the demo: tags {100 * worst:.3f} % ({'pass' if worst <= 0.01 else 'FAIL'}), signatures and "
          f"digests on the sync's path {100 * trust:.3f} % ({'pass' if trust <= 0.01 else 'FAIL'}) of a sync (all of "
          f"them, heartbeats included: {100 * total:.3f} %); wrote {a.out}")


if __name__ == "__main__":
    main()
