"""Issue 48, restarts and failures under our launchers: Ctrl-C during start-up is one line, a relaunched cluster
resumes its own record, a worker dies with its launcher, a finished run or federation says so and exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import cli_env, script_cmd

LONE = ["cluster=local", "algo=edit", "logger=none", "train.progress=false", "train.seq_len=32",
        "train.batch_size=2", "train.eval_every=0", "train.eval_batches=1"]


@pytest.mark.parametrize("after_s", [1.0, 3.0, 7.0])
def test_ctrl_c_during_start_up_is_one_line(tmp_path: Path, small_corpus: str, after_s: float) -> None:
    """Acceptance 3: Ctrl-C (SIGINT to the process group, as a terminal sends it) 1, 3 and 7 s after `edit-train`
    starts — during its imports, composing the config, building the model — ends in one line, no traceback."""
    proc = subprocess.Popen([*script_cmd("edit-train", "edit_train.cli.train"), *LONE, "train.steps=100000",
                             f"data.source={small_corpus}", f"run.dir={tmp_path / 'run'}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(),
                            start_new_session=True, cwd=tmp_path)
    try:
        time.sleep(after_s)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "Traceback" not in out, out[-3000:]
    said = [line for line in out.splitlines() if "interrupted" in line]
    assert len(said) == 1 and said[0] == out.strip().splitlines()[-1], out[-3000:]
    assert proc.returncode == 130, out[-3000:]


def _lone(tmp_path: Path, small_corpus: str, *extra: str, env: dict[str, str] | None = None,
          timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*script_cmd("edit-train", "edit_train.cli.train"), *LONE, f"data.source={small_corpus}",
                           f"run.dir={tmp_path / 'run'}", *extra], capture_output=True, text=True,
                          env=env or cli_env(), cwd=tmp_path, timeout=timeout)


def test_resume_of_a_finished_run_says_so_and_exits_0(tmp_path: Path, small_corpus: str) -> None:
    """`resume=auto` of a finished run trained one more interval; it says the run is finished and exits 0
    (raising train.steps still continues it)."""
    first = _lone(tmp_path, small_corpus, "train.steps=4", "algo.interval=2", "checkpoint.every=2")
    assert first.returncode == 0, first.stderr[-3000:]
    events = (tmp_path / "run" / "metrics.jsonl").read_text()
    again = _lone(tmp_path, small_corpus, "train.steps=4", "algo.interval=2", "checkpoint.every=2", "resume=auto",
                  timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    said = again.stderr.strip().splitlines()
    assert len(said) == 1 and "holds a finished run (step 4 of train.steps=4)" in said[0], again.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == events  # nothing trained, nothing logged
    more = _lone(tmp_path, small_corpus, "train.steps=6", "algo.interval=2", "checkpoint.every=2", "resume=auto")
    assert more.returncode == 0, more.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["per_cluster"]["c0"]["steps"] == 6


def test_a_cluster_whose_federation_finished_exits_0_with_one_line(tmp_path: Path, small_corpus: str) -> None:
    """Cluster b, relaunched after a and c finished the run (their records in the shared run.dir), trained alone
    from its checkpoint after a silent wait for a quorum that never came; now it says so and exits 0 quickly —
    before it reaches for the Lighthouse (none listens at the address given)."""
    run = tmp_path / "run"
    (run / "clusters").mkdir(parents=True)
    now = time.time()
    for name in ("a", "c"):
        (run / "clusters" / f"{name}.progress.json").write_text(json.dumps({"tokens": 1, "saved_at": now - 5}))
        (run / "clusters" / f"{name}.json").write_text(json.dumps({"name": name, "steps": 20, "end": now - 4}))
    (run / "clusters" / "b.progress.json").write_text(json.dumps({"tokens": 1, "saved_at": now - 100}))
    fed = ["cluster.clusters=[{name:a,ranks:1},{name:b,ranks:1},{name:c,ranks:1}]", "train.steps=20",
           "federation.lighthouse=127.0.0.1:9", "federation.insecure=true"]
    t0 = time.monotonic()
    out = _lone(tmp_path, small_corpus, *fed, env=cli_env(EDIT_TRAIN_CLUSTER="b"), timeout=120)
    assert time.monotonic() - t0 < 30, out.stderr[-3000:]
    assert out.returncode == 0, out.stderr[-3000:]
    said = [line for line in out.stderr.strip().splitlines() if "resuming it" not in line]
    assert len(said) == 1 and "its federation finished without it (a at step 20, c at step 20" in said[0], out.stderr
    # a peer that resumed since its record (it trains again) is not finished: b does not stop for it
    (run / "clusters" / "c.progress.json").write_text(json.dumps({"tokens": 1, "saved_at": time.time()}))
    from edit_train.train.finished import finished_line

    assert finished_line(run, "b", ["a", "b", "c"], 20, federated=True) is None


def test_a_relaunched_cluster_job_resumes_its_own_run(tmp_path: Path, small_corpus: str, monkeypatch) -> None:
    """"Restart it the same way" was refused ("already holds cluster b's run … continue it with resume=auto"):
    a cluster job over its own progress record continues it, in one line; an explicit resume=false is kept."""
    from edit_train.cli.checks import precheck

    run = tmp_path / "run"
    (run / "checkpoints" / "b" / "step_00000004").mkdir(parents=True)
    (run / "clusters").mkdir()
    monkeypatch.setenv("EDIT_TRAIN_CLUSTER", "b")
    argv = [*LONE, f"data.source={small_corpus}", f"run.dir={run}",
            "cluster.clusters=[{name:a,ranks:1},{name:b,ranks:1}]"]
    with pytest.raises(SystemExit):  # no progress record: not this cluster's run to continue
        precheck(argv)
    (run / "clusters" / "b.progress.json").write_text(json.dumps({"tokens": 8, "saved_at": time.time()}))
    _guard, added = precheck(argv)
    assert "resume=auto" in added
    with pytest.raises(SystemExit):
        precheck([*argv, "resume=false"])
