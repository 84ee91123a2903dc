"""Config keys that were renamed or moved: a user who sets the old name is told the new one in one line
(`cli/common.py`), instead of Hydra's "no such key". One rule for every retired key: refused, with a hint."""

from __future__ import annotations

# the rule parameters that moved under the rule that owns them (issue 36)
_NORM_TEST = ("anomaly", "ewma_alpha", "warmup_syncs", "z_threshold", "sigma_floor", "readmit_after", "regime_change")
_VERIFIED = ("sketch_dim", "direction_rate", "direction_alpha", "direction_z", "probe_tokens", "probe_tolerance",
             "retract", "report_tolerance", "max_token_ratio", "left_out")
_EDIT_NORM = ("weighting", "temperature", "step_weight_ratio")

RETIRED: dict[str, str] = {
    **{f"algo.penalty.{k}": f"algo.penalty.verified.{k} (rule verified) or algo.penalty.edit_norm.{k} "
       "(rule edit_norm): each rule owns its parameters" for k in _NORM_TEST},
    **{f"algo.penalty.{k}": f"algo.penalty.verified.{k}: the verified rule owns it" for k in _VERIFIED},
    **{f"algo.penalty.{k}": f"algo.penalty.edit_norm.{k}: the edit_norm rule owns it" for k in _EDIT_NORM},
}


def retired_hint(key: str) -> str | None:
    """`"<key> was retired: use <new>"`, or None for a key that was never retired."""
    new = RETIRED.get(key)
    return f"{key} was retired: use {new}" if new is not None else None
