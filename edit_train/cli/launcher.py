"""The local launcher: a Lighthouse and one job per cluster on this host, each supervised on its own.

Every cluster is its own set of processes with its own store (rank 0's, on 127.0.0.1), its own
restarts (`run.max_restarts`, after `run.restart_delay_s`) and `EDIT_TRAIN_CLUSTER=<name>` in its
environment; a cluster that dies is restarted alone and heals from a live peer, the others never stop.
Ctrl-C stops every cluster and the Lighthouse. Progress (one bar per cluster on a terminal, periodic log
lines elsewhere) is drawn here from the run's metrics.jsonl; while the bars are up, what the clusters print
is relayed above them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable

from edit_train.cli.parent import die_with_parent
from edit_train.cluster.threads import AUTO, cores_available, plan, training_processes
from edit_train.config import ClusterSpec, cluster_specs, to_container


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ClusterJob:
    spec: ClusterSpec
    procs: list[subprocess.Popen] = field(default_factory=list)
    restarts: int = 0
    state: str = "pending"  # pending | running | waiting | done | failed
    restart_at: float = 0.0
    exit_codes: list[int] = field(default_factory=list)


def same_package(env: dict[str, str]) -> dict[str, str]:
    """`env` for a process that must import this launcher's `edit_train`, whatever its working directory:
    PYTHONSAFEPATH=1 keeps `python -m` from putting the working directory first on sys.path (where another
    checkout's `edit_train/` would shadow ours: two code versions in one run), and a package not installed in
    site-packages (an editable install, PYTHONPATH) has its root first on PYTHONPATH."""
    import sysconfig

    import edit_train

    root = str(Path(edit_train.__file__).resolve().parents[1])
    installed = {str(Path(sysconfig.get_paths()[k]).resolve()) for k in ("purelib", "platlib")}
    out = {**env, "PYTHONSAFEPATH": "1"}
    if root not in installed:
        rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
        out["PYTHONPATH"] = os.pathsep.join([root, *rest])
    return out


class LocalFederation:
    def __init__(self, cfg: Any, cfg_path: Path, lighthouse: str, only: str = "", key_file: str = "",
                 roster_file: str = "") -> None:
        self.cfg = cfg
        self.key_file = key_file  # every cluster job started here reads the federation key from it
        self.roster_file = roster_file  # ... the roster, and its identity from the roster's directory
        self.cfg_path = cfg_path
        self.lighthouse = lighthouse
        specs = cluster_specs(cfg)
        self.jobs = [ClusterJob(s) for s in specs if not only or s.name == only]
        if only and not self.jobs:  # a cluster joining the federation from outside its configured list
            self.jobs = [ClusterJob(ClusterSpec(only, max(cfg.cluster.ranks, 1), len(specs), 1.0))]
        self.stopping = False
        self.say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
        self.relay: Callable[[subprocess.Popen], None] | None = None  # set: the processes' output goes through it
        # every rank of every job started here shares this host's cores with whatever else trains on it
        ranks = sum(j.spec.ranks for j in self.jobs)
        self.threads = plan(cfg.train.threads, ranks, training_processes(), cores_available()).threads

    def _env(self, job: ClusterJob, rank: int, port: int) -> dict[str, str]:
        env = dict(os.environ)
        if self.key_file:
            env["EDIT_TRAIN_FEDERATION_KEY_FILE"] = self.key_file
        if self.roster_file:
            from edit_train.federation.enrol import identity_path

            env["EDIT_TRAIN_ROSTER_FILE"] = self.roster_file
            env["EDIT_TRAIN_IDENTITY_FILE"] = self.cfg.federation.identity_file or \
                str(identity_path(Path(self.roster_file).parent, job.spec.name))
        env.update({"EDIT_TRAIN_CLUSTER": job.spec.name, "EDIT_TRAIN_LIGHTHOUSE": self.lighthouse,
                    "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(job.spec.ranks),
                    "LOCAL_WORLD_SIZE": str(job.spec.ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "GLOO_SOCKET_IFNAME": env.get("GLOO_SOCKET_IFNAME", "lo"), "EDIT_TRAIN_RESTART": str(job.restarts),
                    "EDIT_TRAIN_LAUNCHER_BAR": "1", "RUST_LOG": env.get("RUST_LOG", "warn")})
        if "OMP_NUM_THREADS" not in env:  # the user's own setting wins
            env.update({"OMP_NUM_THREADS": str(self.threads), AUTO: "1"})
        env.pop("TORCHELASTIC_RUN_ID", None)
        return same_package(env)  # the workers run this launcher's edit_train, not one in the working directory

    def start(self, job: ClusterJob) -> None:
        port = free_port()
        pipe = subprocess.PIPE if self.relay is not None else None
        job.procs = [subprocess.Popen([sys.executable, "-m", "edit_train.cli.worker", str(self.cfg_path)],
                                      env=self._env(job, r, port), preexec_fn=die_with_parent,
                                      stdout=pipe, stderr=pipe)
                     for r in range(job.spec.ranks)]
        if self.relay is not None:
            for proc in job.procs:
                self.relay(proc)
        job.state = "running"

    def _kill(self, job: ClusterJob, sig: int = signal.SIGKILL) -> None:
        for p in job.procs:
            if p.poll() is None:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass

    def poll(self) -> None:
        now = time.time()
        for job in self.jobs:
            if job.state == "waiting" and now >= job.restart_at and not self.stopping:
                job.restarts += 1
                self.say(f"[edit-train] restarting cluster {job.spec.name} (restart {job.restarts}/"
                         f"{self.cfg.run.max_restarts})")
                self.start(job)
            if job.state != "running":
                continue
            codes = [p.poll() for p in job.procs]
            if any(c not in (None, 0) for c in codes):
                self._kill(job)
                for p in job.procs:
                    p.wait()
                job.exit_codes = [p.returncode for p in job.procs]
                user_error = any(c == 2 for c in job.exit_codes)
                if self.stopping or user_error or job.restarts >= self.cfg.run.max_restarts:
                    job.state = "failed"
                    if user_error:  # a configuration error is every cluster's: stop them all
                        self.stop()
                else:
                    job.state = "waiting"
                    job.restart_at = now + self.cfg.run.restart_delay_s
                    self.say(f"[edit-train] cluster {job.spec.name} died (exit {job.exit_codes}); restarting in "
                             f"{self.cfg.run.restart_delay_s:g}s, the others go on")
            elif all(c == 0 for c in codes):
                job.state = "done"

    @property
    def finished(self) -> bool:
        return all(j.state in ("done", "failed") for j in self.jobs)

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 20.0) -> None:
        """Stop every cluster (SIGTERM: they stop at a step boundary), SIGKILL what is left after grace_s."""
        self.stopping = True
        for job in self.jobs:
            self._kill(job, sig)
        deadline = time.time() + grace_s
        for job in self.jobs:
            for p in job.procs:
                try:
                    p.wait(timeout=max(deadline - time.time(), 0.1))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


class Bars:
    """Each cluster's progress, fed from metrics.jsonl `train` and `sync` events: one bar per cluster on a
    terminal (the clusters' own output relayed above the bars), periodic log lines per cluster elsewhere
    (`train.progress=false`: neither)."""

    def __init__(self, path: Path, jobs: list[ClusterJob], total: int, enabled: bool, desc: str) -> None:
        from edit_train.train.progress import Progress

        # resume=auto appends to the run's metrics.jsonl: start after what the earlier launches wrote, or the
        # first progress lines would be theirs (a replay of the previous run's steps and losses)
        self.path, self.enabled = path, enabled
        self.offset = path.stat().st_size if path.exists() else 0
        self.names = {job.spec.name for job in jobs}  # the clusters started here (not others in run.dir)
        self.progress = Progress([job.spec.name for job in jobs], total, desc, enabled=enabled)
        self._relays: list[threading.Thread] = []

    @property
    def shown(self) -> bool:
        """Bars on a terminal: anything else printed must go through `write`."""
        return self.progress.tty

    def write(self, line: str, file: IO[str] | None = None) -> None:
        self.progress.write(line, file=file)

    def relay(self, proc: subprocess.Popen) -> None:
        """Copy a cluster process's stdout and stderr line by line above the bars."""
        for stream, target in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            if stream is not None:
                thread = threading.Thread(target=self._copy, args=(stream, target), daemon=True)
                thread.start()
                self._relays.append(thread)

    def _copy(self, stream: IO[bytes], target: IO[str]) -> None:
        with stream:
            for raw in iter(stream.readline, b""):
                self.write(raw.decode(errors="replace").rstrip("\r\n"), file=target)

    def update(self) -> None:
        if not self.enabled or not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        cut = chunk.rfind(b"\n") + 1
        self.offset += cut
        for line in chunk[:cut].splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            name = str(ev.get("cluster"))
            if name not in self.names:
                continue
            if ev.get("event") == "train":
                self.progress.report(name, int(ev["step"]), float(ev["loss"]), float(ev["tokens_per_s"]))
            elif ev.get("event") == "sync":
                self.progress.note(name, f"sync {ev['sync']} with {len(ev.get('quorum', []))} cluster(s)")

    def close(self) -> None:
        self.update()
        for thread in self._relays:  # the processes have exited: their pipes end
            thread.join(timeout=5.0)
        self.progress.close()


def local_roster(cfg: Any, run_dir: Path) -> str:
    """The roster the jobs started here use: federation.roster_file (or $EDIT_TRAIN_ROSTER_FILE), else one
    made per run in run.dir/federation/ with an identity per cluster (the operator's key stays there: adding a
    cluster that joins later, or restating train.steps on a resume, is this launcher's signed act); "" when the
    federation runs insecure, or at a Lighthouse this run did not start (federation.lighthouse, and no roster in
    run.dir: that Lighthouse's operator gives the roster, if any, with federation.roster_file)."""
    from edit_train.federation import enrol
    from edit_train.federation.roster import ROSTER_ENV
    from edit_train.train.build import fingerprint

    f = cfg.federation
    given = f.roster_file or os.environ.get(ROSTER_ENV, "")
    if given or f.insecure:
        return given
    if f.lighthouse and not (run_dir / "federation" / enrol.ROSTER).exists():
        return ""
    names = [s.name for s in cluster_specs(cfg)]
    names += [cfg.cluster.only] if cfg.cluster.only and cfg.cluster.only not in names else []
    terms = (fingerprint(cfg), cfg.train.steps, cfg.algo.name)
    return str(enrol.ensure(run_dir / "federation", names, terms))


def run_local(cfg: Any) -> tuple[Path, list[ClusterJob]]:
    """Start the Lighthouse (unless federation.lighthouse names one) and the clusters; supervise them."""
    from edit_train.federation import auth
    from edit_train.federation.enrol import GATE
    from edit_train.federation.quorum import Lighthouse
    from edit_train.federation.signed import load_credentials

    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir / "launch_config.json"
    cfg_path.write_text(json.dumps(to_container(cfg), indent=1))
    f = cfg.federation
    house = None
    lighthouse = f.lighthouse
    key_file = f.key_file or os.environ.get(auth.KEY_ENV, "")
    if not key_file and not f.insecure:  # a key per run, in the run directory (a late cluster finds it there)
        key_file = str(run_dir / "federation.key")
        if not Path(key_file).exists():
            auth.new_key(key_file)
    roster_file = local_roster(cfg, run_dir)
    if not lighthouse:
        key = auth.load_key(key_file) if key_file else auth.INSECURE
        creds = load_credentials(str(Path(roster_file).parent / GATE), roster_file, "gate", role="gate") \
            if roster_file else None
        house = Lighthouse(f"{f.host}:0", key, f.min_clusters, f.join_timeout_s, f.heartbeat_timeout_s, creds,
                           roster_file)
        lighthouse = house.address
        (run_dir / "federation.json").write_text(json.dumps({"lighthouse": lighthouse}) + "\n")
    fed = LocalFederation(cfg, cfg_path, lighthouse, only=cfg.cluster.only, key_file=key_file,
                          roster_file=roster_file)
    bars = Bars(run_dir / "metrics.jsonl", fed.jobs, cfg.train.steps, cfg.train.progress, cfg.algo.name)
    if bars.shown:  # nothing else may write between the bars
        fed.say, fed.relay = bars.write, bars.relay
    interrupted: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        interrupted.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for job in fed.jobs:
            fed.start(job)
        while not fed.finished:
            if interrupted:
                fed.stop()
                break
            fed.poll()
            bars.update()
            time.sleep(0.2)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        bars.close()
        if not fed.finished:
            fed.stop()
        if house is not None:
            house.shutdown()
    if interrupted:
        raise KeyboardInterrupt
    return run_dir, fed.jobs
