"""Issue 49, operators: what an operator's machine does to a run ends in one line naming the path or address and
what is intact, exit 2 (a launcher restarts no job that exits 2): a disk filling mid-run and a read-only
`checkpoints/` (a tmpfs / a read-only bind mount in a mount namespace of the run's own, `unshare`), a read-only
`run.dir`, a `federation.host` that is not an address of this machine; and `edit-train-lighthouse` exits on
every double SIGTERM (its handler only sets a flag)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import cli_env, script_cmd
from edit_train.cli import lighthouse

TINY = ["model=tiny", "logger=none", "train.progress=false", "train.seq_len=32", "train.batch_size=2",
        "train.eval_every=0", "train.eval_batches=1", "train.log_every=1", "train.threads=1", "data.source=stdlib"]
LONE = ["algo=ddp", "cluster=local", *TINY]
TRAIN = ("edit-train", "edit_train.cli.train")
FOREIGN = "10.255.255.1"  # an address no interface of a test machine has


def _one_error_line(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


def _mounts() -> list[str] | None:
    """The command prefix that runs a shell in a mount namespace of its own (root: `unshare -m`; otherwise a
    user namespace mapped to root), or None where this host allows neither."""
    if shutil.which("unshare") is None:
        return None
    for prefix in (["unshare", "-m"], ["unshare", "-rm"]):
        if subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    return None


def _in_namespace(setup: str, args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`edit-train ARGS` after the shell commands `setup` (mounts), in a mount namespace of its own."""
    prefix = _mounts()
    if prefix is None:
        pytest.skip("no mount namespaces on this host (unshare)")
    cmd = " ".join(shlex.quote(a) for a in [*script_cmd(*TRAIN), *args])
    return subprocess.run([*prefix, "sh", "-c", f"set -e; {setup}; exec {cmd}"], capture_output=True, text=True,
                          timeout=timeout, env=cli_env())


def _read_only(path: Path) -> str:
    p = shlex.quote(str(path))
    return f"mount --bind {p} {p}; mount -o remount,bind,ro {p}"


# ----------------------------------------------------------------------------------- disks


def test_a_disk_filling_mid_run_is_one_line_and_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    """checkpoints/ on a 30 MiB file system: the step-2 checkpoint (21 MiB) fits, the step-4 one does not."""
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    ckpt.mkdir(parents=True)
    proc = _in_namespace(f"mount -t tmpfs -o size=30m tmpfs {shlex.quote(str(ckpt))}",
                         [*LONE, "train.steps=4", "checkpoint.every=2", f"run.dir={run_dir}"])
    line = _one_error_line(proc, "cannot save checkpoint step 4", str(ckpt), "No space left on device",
                           "step_00000002 is intact")
    assert "resume=auto" in line


def test_a_read_only_checkpoints_folder_is_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    ckpt.mkdir(parents=True)
    proc = _in_namespace(_read_only(ckpt), [*LONE, "train.steps=2", f"run.dir={run_dir}"])
    _one_error_line(proc, "cannot save checkpoint step 2", str(ckpt), "Read-only file system",
                    "no checkpoint of this run was complete")


@pytest.mark.parametrize("fresh", [True, False], ids=["new run.dir", "existing run.dir"])
def test_a_read_only_run_dir_is_one_line_and_writes_nothing(tmp_path: Path, fresh: bool) -> None:
    parent = tmp_path / "ro"
    parent.mkdir()
    run_dir = parent / "run"
    if not fresh:
        run_dir.mkdir()
        (run_dir / "notes.txt").write_text("an earlier run's\n")
    before = sorted(str(p) for p in parent.rglob("*"))
    proc = _in_namespace(_read_only(parent), [*LONE, "train.steps=2", f"run.dir={run_dir}", "resume=auto"])
    where = str(parent) if fresh else str(run_dir)
    _one_error_line(proc, f"run.dir: {where} is not writable", "Read-only file system", "nothing was written")
    assert sorted(str(p) for p in parent.rglob("*")) == before


# ----------------------------------------------------------------------------------- addresses


def test_a_foreign_federation_host_is_one_line_and_no_restart(tmp_path: Path) -> None:
    """A local federation told to bind its cross-cluster traffic to an address of another machine: one line
    before any cluster starts (before, the Lighthouse's bind raised a traceback)."""
    proc = subprocess.run([*script_cmd(*TRAIN), *TINY, "algo=diloco", "algo.interval=2", "cluster=local_2x1",
                           "train.steps=2", f"federation.host={FOREIGN}", f"run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=300, env=cli_env())
    _one_error_line(proc, f"federation.host: {FOREIGN} is not an address of this machine", "nothing was started")
    assert "restarting cluster" not in proc.stdout + proc.stderr


def test_a_cluster_job_on_a_foreign_host_stops_before_its_ranks_start(tmp_path: Path) -> None:
    """A cluster job of a multi-host federation (the launchers run key_check before torchrun, which would
    restart every worker that fails): EDIT_TRAIN_HOST names another machine: one line, exit 2."""
    proc = subprocess.run([sys.executable, "-m", "edit_train.cli.key_check", *TINY, "algo=diloco",
                           "cluster=local_2x1", "federation.lighthouse=127.0.0.1:9"],
                          capture_output=True, text=True, timeout=120,
                          env=cli_env(EDIT_TRAIN_CLUSTER="c0", EDIT_TRAIN_HOST=FOREIGN))
    _one_error_line(proc, f"federation.host: {FOREIGN} is not an address of this machine")


# ----------------------------------------------------------------------------------- the Lighthouse's signals


def test_the_lighthouse_handler_survives_300_double_sigterms() -> None:
    """The handler path in this process with real signals: two SIGTERMs back to back (the second one while the
    first one's handler may still run), 300 times; the wait returns every time. The old handler took an
    Event's lock, and a second signal landing inside it deadlocked (3 of 300 processes hung)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread")
    wait = lighthouse.wait_for_signal  # (before any signal is sent: nothing else here handles SIGTERM)
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        signal.signal(signal.SIGTERM, lighthouse._stop)  # a Timer firing before the wait installs it: still caught
        for _ in range(300):
            lighthouse.STOP[0] = False
            done = threading.Event()

            def twice() -> None:
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)
                done.set()

            killer = threading.Timer(0.002, twice)
            killer.start()
            wait(poll_s=0.005)  # returns, or the test hangs (pytest's timeout ends it)
            killer.join()
            assert done.is_set()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def test_the_lighthouse_process_exits_on_a_double_sigterm(tmp_path: Path) -> None:
    """2 real `edit-train-lighthouse` processes, each sent two SIGTERMs back to back once serving: each exits
    0 within 30 s (the handler's flag is read within 0.1 s; the rest is shutting torchft's Lighthouse down)."""
    procs = []
    for i in range(2):
        addr = tmp_path / f"addr{i}"
        procs.append((subprocess.Popen([*script_cmd("edit-train-lighthouse", "edit_train.cli.lighthouse"),
                                        "--bind", "127.0.0.1:0", "--address-file", str(addr)],
                                       env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
                      addr))
    for proc, addr in procs:
        deadline = time.time() + 120
        while not (addr.exists() and addr.read_text().strip()):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)
    for proc, _ in procs:
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
