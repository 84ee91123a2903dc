"""A subreaper (like a container's init that is not pid 1) around `launchers/torchrun_multinode.sh`, for
tests/cli/test_start_up_stops.py: `python tests/orphan_probe.py OUT.json -- bash torchrun_multinode.sh …`.

It starts the job in its own process group, waits for torchrun's worker to appear, stops it (SIGSTOP) while it is
still starting, SIGKILLs the job's process group (the wrapper and torchrun; torchrun's workers have sessions of
their own), lets the worker go on (SIGCONT) and writes to OUT.json whether it was still alive 10 s later. Orphans
are re-parented here, not to pid 1: the worker cannot tell its parent died by `getppid() == 1`."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36


def _children_of(pid: int) -> list[tuple[int, str]]:
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append((int(proc.name), cmdline))
    return out


def _torchrun(job: int) -> int | None:
    """torchrun's pid: the job's descendant running torch.distributed.run."""
    todo = [job]
    while todo:
        pid = todo.pop()
        for child, cmdline in _children_of(pid):
            if "torch.distributed.run" in cmdline and "torchrun_wrap" not in cmdline:
                return child
            todo.append(child)
    return None


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def main() -> None:
    out, cmd = sys.argv[1], sys.argv[3:]
    assert sys.argv[2] == "--"
    assert ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1) == 0
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline, worker, torchrun = time.time() + 240, None, None
    while worker is None and time.time() < deadline and job.poll() is None:
        torchrun = torchrun or _torchrun(job.pid)
        if torchrun is not None:
            for pid, cmdline in _children_of(torchrun):
                if "edit_train.cli.train" in cmdline:
                    os.kill(pid, signal.SIGSTOP)  # still starting: before it can set its parent-death signal
                    worker = pid
        time.sleep(0.005)
    result: dict[str, object] = {"worker": worker}
    if worker is not None:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        time.sleep(0.5)
        os.kill(worker, signal.SIGCONT)
        time.sleep(10.0)
        result["alive_after_10s"] = _alive(worker)
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)
    else:
        result["job_exit"] = job.poll()
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    while True:  # reap every orphan that came here
        try:
            if os.waitpid(-1, 0)[0] <= 0:
                break
        except ChildProcessError:
            break
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
