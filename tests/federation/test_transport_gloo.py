"""The in-process federation (`federation.inproc`, threads) and the real one (a torchft Lighthouse, gloo lanes
between processes) run the same sync rounds to the same anchor: the in-process tests speak for the real
transport."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from edit_train.cluster.group import RankGroup
from edit_train.federation import auth
from edit_train.federation.quorum import Lighthouse
from edit_train.federation.transport import lighthouse_transport
from edit_train.local_sgd.sync.membership import MembershipConfig
from mp_utils import run_processes
from toy_federation import config, max_diff, reference, run_inproc, train_cluster

NAMES = ["c0", "c1", "c2"]


def _config(mode: str):  # type: ignore[no-untyped-def]
    # a fresh federation starts together (as edit-train's does): nobody syncs before all three met
    return dataclasses.replace(config(mode, "edit_norm"), membership=MembershipConfig(expected=tuple(NAMES)))


def _cluster(rank: int, world: int, lighthouse: str, mode: str) -> dict:
    transport = lighthouse_transport(NAMES[rank], RankGroup(), lighthouse, collective_timeout_s=30)
    out = train_cluster(rank, transport, _config(mode), flush_each_step=mode == "overlap")
    return {"anchors": [[a.tolist() for a in unit] for unit in out.anchors]}


@pytest.mark.parametrize("mode", ["layerwise", pytest.param("overlap", marks=pytest.mark.slow)])
def test_gloo_processes_equal_threads_and_the_closed_form(mode: str) -> None:
    house = Lighthouse("127.0.0.1:0", auth.INSECURE, 1, 5.0, 5.0)
    try:
        procs = run_processes(_cluster, 3, house.address, mode)
    finally:
        house.shutdown()
    threads = run_inproc(NAMES, _config(mode), flush_each_step=mode == "overlap")
    ref = reference(3, 3, "edit_norm")
    for r, name in zip(procs, NAMES):
        anchors = [[torch.tensor(t) for t in unit] for unit in r["anchors"]]
        assert max_diff(anchors, threads[name].anchors) <= 1e-6, name
        assert max_diff(anchors, ref) <= 1e-6, name
