"""How many intra-op threads each rank of a cluster job takes: the cores the job may use, shared with the
other training processes on this host.

Two cluster jobs started by hand on one host (`edit-train cluster.only=c0 …`, `… cluster.only=c1`) each took
every core's threads and both ran ~6× slower until `OMP_NUM_THREADS=1` was set. torchrun sizes its workers'
threads for the same reason. Here `train.threads=0` (auto) gives each rank ⌊cores ÷ training processes on this
host⌋ threads (at least one), counting the processes of every edit-train job this user runs on the host
(they carry `EDIT_TRAIN_CLUSTER` in their environment; another user's jobs are theirs to size, and a count
that included them would shrink ours for processes we cannot see into or coordinate with); a job re-plans
when others start or stop, and says so in one line when the host is oversubscribed — once per run (the
local launcher's clusters share one console: its first cluster's leader says it). `train.threads=N` pins N,
and so does an `OMP_NUM_THREADS` the user set.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MARK = b"EDIT_TRAIN_CLUSTER="
AUTO = "EDIT_TRAIN_THREADS_AUTO"  # set by our launcher when it chose OMP_NUM_THREADS (not the user)
COMMANDS = (b"edit-train\x00", b"edit_train.cli.train")  # the console script's argv[0] ends a field


def cores_available() -> int:
    """The CPUs this process may run on (its affinity mask: a Slurm/cgroup allocation, taskset)."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):
        return max(os.cpu_count() or 1, 1)


def training_processes(exclude: set[int] | None = None, proc: Path = Path("/proc"), uid: int | None = None) -> int:
    """Live edit-train training processes of user `uid` (default: this process's) on this host other than
    `exclude`: the ranks of cluster jobs (their environment names their cluster) and lone in-process runs (an
    `edit-train` command line with no such rank below it; a process that spawned ranks is their launcher and
    trains nothing). 0 where /proc cannot be read."""
    skip = exclude or set()
    uid = os.getuid() if uid is None else uid
    ranks, commands, parents = set(), set(), set()
    helpers: dict[int, int] = {}  # marked processes that run no Python: pid -> parent
    try:
        entries = [e for e in proc.iterdir() if e.name.isdigit()]
    except OSError:
        return 0
    for entry in entries:
        try:
            if entry.stat().st_uid != uid:  # another user's process
                continue
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
            if fields[0] in ("Z", "X"):
                continue
            pid = int(entry.name)
            if MARK in (entry / "environ").read_bytes():
                ranks.add(pid)
                parents.add(int(fields[1]))
                argv = (entry / "cmdline").read_bytes()
                program = argv.split(b"\x00", 1)[0].rsplit(b"/", 1)[-1]
                if b"python" not in program and not any(k in argv for k in COMMANDS):
                    helpers[pid] = int(fields[1])  # not Python, not ours: a program the rank started
            elif any(k in (entry / "cmdline").read_bytes() for k in COMMANDS):
                commands.add(pid)
        except (OSError, ValueError, IndexError):
            continue
    # a rank's own helpers inherit its environment and train nothing (W&B's service, `wandb-core`: the default demo
    # counted 4 training processes for its 2 ranks and said the host was oversubscribed)
    ranks -= {pid for pid, parent in helpers.items() if parent in ranks}
    return len((ranks | (commands - parents)) - skip)


@dataclass
class ThreadPlan:
    threads: int
    processes: int  # training processes on the host, this job's ranks included
    cores: int

    @property
    def oversubscribed(self) -> bool:
        return self.processes * self.threads > self.cores


def plan(requested: int, local_ranks: int, others: int, cores: int) -> ThreadPlan:
    """`requested` > 0 pins the threads; 0 shares the cores among this job's ranks on this host and the
    other training processes."""
    processes = max(local_ranks, 1) + max(others, 0)
    threads = requested if requested > 0 else max(cores // processes, 1)
    return ThreadPlan(threads, processes, cores)


class ThreadBudget:
    """This rank's thread budget, applied to torch and re-planned now and then (others start and stop)."""

    def __init__(self, requested: int, local_ranks: int, every_s: float = 30.0,
                 set_threads: Callable[[int], None] | None = None, count: Callable[[], int] | None = None,
                 says: bool = True) -> None:
        import torch

        if requested == 0 and os.environ.get("OMP_NUM_THREADS", "").isdigit() and not os.environ.get(AUTO):
            requested = int(os.environ["OMP_NUM_THREADS"])  # the user's own setting wins over auto
        self.requested, self.local_ranks, self.every_s = requested, max(local_ranks, 1), every_s
        self._set = set_threads or torch.set_num_threads
        # this job's own ranks are counted too: the others are (all) − (this job's ranks)
        self._count = count or (lambda: max(training_processes({os.getpid(), os.getppid()}) -
                                            (self.local_ranks - 1), 0))
        self.current: ThreadPlan | None = None
        self._next = 0.0
        self._warned = not says  # the rank that says the run's oversubscription (one line per run)

    def apply(self) -> ThreadPlan:
        p = plan(self.requested, self.local_ranks, self._count(), cores_available())
        if self.current is None or p.threads != self.current.threads:
            self._set(p.threads)
            if self.current is not None:
                log.info("threads per rank: %d -> %d (%d training processes on %d cores)", self.current.threads,
                         p.threads, p.processes, p.cores)
        if p.oversubscribed and not self._warned:
            self._warned = True
            log.warning("host oversubscribed: %d training processes x %d threads on %d cores (this job's ranks and "
                        "this user's other edit-train processes on this host); set train.threads (or start fewer "
                        "jobs per host)", p.processes, p.threads, p.cores)
        self.current, self._next = p, time.monotonic() + self.every_s
        return p

    def maybe_replan(self) -> None:
        """Re-plan if `every_s` passed (one scan of /proc, a few ms); never when the threads are pinned."""
        if self.requested == 0 and time.monotonic() >= self._next:
            self.apply()
