"""The configurations `benchmarks/plan_validation.py` runs, split into a FITTING set and a HELD-OUT set.

The rule that keeps them apart is in docs/planner.md ("Fitting and held-out configurations"); in short:
the profile is fitted from `CALIBRATION` runs only, every change to `edit_train/plan/` is found and checked
on `FITTING` runs, and `HELD_OUT` — fixed in the commit that introduced this file, before any model change —
may grow but never loses a configuration, and no constant of the planner is chosen by looking at its errors.

Each entry is `name -> overrides` (the common workload is added by the benchmark); the candidate the planner
predicts is read back from the run's own config (`calibrate.candidate_of_run`), so it cannot drift from what
ran. A `HOSTS` entry runs across network-namespace hosts (`edit_train/sim/hosts.py`) over a real,
tbf-shaped TCP link of `rate_mbit` instead of edit-train's simulated link.
"""

from __future__ import annotations


def _n(groups: int, slowdown: list[float] | None = None) -> list[str]:
    out = ["cluster=local", f"cluster.count={groups}", "cluster.ranks=1"]
    if slowdown:
        out.append(f"cluster.slowdown=[{','.join(f'{s:g}' for s in slowdown)}]")
    return out


def _link(mbps: float, ms: float) -> list[str]:
    return [f"cluster.link.bandwidth_mbps={mbps:g}", f"cluster.link.latency_ms={ms:g}"]


def _topk(density: float, bits: int, group: int = 1, unsent: str = "resend") -> list[str]:
    return ["sync.compression=topk", f"sync.topk_density={density:g}", f"sync.bits={bits}",
            f"sync.topk_group={group}", f"sync.unsent={unsent}", "sync.error_feedback_decay=1.0"]


def workload(quick: bool, seed: int = 0) -> list[str]:
    """The overrides every run shares: model=tiny, 160 steps of 8 x 128 (--quick: 48 of 4 x 64), no warm-up."""
    steps, batch, seq, log_every = (48, 4, 64, 8) if quick else (160, 8, 128, 10)
    return ["model=tiny", f"train.steps={steps}", f"train.batch_size={batch}", f"train.seq_len={seq}",
            "train.eval_every=0", "train.eval_batches=2", f"train.log_every={log_every}", "algo.warmup_steps=0",
            f"seed={seed}"]


LINK = _link(100, 50)
KILL_C1_20 = ["faults=[{kind:kill_cluster,cluster:c1,step:20}]", "run.max_restarts=1", "run.restart_delay_s=2"]
KILL_C1_50 = ["faults=[{kind:kill_cluster,cluster:c1,step:50}]", "run.max_restarts=1", "run.restart_delay_s=2"]

# --------------------------------------------------------------------------------------- fitting set
# the calibration as it was when the split was committed (for _plan_first.py: the planner's first numbers)
FIRST_CALIBRATION = {
    "cal_edit_none": ["algo=edit", "cluster=local_2x1", "sync.mode=at_end", "sync.compression=none",
                      "algo.interval=8", *LINK],
    "cal_edit_int8": ["algo=edit", "cluster=local_2x1", "sync.mode=at_end", "sync.compression=int8",
                      "algo.interval=8", *LINK],
    "cal_ddp": ["algo=ddp", "cluster=local_2x1", *_link(500, 20)],
}
CALIBRATION = {  # the profile is fitted from these runs, and from nothing else
    # no simulated link: a sync's wait is its software alone (on a link, work shorter than the wire hides)
    "cal_edit_none_free": ["algo=edit", "cluster=local_2x1", "sync.mode=at_end", "sync.compression=none",
                           "algo.interval=8"],
    "cal_edit_int8_free": ["algo=edit", "cluster=local_2x1", "sync.mode=at_end", "sync.compression=int8",
                           "algo.interval=8"],
    # ddp's per-step quorum round (a link none of the validation runs uses)
    "cal_ddp": ["algo=ddp", "cluster=local_2x1", *_link(500, 20)],
}

FITTING = {  # the 12 configurations the planner's earlier fixes were found on (docs/planner.md), + one real link
    "ddp_2": ["algo=ddp", "cluster=local_2x1", *LINK],
    "diloco_at_end_2_slow": ["algo=diloco", "cluster=hetero_2x1", "sync.mode=at_end", "algo.interval=8"],
    "edit_layerwise_2_bf16": ["algo=edit", "cluster=local_2x1", "sync.mode=layerwise", "sync.compression=bf16",
                              "algo.interval=16", *_link(20, 100)],
    "a_edit_at_end_2_slow": ["algo=a_edit", "cluster=hetero_2x1", "sync.mode=at_end", "algo.sync_time_s=2"],
    "edit_at_end_3": ["algo=edit", *_n(3), "sync.mode=at_end", "algo.interval=8", *LINK],
    "post_local_sgd_overlap_2": ["algo=post_local_sgd", "cluster=local_2x1", "sync.mode=overlap",
                                 "algo.interval=8", *LINK],
    "ddp_2_slow": ["algo=ddp", "cluster=hetero_2x1", *_link(1000, 5)],
    "edit_overlap_2": ["algo=edit", "cluster=local_2x1", "sync.mode=overlap", "algo.interval=8", *LINK],
    "diloco_layerwise_3_int8": ["algo=diloco", *_n(3), "sync.mode=layerwise", "sync.compression=int8",
                                "algo.interval=8", *LINK],
    "a_edit_overlap_2_slow": ["algo=a_edit", "cluster=hetero_2x1", "sync.mode=overlap", "algo.sync_time_s=2"],
    "edit_at_end_4": ["algo=edit", *_n(4), "sync.mode=at_end", "algo.interval=16", *_link(50, 20)],
    "edit_at_end_2_kill": ["algo=edit", "cluster=local_2x1", "sync.mode=at_end", "algo.interval=8", *LINK,
                           *KILL_C1_20],
    # a real TCP link between namespace hosts (the link_hosts.py setting): what a real link adds to the model
    "hosts_edit_at_end_2_100mbit": ["algo=edit", "sync.mode=at_end", "sync.compression=none", "algo.interval=8"],
}

