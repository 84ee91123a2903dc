"""What a simulation takes and gives back (shared by the local-SGD and the ddp simulators)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

BUCKETS = ("compute", "blocked", "sync", "eval", "checkpoint", "startup", "down")


@dataclass
class SimOptions:
    steps: int = 0  # a fixed run of this many steps (0: use horizon_s)
    horizon_s: float = 3600.0
    seed: int = 0
    min_issues: int = 24
    max_issues: int = 800
    tol: float = 0.01  # relative standard error of the throughput at which a horizon run stops simulating
    kills: list[tuple[int, int, float]] = field(default_factory=list)  # (cluster, at its step | -1, at s | -1)
    restart_s: float = 5.0  # a killed cluster trains again this long after its death (restart + start-up)
    max_restarts: int = 10
    startup: bool = True


@dataclass
class SimResult:
    names: list[str]
    wall_s: float
    tokens: float
    buckets: dict[str, np.ndarray]
    steps: np.ndarray  # steps trained per cluster
    bytes: np.ndarray
    useful: np.ndarray
    reserved: np.ndarray  # seconds each cluster was reserved (first start to its end)
    syncs: int = 0
    missed: int = 0
    restarts: int = 0
    events: int = 0  # heap events handled (asks, grace windows, issues, deaths, restarts)
    cluster_steps: int = 0  # cluster-steps drawn (each the slowest of its ranks)
    extrapolated: bool = False
    round_s: list[float] = field(default_factory=list)  # seconds between consecutive issued quorums

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.wall_s, 1e-9)

    @property
    def blocked_frac(self) -> np.ndarray:
        return self.buckets["blocked"] / np.maximum(self.reserved, 1e-9)

    @property
    def goodput(self) -> float:
        return float(self.useful.sum() / max(self.reserved.sum(), 1e-9))

    @property
    def bytes_per_token(self) -> float:
        return float(self.bytes.sum() / max(self.tokens, 1e-9))

    @property
    def bytes_per_s(self) -> float:
        return float(self.bytes.sum() / max(self.wall_s, 1e-9))
