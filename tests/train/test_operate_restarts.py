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
    from edit_train.train.finished import finished_line

    # restarted by its launcher after a failure (the run counts on it): it finishes its part
    assert finished_line(run, "b", ["a", "b", "c"], 20, federated=True, restarted=True) is None
    # a peer that resumed since its record (it trains again) is not finished: b does not stop for it
    (run / "clusters" / "c.progress.json").write_text(json.dumps({"tokens": 1, "saved_at": time.time()}))
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


# ----------------------------------------------------------------------------------------------------------
# under torchrun_multinode.sh

REPO = Path(__file__).resolve().parents[2]
MULTINODE = REPO / "launchers" / "torchrun_multinode.sh"
JOB = ["cluster=local", "algo=edit", "algo.interval=2", "model=tiny", "logger=none", "train.progress=false", "train.seq_len=32",
       "train.batch_size=2", "train.eval_every=0", "train.eval_batches=1", "train.log_every=2",
       "cluster.clusters=[{name:a,ranks:1}]", "federation.min_clusters=1", "federation.heartbeat_timeout_s=2",
       "federation.join_timeout_s=2", "checkpoint.every=2"]


def _job_env(address: str, key: str) -> dict[str, str]:
    from test_launchers import free_port

    env = cli_env(CLUSTER="a", LIGHTHOUSE=address, NNODES="1", NODE_RANK="0", NPROC_PER_NODE="1",
                  RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", HOST_ADDR="127.0.0.1", MAX_RESTARTS="0",
                  GLOO_SOCKET_IFNAME="lo", KEY_FILE=key, EDIT_SKIP_TOPOLOGY_CHECK="1")
    for var in ("EDIT_DRY_RUN", "EDIT_TRAIN_CLUSTER"):
        env.pop(var, None)
    return env


def _gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" in status  # a zombie nobody reaped yet has ended


