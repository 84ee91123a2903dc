"""`edit-train --cfg job <overrides>` (the form `--help` shows): the overrides edit-train adds for the user
(`cluster.slowdown=[]` with `cluster.count`, `cluster=real` for a real federation's job) go next to the user's
own, never between a flag and them (Hydra then reads the user's as `unrecognized arguments`)."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from conftest import cli_env, script_cmd
from edit_train.cli.common import add_overrides


@pytest.mark.parametrize("argv, added, want", [
    (["--cfg", "job", "cluster.count=3"], ["x=1"], ["--cfg", "job", "cluster.count=3", "x=1"]),
    (["cluster.count=3", "--cfg", "job"], ["x=1"], ["cluster.count=3", "x=1", "--cfg", "job"]),
    (["--cfg", "job"], ["x=1"], ["x=1", "--cfg", "job"]),
    (["--info"], ["x=1"], ["x=1", "--info"]),
    (["--info", "config", "a=1"], ["x=1"], ["--info", "config", "a=1", "x=1"]),
    (["-cn", "config", "a=1", "--package", "_global_"], ["x=1"], ["-cn", "config", "a=1", "x=1", "--package",
                                                                  "_global_"]),
    (["a=1"], [], ["a=1"]),
])
def test_added_overrides_sit_next_to_the_users(argv: list[str], added: list[str], want: list[str]) -> None:
    assert add_overrides(argv, added) == want


@pytest.mark.parametrize("overrides, expect", [
    (["cluster.count=3"], {"count": 3, "slowdown": []}),
    (["federation.lighthouse=127.0.0.1:29510", "cluster.only=b"], {"name": "real"}),
])
def test_cfg_job_with_overrides_that_add_a_preset(overrides: list[str], expect: dict) -> None:
    proc = subprocess.run([*script_cmd("edit-train", "edit_train.cli.train"), "--cfg", "job", *overrides],
                          capture_output=True, text=True, timeout=300, env=cli_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "unrecognized arguments" not in proc.stderr
    cluster = yaml.safe_load(proc.stdout)["cluster"]
    assert {k: cluster[k] for k in expect} == expect, cluster
