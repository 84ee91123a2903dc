"""The loss side, kept apart from the time side: how many tokens an algorithm needs to reach the loss a
fully synchronous run (ddp) reaches, as a function of clusters M, interval H and model size N.

Form (the DiLoCo scaling-law study's shape, Charles et al. 2025: the penalty of M replicas over data
parallelism grows with M and with the interval and shrinks as the model grows):

    tokens_alg / tokens_ddp  =  1 + κ_alg · (M − 1) · log2(H) / log2(H₀) · (N / N₀)^(−γ)

* the data curve of ddp, `L(D) = E + B · D^(−β)`, is fitted to the project's own convergence runs
  (`results/convergence.json`: val loss vs tokens, 3 seeds); each local-SGD algorithm's κ is then read off
  its final loss at the same token budget (the ddp tokens that reach that loss), per seed — the spread over
  seeds is the error bar;
* γ is the prior's (0.3: not identifiable from one model size), N₀, H₀ and M=2 are the runs';
* A-EDiT has no convergence runs: it takes EDiT's κ (its time-based interval ≈ EDiT's H at equal speed);
  compression multiplies by the tokens its measured loss ratio (`results/compression.json`: int8 and top-k
  settings; fp8 taken as int8's; `results/compression_2026.json`: top-k with error feedback as outer momentum,
  `sync.error_feedback_decay` < 1, its own labels) costs on the ddp curve, never below 1; a dense scheme without
  a measurement is 1, a top-k setting without one takes the worst top-k factor measured.

With no convergence data every κ is the prior (0.05 ± 0.05) and the report says "prior". The quality side
never enters a throughput figure: the planner shows tokens/s and this multiplier in separate columns and
recommends on their ratio (DDP-equivalent tokens per second).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

GAMMA_PRIOR = 0.3
KAPPA_PRIOR = (0.05, 0.05)
REPO = Path(__file__).resolve().parents[2]
# `benchmarks/compression.py` results the loss model reads, in this order: the 2024 schemes, then issue 51's
# error feedback as outer momentum (a label's factor comes from the first file that measured it)
COMPRESSION_RESULTS = (REPO / "results" / "compression.json", REPO / "results" / "compression_2026.json")


@dataclass
class LossModel:
    kappa: dict[str, tuple[float, float]] = field(default_factory=dict)  # algo -> (mean, std over seeds)
    compression: dict[str, float] = field(default_factory=dict)  # scheme -> loss-tokens factor
    ddp_curve: tuple[float, float, float] = (0.0, 0.0, 0.0)  # E, B, beta
    clusters0: int = 2
    interval0: int = 8
    params0: int = 1
    gamma: float = GAMMA_PRIOR
    source: str = "prior"

    def multiplier(self, algo: str, clusters: int, interval: float, params: int, compression: str = "none",
                   ) -> tuple[float, float]:
        """(tokens_alg / tokens_ddp to the same loss, its standard error)."""
        if algo == "ddp" or clusters <= 1:
            return 1.0, 0.0
        k, sd = self.kappa.get(algo, self.kappa.get("edit", KAPPA_PRIOR))
        scale = (clusters - 1) / max(self.clusters0 - 1, 1) * math.log2(max(interval, 2)) / math.log2(
            max(self.interval0, 2)) * (max(params, 1) / max(self.params0, 1)) ** (-self.gamma)
        comp = self.compression.get(compression, self.unmeasured(compression))
        return (1.0 + k * scale) * comp, sd * scale * comp

    def unmeasured(self, label: str) -> float:
        """A compression without a measured loss ratio: 1 for the dense ones; a top-k setting takes the worst
        top-k factor measured (its loss is unknown, so it is not credited with a good one)."""
        if not label.startswith("topk"):
            return 1.0
        return max((v for k, v in self.compression.items() if k.startswith("topk")), default=1.0)

    def to_json(self) -> dict[str, Any]:
        return {"kappa": {k: list(v) for k, v in self.kappa.items()}, "compression": self.compression,
                "ddp_curve": list(self.ddp_curve), "clusters0": self.clusters0, "interval0": self.interval0,
                "params0": self.params0, "gamma": self.gamma, "source": self.source}


def fit_curve(tokens: np.ndarray, loss: np.ndarray) -> tuple[float, float, float]:
    """L(D) = E + B·D^(−β) by a grid over β and least squares for (E, B)."""
    keep = tokens > 0
    d, y = tokens[keep], loss[keep]
    best = (math.inf, 0.0, 0.0, 0.0)
    for beta in np.linspace(0.05, 1.5, 146):
        x = d ** (-beta)
        a = np.vstack([np.ones_like(x), x]).T
        (e, b), *_ = np.linalg.lstsq(a, y, rcond=None)
        if b <= 0:
            continue
        err = float(((a @ np.array([e, b]) - y) ** 2).sum())
        if err < best[0]:
            best = (err, float(e), float(b), float(beta))
    return best[1], best[2], best[3]


def tokens_for(curve: tuple[float, float, float], loss: float) -> float:
    e, b, beta = curve
    if loss <= e or b <= 0:
        return math.inf
    return ((loss - e) / b) ** (-1.0 / beta)


def fit(convergence: dict[str, Any], compression: dict[str, Any] | list[dict[str, Any]] | None = None,
        params: int = 0) -> LossModel:
    """κ per algorithm from a `benchmarks/convergence.py` result (and loss ratios from one or more
    `compression.py` results: each ratio is to its own file's uncompressed run, the first file's wins a label
    measured twice)."""
    curves, setup = convergence["curves"], convergence.get("setup", {})
    t = np.concatenate([np.array(c["tokens_M"]) * 1e6 for c in curves["ddp"].values()])
    y = np.concatenate([np.array(c["val_loss"]) for c in curves["ddp"].values()])
    model = LossModel(ddp_curve=fit_curve(t, y), interval0=int(setup.get("interval", 8)),
                      clusters0=2 if "2x1" in str(setup.get("cluster", "2x1")) else int(setup.get("clusters", 2)),
                      params0=params or 1, source="results/convergence.json")
    for algo, seeds in convergence.get("per_seed_algo", _per_seed(convergence)).items():
        if algo == "ddp":
            continue
        ks = []
        for tokens, loss in seeds:
            need = tokens_for(model.ddp_curve, loss)
            ks.append(tokens / need - 1.0 if math.isfinite(need) and need > 0 else math.nan)
        ks = [k for k in ks if math.isfinite(k)]
        if ks:
            model.kappa[algo] = (float(np.mean(ks)), float(np.std(ks, ddof=1)) if len(ks) > 1 else abs(ks[0]))
    if "edit" in model.kappa:
        model.kappa.setdefault("a_edit", model.kappa["edit"])
    for result in [compression] if isinstance(compression, dict) else compression or []:
        base, ratios = _compression_factors(result)
        for k, r in ratios.items():
            model.compression.setdefault(k, _token_factor(model.ddp_curve, base, r))
    return model


def _token_factor(curve: tuple[float, float, float], loss: float, ratio: float) -> float:
    """Tokens multiplier m with L(D / m) = ratio · L(D) at the loss `loss` (never below 1: a compressed run
    that came out better within seed noise is not credited)."""
    base, worse = tokens_for(curve, loss), tokens_for(curve, loss * ratio)
    if not (math.isfinite(base) and math.isfinite(worse)) or worse <= 0:
        return 1.0
    return max(1.0, base / worse)


def _per_seed(convergence: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {}
    for seed in convergence.get("per_seed", {}).values():
        for algo, r in seed.get("results", {}).items():
            out.setdefault(algo, []).append((float(r["tokens"]), float(r["final_val_loss"])))
    return out


def _compression_factors(data: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """(val loss of the uncompressed run, loss ratio to it per compression label — `traffic.Codec.label`,
    top-k with its settings) from `benchmarks/compression.py`'s JSON: its `schemes` (name -> overrides) and
    `results.convergence.rows` (name -> loss_ratio)."""
    out: dict[str, float] = {}
    conv = (data.get("results") or {}).get("convergence") or {}
    rows = conv.get("rows") if isinstance(conv, dict) else None
    schemes = data.get("schemes") or {}
    base = 2.0
    for row in rows if isinstance(rows, list) else []:
        if not isinstance(row, dict) or not row.get("loss_ratio"):
            continue
        label = _label_of(schemes.get(row.get("scheme"), []))
        if label == "none" and row.get("val_loss"):
            base = float(row["val_loss"]) if "none" not in out else base
        if label:
            out.setdefault(label, float(row["loss_ratio"]))
    if "int8" in out:
        out.setdefault("fp8", out["int8"])
    return base, out


def _label_of(overrides: list[str]) -> str:
    """The compression label of a `benchmarks/compression.py` scheme's overrides ("" if it is not one)."""
    from edit_train.plan.traffic import Codec

    keys = dict(o.split("=", 1) for o in overrides if isinstance(o, str) and o.startswith("sync."))
    try:
        c = Codec(keys.get("sync.compression", "none"), density=float(keys.get("sync.topk_density", 0.01)),
                  bits=int(keys.get("sync.bits", 2)), group=int(keys.get("sync.topk_group", 1)),
                  unsent=keys.get("sync.unsent", "resend"), ef_decay=float(keys.get("sync.error_feedback_decay", 1)))
    except ValueError:
        return ""
    return c.label if c.error() is None else ""


def default_model(params: int = 0) -> LossModel:
    """Fitted to the repository's convergence (and compression) results if present, else the prior."""
    conv = REPO / "results" / "convergence.json"
    if not conv.is_file():
        return LossModel()
    try:
        convergence = json.loads(conv.read_text())
        comps = [json.loads(p.read_text()) for p in COMPRESSION_RESULTS if p.is_file()]
        from edit_train.plan.hardware import model_facts

        base = model_facts(str(convergence.get("setup", {}).get("model", "tiny"))).total_params
        return fit(convergence, comps, base or params)
    except (OSError, ValueError, KeyError, TypeError):
        return LossModel()
