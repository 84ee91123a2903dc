"""The calibrated costs the simulator runs on: one small JSON file (`edit-train-plan calibrate` writes it).

* `clusters`: per calibrated cluster, one rank's step-time distribution (`dist.StepDist`, fitted so that the
  slowest of the cluster's ranks matches what the run measured), its rank count, slowdown and tokens per
  step; `rank_step` pools them (at slowdown 1) for a cluster of the plan that was not calibrated;
* `sync`: the sync's software cost, fitted as `time = n_ops · per_op_s + bytes / sw_bytes_per_s` over at
  least two message sizes (the simulated or real link's own latency + bytes / bandwidth come on top);
  `quorum_s` (one Lighthouse round), `sync_work_s` (this cluster's own work per sync: norms, outer step,
  copies) and `probe_s` (the verified rule's usefulness probe per sync);
* `eval_s`, `checkpoint_s`, `startup_s` (process start to first step), `other_step_s` (data loading and
  bookkeeping per step) — all seconds, all measured from `per_cluster.time` buckets and `train` events;
* `codec`: per compression label (`traffic.Codec.label`), the codec's measured cost on this host —
  `{"encode": [s per call, s per value], "decode": [...]}` (`edit-train plan calibrate` times the real codec,
  `edit_train/cli/codec_cost.py`); a top-k setting that was not timed takes the nearest one that was;
  `codec_compile_s`: the CPU seconds one process spends compiling a top-k format's kernels the first time this
  host uses that format (`codec/compiled.py`: the simulator adds it to start-up for a format not yet compiled);
* `conditions`: the host's load, cores and a micro-benchmark's speed when the profile was taken
  (`conditions.py`: a plan says in one line when they no longer hold);
* `fit`: how well each part was determined (samples, residuals), printed next to every prediction.

`Profile.default()` is what a plan uses with no calibration: GPU-scale guesses, marked uncalibrated.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edit_train.plan.conditions import Conditions
from edit_train.plan.dist import StepDist
from edit_train.plan.traffic import Codec

VERSION = 1


@dataclass
class ClusterProfile:
    ranks: int
    dist: StepDist  # one rank, at the slowdown below
    slowdown: float = 1.0
    tokens_per_step: int = 0
    mean_step_s: float = 0.0  # measured: the cluster's step (slowest rank), compute + slowdown
    std_step_s: float = 0.0
    samples: int = 0


@dataclass
class Profile:
    clusters: dict[str, ClusterProfile] = field(default_factory=dict)
    rank_step: StepDist | None = None  # pooled, slowdown 1
    per_op_s: float = 0.005
    sw_bytes_per_s: float = 10e9
    quorum_s: float = 0.06
    sync_work_s: float = 0.0
    sync_work_per_param_s: float = 2e-9
    probe_s: float = 0.0
    eval_s: float = 0.0
    checkpoint_s: float = 0.0
    startup_s: float = 60.0
    other_step_s: float = 0.0
    model: str = ""
    batch_size: int = 0
    seq_len: int = 0
    calibrated: bool = False
    sources: list[str] = field(default_factory=list)
    codec: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # label -> encode/decode [call, value]
    codec_compile_s: float = 0.0  # CPU seconds per process to compile a new top-k format's kernels
    conditions: dict[str, Any] = field(default_factory=dict)  # conditions.Conditions.to_json() when taken
    fit: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def default() -> Profile:
        return Profile()

    def sync_software_s(self, n_ops: float, nbytes: float) -> float:
        """The fitted software cost of moving `nbytes` in `n_ops` collectives (without the link)."""
        bw = self.sw_bytes_per_s if self.sw_bytes_per_s > 0 else math.inf
        return n_ops * self.per_op_s + nbytes / bw

    def codec_s(self, codec: Codec, enc: tuple[float, float], dec: tuple[float, float]) -> float:
        """Seconds the codec of `codec` takes to encode `enc` = (calls, values) and decode `dec` (0 when the
        profile has no timing of it, or nothing is compressed)."""
        if not codec.lossy:
            return 0.0
        cost = self.codec.get(codec.label) or self.codec.get(nearest_timed(codec, self.codec))
        if not cost:
            return 0.0
        (ec, ev), (dc, dv) = cost["encode"], cost["decode"]
        return enc[0] * ec + enc[1] * ev + dec[0] * dc + dec[1] * dv

    def taken_under(self) -> Conditions | None:
        return Conditions.from_json(self.conditions)

    def work_s(self, params: int) -> float:
        """This cluster's own work per sync (norms, outer step, copies): measured, else ∝ parameters."""
        return self.sync_work_s if self.sync_work_s > 0 else params * self.sync_work_per_param_s

    # ---------------------------------------------------------------- JSON
    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["version"] = VERSION
        out["clusters"] = {k: {**asdict(v), "dist": v.dist.to_json()} for k, v in self.clusters.items()}
        out["rank_step"] = self.rank_step.to_json() if self.rank_step else None
        return out

    @staticmethod
    def from_json(data: dict[str, Any], where: str = "profile") -> Profile:
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"{where}: not a planner profile (version {VERSION}); make one with "
                             "`edit-train-plan calibrate RUN_DIR...`")
        raw = {k: v for k, v in data.items() if k != "version"}
        try:
            clusters = {str(k): ClusterProfile(**{**v, "dist": StepDist(**v["dist"])})
                        for k, v in (raw.pop("clusters") or {}).items()}
            rank = raw.pop("rank_step")
            return Profile(clusters=clusters, rank_step=StepDist(**rank) if rank else None, **raw)
        except (TypeError, KeyError, ValueError) as exc:
            raise ValueError(f"{where}: malformed profile ({exc}); recalibrate it") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        tmp.replace(path)
        return path

    @staticmethod
    def load(path: str | Path) -> Profile:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"profile {path}: cannot be read ({exc})") from None
        return Profile.from_json(data, str(path))


def nearest_timed(codec: Codec, timed: dict[str, Any]) -> str:
    """The timed top-k label closest to `codec`'s settings (log₂ group, bits / 2, log₂ density)."""
    if not codec.sparse:
        return ""
    best, label = math.inf, ""
    for key in timed:
        other = _parse_topk(key)
        if other is None:
            continue
        d, b, g = other
        dist = ((math.log2(g) - math.log2(codec.group)) ** 2 + ((b - codec.bits) / 2) ** 2
                + (math.log2(d) - math.log2(codec.density)) ** 2)
        if dist < best:
            best, label = dist, key
    return label


def _parse_topk(label: str) -> tuple[float, int, int] | None:
    """(density, bits, group) of a `topk(d,Bb,gG[,keep])` label."""
    if not (label.startswith("topk(") and label.endswith(")")):
        return None
    try:
        parts = label[5:-1].split(",")
        return float(parts[0]), int(parts[1].rstrip("b")), int(parts[2].lstrip("g"))
    except (IndexError, ValueError):
        return None