# --------------------------------------------------------------------------------------- held-out set
# Fixed before any model change of issue 42. Covers every algorithm, sync mode and compression (top-k with
# its density, groups, bits and sync.unsent), 2-4 clusters, slowdowns up to 5x, links down to 20 Mbit/s, a
# kill at 3 clusters and a real-TCP run across namespace hosts.
HELD_OUT = {
    "h_edit_overlap_3_int8_hetero_20mbit": ["algo=edit", *_n(3, [1, 1.5, 3]), "sync.mode=overlap",
                                            "sync.compression=int8", "algo.interval=8", *_link(20, 50)],
    "h_diloco_at_end_2_slow5_bf16_20mbit": ["algo=diloco", *_n(2, [1, 5]), "sync.mode=at_end",
                                            "sync.compression=bf16", "algo.interval=8", *_link(20, 50)],
    "h_ddp_3": ["algo=ddp", *_n(3), *_link(1000, 5)],
    "h_ddp_4_slow2": ["algo=ddp", *_n(4, [1, 1, 1, 2]), *_link(1000, 2)],
    "h_post_local_sgd_at_end_3_fp8": ["algo=post_local_sgd", *_n(3), "sync.mode=at_end", "sync.compression=fp8",
                                      "algo.interval=16", *_link(50, 20)],
    "h_post_local_sgd_layerwise_2_bf16_slow2_20mbit": ["algo=post_local_sgd", *_n(2, [1, 2]), "sync.mode=layerwise",
                                                       "sync.compression=bf16", "algo.interval=16", *_link(20, 20)],
    "h_diloco_layerwise_3_kill": ["algo=diloco", *_n(3), "sync.mode=layerwise", "sync.compression=none",
                                  "algo.interval=8", *_link(100, 20), *KILL_C1_50],
    "h_diloco_overlap_4_topk": ["algo=diloco", *_n(4), "sync.mode=overlap", *_topk(0.02, 2), "algo.interval=8",
                                *_link(100, 50)],
    "h_edit_at_end_3_topk_20mbit": ["algo=edit", *_n(3), "sync.mode=at_end", *_topk(0.01, 2), "algo.interval=8",
                                    *_link(20, 50)],
    "h_edit_layerwise_4_fp8": ["algo=edit", *_n(4, [1, 1, 1, 2]), "sync.mode=layerwise", "sync.compression=fp8",
                               "algo.interval=16", *_link(50, 20)],
    "h_edit_at_end_2_slow5_1gbit": ["algo=edit", *_n(2, [1, 5]), "sync.mode=at_end", "sync.compression=none",
                                    "algo.interval=8", *_link(1000, 5)],
    "h_a_edit_layerwise_3_topk_g4_keep": ["algo=a_edit", *_n(3, [1, 1, 2]), "sync.mode=layerwise",
                                          *_topk(0.05, 4, group=4, unsent="keep"), "algo.sync_time_s=2",
                                          *_link(50, 20)],
    "h_a_edit_overlap_2_slow5_int8_20mbit": ["algo=a_edit", *_n(2, [1, 5]), "sync.mode=overlap",
                                             "sync.compression=int8", "algo.sync_time_s=3", *_link(20, 100)],
    "h_hosts_edit_layerwise_2_int8_50mbit": ["algo=edit", "sync.mode=layerwise", "sync.compression=int8",
                                             "algo.interval=8"],
}
HOSTS = {"hosts_edit_at_end_2_100mbit": 100.0, "h_hosts_edit_layerwise_2_int8_50mbit": 50.0}  # name -> tbf rate (Mbit/s) of every host's link

# --quick: 48-step runs of a subset (no 5x slowdowns), about 10 minutes on a quiet 2-core box
QUICK = {"ddp_2", "edit_at_end_3", "edit_overlap_2", "diloco_layerwise_3_int8", "hosts_edit_at_end_2_100mbit",
         "h_edit_overlap_3_int8_hetero_20mbit", "h_ddp_3", "h_post_local_sgd_at_end_3_fp8", "h_diloco_layerwise_3_kill",
         "h_edit_at_end_3_topk_20mbit", "h_a_edit_layerwise_3_topk_g4_keep", "h_hosts_edit_layerwise_2_int8_50mbit"}

assert not set(HELD_OUT) & (set(FITTING) | set(CALIBRATION)), "a configuration is in both sets"