@pytest.mark.slow  # two launches of a cluster job around a Lighthouse (~1-2 min on 2 busy cores)
def test_kill_9_of_the_launcher_takes_the_worker_and_the_relaunch_resumes_in_one_try(tmp_path: Path,
                                                                                    small_corpus: str) -> None:
    """SIGKILL of a cluster's launcher (torchrun_multinode.sh, i.e. the torchrun it runs) left its worker training
    and holding the run lock; the relaunch was refused 4 times, then by "already holds cluster a's run". Now the
    worker is gone within 5 s, and the same command again resumes the cluster's run, in one line, at once."""
    from conftest import start_lighthouse
    from test_launchers import KEY

    run = tmp_path / "run"
    house, address = start_lighthouse(tmp_path, f"federation.key_file={KEY}")
    cmd = ["bash", str(MULTINODE), *JOB, f"data.source={small_corpus}", f"run.dir={run}"]
    try:
        first = subprocess.Popen([*cmd, "train.steps=100000"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, env=_job_env(address, KEY), cwd=tmp_path, start_new_session=True)
        try:
            deadline = time.time() + 240
            while time.time() < deadline and not list((run / "checkpoints" / "a").glob("step_*/manifest.json")):
                assert first.poll() is None, first.communicate()[0][-3000:]
                time.sleep(0.5)
            lock = json.loads((run / "clusters" / "a.lock").read_text())
            worker = int(lock["pid"])
            assert worker != first.pid and not _gone(worker)
            first.kill()  # kill -9 of the launcher (exec'd into torchrun's wrapper): nothing else is signalled
            first.wait()
            t0 = time.monotonic()
            while not _gone(worker) and time.monotonic() - t0 < 10:
                time.sleep(0.1)
            assert _gone(worker) and time.monotonic() - t0 <= 5.0, "the worker outlived its launcher"
        finally:
            if first.poll() is None:
                os.killpg(first.pid, signal.SIGKILL)
                first.wait()
        saved = max(int(p.parent.name.split("_")[1]) for p in (run / "checkpoints" / "a").glob("step_*/manifest.json"))
        again = subprocess.run([*cmd, f"train.steps={saved + 2}"], capture_output=True, text=True,
                               env=_job_env(address, KEY), cwd=tmp_path, timeout=300)
    finally:
        house.send_signal(signal.SIGTERM)
        house.wait(timeout=30)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-4000:]
    assert "cluster a: run.dir" in out and "resuming it (resume=auto)" in out, out[-4000:]
    assert f"(step {saved})" in out and "is being written by" not in out and "Traceback" not in out, out[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["per_cluster"]["a"]["steps"] == saved + 2


@pytest.mark.slow  # a cluster job around a Lighthouse (~1 min on 2 busy cores)
def test_ctrl_c_of_a_cluster_job_under_torchrun_is_one_line(tmp_path: Path, small_corpus: str) -> None:
    """Ctrl-C of torchrun_multinode.sh while it trains: the worker's one line, not ~30 lines of torchrun's
    traceback after it (those are in the torchrun log the launcher keeps)."""
    from conftest import start_lighthouse
    from test_launchers import KEY

    run = tmp_path / "run"
    house, address = start_lighthouse(tmp_path, f"federation.key_file={KEY}")
    try:
        proc = subprocess.Popen(["bash", str(MULTINODE), *JOB, f"data.source={small_corpus}", f"run.dir={run}",
                                 "train.steps=100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=_job_env(address, KEY), cwd=tmp_path, start_new_session=True)
        try:
            deadline = time.time() + 240
            while time.time() < deadline and not list((run / "checkpoints" / "a").glob("step_*/manifest.json")):
                assert proc.poll() is None, proc.communicate()[1][-3000:]
                time.sleep(0.5)
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    finally:
        house.send_signal(signal.SIGTERM)
        house.wait(timeout=30)
    console = out + err
    assert proc.returncode != 0, console[-3000:]
    assert "Traceback" not in console and "ChildFailedError" not in console, console[-3000:]
    last = console.strip().splitlines()[-1]
    assert last.startswith("error: interrupted") and "intact" in last, console[-3000:]
    kept = (run / "clusters" / "a.node0.torchrun.log").read_text()
    assert "error: interrupted" in kept


def test_a_held_run_lock_is_refused_before_torchrun_starts(tmp_path: Path) -> None:
    """The launcher checks the cluster's run lock before torchrun starts: one line naming the holder, exit 2, no
    torchrun traceback (it used to be refused inside the worker, then 41 lines of torchrun)."""
    from edit_train.train import runlock

    run = tmp_path / "run"
    key = runlock.acquire(run, "a")
    try:
        env = _job_env("127.0.0.1:9", "")
        env.pop("KEY_FILE")
        out = subprocess.run(["bash", str(MULTINODE), *JOB, f"run.dir={run}"], capture_output=True, text=True,
                             env=env, cwd=tmp_path, timeout=120)
    finally:
        runlock.release(key)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr
    assert lines[-1].startswith("error: run.dir") and f"PID {os.getpid()}" in lines[-1], out.stderr
    assert "Traceback" not in out.stderr and "torchrun" not in lines[-1]
    assert not (run / "clusters" / "a.node0.torchrun.log").exists()


TORCHRUN_FAILED = """\
error: interrupted (stopped by signal 2 at step 7); the newest complete checkpoint run/checkpoints/a/step_6 is intact
W1128 01:02:03.456000 4242 torch/distributed/elastic/agent/server/api.py:704] Received 2 death signal, shutting down workers
W1128 01:02:03.457000 4242 torch/distributed/elastic/multiprocessing/api.py:897] Sending process 4243 closing signal SIGINT
Traceback (most recent call last):
  File "/usr/bin/torchrun", line 8, in <module>
    sys.exit(main())
  File "/usr/lib/python3/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 355, in wrapper
    return f(*args, **kwargs)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
edit_train.cli.train FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
============================================================
"""

WORKER_BUG = """\
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/src/edit_train/cli/train.py", line 1, in <module>
ZeroDivisionError: division by zero
"""


def test_torchruns_own_report_goes_to_the_log_only(tmp_path: Path) -> None:
    """What the console shows of a failed cluster job: the worker's one line (and a worker's own traceback, a
    bug worth seeing), never torchrun's report; the log keeps everything."""
    import io

    from edit_train.cli.torchrun_wrap import Filter

    console, log = io.StringIO(), io.StringIO()
    out = Filter(console, log)
    for line in (WORKER_BUG + TORCHRUN_FAILED).splitlines(keepends=True):
        out.line(line)
    out.close()
    assert console.getvalue() == WORKER_BUG + TORCHRUN_FAILED.splitlines(keepends=True)[0]
    assert log.getvalue() == WORKER_BUG + TORCHRUN_FAILED
    assert out.said and out.hidden == len(TORCHRUN_FAILED.splitlines()) - 1


def test_a_whole_run_is_finished_when_every_cluster_is(tmp_path: Path) -> None:
    """The local launcher's check (`resume=auto` of a finished local federation): every configured cluster's
    record, one of them at train.steps; a cluster without its record, or with steps still to go, trains."""
    from edit_train.train.finished import run_finished_line

    (tmp_path / "clusters").mkdir()
    now = time.time()
    (tmp_path / "clusters" / "c0.json").write_text(json.dumps({"name": "c0", "steps": 20, "end": now}))
    assert run_finished_line(tmp_path, ["c0", "c1"], 20) is None
    (tmp_path / "clusters" / "c1.json").write_text(json.dumps({"name": "c1", "steps": 14, "end": now}))
    line = run_finished_line(tmp_path, ["c0", "c1"], 20)
    assert line is not None and "every cluster finished: c0 at step 20, c1 at step 14; train.steps=20" in line
    assert run_finished_line(tmp_path, ["c0", "c1"], 30) is None  # train.steps raised: it continues


TORCHRUN_BY_MODULE = """\
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "<frozen runpy>", line 88, in _run_code
  File "/usr/lib/python3/torch/distributed/run.py", line 1032, in <module>
    main()
torch.distributed.elastic.multiprocessing.api.SignalException: Process 15011 got signal: 2
"""


def test_torchrun_run_as_a_module_hides_its_traceback_too() -> None:
    """The launcher runs `python -m torch.distributed.run` (its own Python's torchrun): runpy's frames come first,
    then torchrun's — still torchrun's report, kept in the log only (a Ctrl-C under torchrun showed it)."""
    import io

    from edit_train.cli.torchrun_wrap import Filter

    console, log = io.StringIO(), io.StringIO()
    out = Filter(console, log)
    for line in ("error: interrupted (stopped by signal 2 at step 4)\n" + TORCHRUN_BY_MODULE).splitlines(True):
        out.line(line)
    out.close()
    assert console.getvalue() == "error: interrupted (stopped by signal 2 at step 4)\n"
    assert log.getvalue().endswith(TORCHRUN_BY_MODULE) and out.torchrun_failed
