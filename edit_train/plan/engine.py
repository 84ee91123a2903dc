"""One entry point for a simulation: ddp (`simddp`) or local SGD (`sim`)."""

from __future__ import annotations

from edit_train.plan.costs import Fed
from edit_train.plan.sim import run_local
from edit_train.plan.simbase import SimOptions, SimResult
from edit_train.plan.simddp import run_ddp
from edit_train.plan.spec import Candidate


def simulate(fed: Fed, cand: Candidate, opt: SimOptions | None = None) -> SimResult:
    opt = opt or SimOptions()
    return run_local(fed, cand, opt) if cand.local_sgd else run_ddp(fed, cand, opt)
