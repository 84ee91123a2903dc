"""Every duration a user gives (seconds, and the link's milliseconds) is finite and positive, or >= 0 where
0 means "none": `federation.quorum_timeout_s=inf` used to pass validation and end in a traceback, `=nan` in a
quorum wait that never ended. Now each fails at start in one line naming the key (issue 35)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import run_cli, tiny_overrides

from edit_train.config import Config, ConfigError, validate
from edit_train.sim.faults import FaultError, parse_faults

# key -> whether 0 is allowed (it means "none" there: no delay, no budget, no latency, unlimited bandwidth)
KEYS = {
    "federation.join_timeout_s": False,
    "federation.heartbeat_timeout_s": False,
    "federation.quorum_timeout_s": False,
    "federation.collective_timeout_s": False,
    "cluster.timeout_s": False,
    "algo.sync_time_s": False,
    "run.restart_delay_s": True,
    "train.time_budget_s": True,
    "cluster.link.latency_ms": True,
    "cluster.link.bandwidth_mbps": True,
}


def _with(key: str, value: float) -> Config:
    cfg = Config()
    node: object = cfg
    *path, leaf = key.split(".")
    for part in path:
        node = getattr(node, part)
    setattr(node, leaf, value)
    return cfg


@pytest.mark.parametrize("key", sorted(KEYS))
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 0.0, -1.0])
def test_a_duration_must_be_finite_and_positive(key: str, value: float) -> None:
    if value == 0.0 and KEYS[key]:
        validate(_with(key, value))  # 0 means "none" here
        return
    with pytest.raises(ConfigError) as exc:
        validate(_with(key, value))
    msg = str(exc.value)
    assert msg.startswith(f"{key}: must be ") and "\n" not in msg, msg
    assert f"e.g. {key}=" in msg  # what to give instead
    if not math.isfinite(value):
        assert "finite" in msg and str(value) in msg


@pytest.mark.parametrize("key", sorted(KEYS))
def test_a_finite_positive_duration_passes(key: str) -> None:
    validate(_with(key, 2.5))


def test_inf_quorum_timeout_through_the_cli_is_one_line(tmp_path: Path) -> None:
    """The issue's command: one line naming the key, exit 2, promptly, and no run directory left."""
    proc = run_cli("edit-train", "edit_train.cli.train",
                   [*tiny_overrides(tmp_path / "run"), "federation.quorum_timeout_s=inf"], timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert err[0].startswith("error: federation.quorum_timeout_s: must be a finite number of seconds > 0, got inf")
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


def test_nan_timeout_for_the_lighthouse_is_one_line(tmp_path: Path) -> None:
    """`edit-train-lighthouse` reads federation.join_timeout_s / heartbeat_timeout_s itself."""
    proc = run_cli("edit-train-lighthouse", "edit_train.cli.lighthouse",
                   ["--bind", "127.0.0.1:0", "federation.heartbeat_timeout_s=nan"], timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert err[0].startswith("error: federation.heartbeat_timeout_s: must be a finite number of seconds > 0, got nan")


@pytest.mark.parametrize("seconds", [math.inf, math.nan, 0.0, -1.0])
def test_a_partition_needs_finite_seconds(seconds: float) -> None:
    with pytest.raises(FaultError, match=r"faults\[0\]\.seconds: a partition needs a finite number of seconds"):
        parse_faults([{"kind": "partition", "cluster": "c0", "step": 2, "seconds": seconds}])
