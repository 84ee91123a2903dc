"""What one cluster has done so far: the loop's position (restored from a checkpoint) and the counters that
span its incarnations (a cluster restarted, resumed or healed keeps counting where the last one stopped).
Resume and the summary read this object, not the trainer.

The counters across incarnations live in `run.dir/clusters/<name>.progress.json`, written by the cluster's
leader at every committed sync and every logged step (atomically): tokens and steps this cluster trained,
the compute seconds a sync committed (goodput), its clocks — the loop's seconds (`wall_s`), each incarnation's
live span (process start to its last record) and the downtime between them — the restarts after a failure and
the first incarnation's initial val loss. Only live time is run time: tokens/s and goodput never count the
minutes a cluster was down between two launches (`downtime_s` is its own bucket).

`Progress` is what a person watching sees while clusters train: a bar per cluster on a terminal, periodic
log lines anywhere else (a Slurm .out file, a pipe).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TextIO

from edit_train.fsutil import atomic_write_json
from edit_train.train.lr import LrSchedule


log = logging.getLogger(__name__)


def now() -> float:
    """The wall clock every counter here reads (tests replace it)."""
    return time.time()


_started_once = [False]  # a process's start belongs to its first incarnation only


def process_start() -> float:
    """When this process started (Linux: /proc/self/stat, to the second), else now: an incarnation is live from
    then (its imports and start-up included), not from when its trainer was built. Only the first call of a
    process: a later run in the same process (a Hydra sweep's next job, a test's) starts now."""
    if _started_once[0]:
        return now()
    _started_once[0] = True
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        started = boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return now()
    return min(started, now())


def record_path(run_dir: Path, name: str) -> Path:
    return run_dir / "clusters" / f"{name}.progress.json"


# set for a process started again after its cluster failed: by torchrun (--max-restarts), by the local
# launcher (run.max_restarts), by Slurm for a requeued job. A new launch with resume=auto sets none of them.
RESTART_ENV = ("TORCHELASTIC_RESTART_COUNT", "EDIT_TRAIN_RESTART", "SLURM_RESTART_COUNT")


def restart_count(env: dict[str, str] | None = None) -> int:
    """How many times this job's launcher restarted it after a failure (0: a first start or a deliberate
    new launch, `resume=auto` included)."""
    env = os.environ if env is None else env
    counts = [0]
    for var in RESTART_ENV:
        try:
            counts.append(int(env.get(var, "0") or 0))
        except ValueError:
            continue
    return max(counts)


@dataclass
class Carried:
    """Counters across incarnations (JSON in `clusters/<name>.progress.json`)."""

    tokens: int = 0  # tokens this cluster trained, every incarnation (a step redone after a crash counts again)
    steps_trained: int = 0
    useful_s: float = 0.0  # compute seconds whose progress a sync committed
    downtime_s: float = 0.0  # between an incarnation's last record and the next one's start
    first_start: float = field(default_factory=lambda: now())
    wall_s: float | None = None  # the loop's seconds, every incarnation, up to the last record (None: an old record)
    live_spans: list[list[float]] = field(default_factory=list)  # [start, last record] of each incarnation
    incarnations: int = 0  # every start: restarts after a failure, and new launches that resume
    restarts: int = 0  # starts after a failure only (see `restart_count`), not a deliberate resume=auto
    initial_val_loss: float | None = None  # the first incarnation's step-0 eval (a resumed run has none of its own)
    saved_at: float | None = None

    @staticmethod
    def load(path: Path) -> Carried | None:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict):
            return None
        known = {f.name for f in fields(Carried)}
        try:
            out = Carried(**{k: v for k, v in data.items() if k in known})
        except TypeError:
            return None
        if not out.live_spans and out.saved_at:  # a record written before live spans: its one span, less downtime
            out.live_spans = [[float(out.first_start) + float(out.downtime_s), float(out.saved_at)]]
        return out

    @property
    def live_s(self) -> float:
        """Seconds this cluster was alive, every incarnation (start-up included, downtime not)."""
        return sum(max(end - start, 0.0) for start, end in self.live_spans)


@dataclass
class TrainingState:
    name: str
    run_dir: Path
    tokens_per_step: int
    step: int = 0  # the loop's position: the next step to take (checkpointed)
    skipped_steps: int = 0  # inner steps skipped for a non-finite loss/gradient (checkpointed)
    wall_offset: float = 0.0  # wall seconds of earlier segments of this run (checkpointed)
    carried: Carried = field(default_factory=Carried)
    t_start: float = field(default_factory=lambda: now())  # this process
    t0: float = 0.0  # this incarnation's loop
    startup_s: float = 0.0
    initial_val_loss: float | None = None
    mfu: list[float] = field(default_factory=list)
    schedule: LrSchedule | None = None  # the learning-rate schedule (checkpointed: a resume may have re-planned it)

    @staticmethod
    def begin(run_dir: Path, name: str, tokens_per_step: int, restarted: bool | None = None,
              started: float | None = None) -> TrainingState:
        """A new incarnation of cluster `name` (the first, or after a restart / resume). `restarted`: this
        start follows a failure (default: what the launcher's environment says, `restart_count`); `started`:
        when this incarnation's process started (default: now), where its live span begins."""
        state = TrainingState(name, run_dir, tokens_per_step)
        started = state.t_start if started is None else min(started, state.t_start)
        earlier = Carried.load(record_path(run_dir, name))
        if earlier is not None:
            if earlier.incarnations > 0 and earlier.saved_at:
                earlier.downtime_s += max(started - earlier.saved_at, 0.0)
            state.carried = earlier
            state.initial_val_loss = earlier.initial_val_loss  # the run's first eval: kept by every incarnation
            state.wall_offset = earlier.wall_s or 0.0  # a checkpoint's (restore) when the record has none
        else:
            state.carried.first_start = started
        state.carried.incarnations += 1
        state.carried.live_spans.append([started, started])
        if restarted is None:
            restarted = restart_count() > 0
        if restarted:
            state.carried.restarts += 1
        return state

    def set_initial_val_loss(self, val_loss: float) -> None:
        """The val loss before the first step (this run's starting point, kept for every later incarnation)."""
        self.initial_val_loss = self.carried.initial_val_loss = val_loss

    @property
    def tokens(self) -> int:
        return self.carried.tokens

    def trained(self) -> None:
        """One more step taken by this cluster."""
        self.step += 1
        self.carried.tokens += self.tokens_per_step
        self.carried.steps_trained += 1

    def wall(self) -> float:
        """The loop's seconds, every incarnation (live time only: not the downtime between two launches)."""
        return self.wall_offset + (now() - self.t0 if self.t0 else 0.0)

    def live(self) -> None:
        """The clocks as of now: this incarnation's live span and the loop's seconds."""
        self.carried.live_spans[-1][1] = now()
        self.carried.wall_s = self.wall()

    def save(self, every_s: float = 0.0) -> None:
        """The counters across incarnations, for the next one (the leader calls this); with `every_s`, only
        if that long has passed since the last save."""
        t = now()
        if every_s > 0 and self.carried.saved_at is not None and t - self.carried.saved_at < every_s:
            return
        self.live()
        self.carried.saved_at = t
        atomic_write_json(record_path(self.run_dir, self.name), asdict(self.carried))

    # ------------------------------------------------------------ checkpoint
    def checkpoint_json(self) -> dict[str, Any]:
        out = {"step": self.step, "tokens": self.tokens, "skipped_steps": self.skipped_steps,
               "wall_s": self.wall(), "initial_val_loss": self.initial_val_loss}
        if self.schedule is not None:
            out["lr_schedule"] = self.schedule.json()
        return out

    def restore(self, saved: dict[str, Any], record_found: bool) -> None:
        """The loop's position from a checkpoint; its token count only when no record survived (the record
        also counts what was trained after that checkpoint)."""
        self.step, self.skipped_steps = int(saved["step"]), int(saved["skipped_steps"])
        if not record_found or self.carried.wall_s is None:  # the record's clock also counts what came after
            self.wall_offset = float(saved["wall_s"])
        if self.initial_val_loss is None and isinstance(saved.get("initial_val_loss"), (int, float)):
            self.set_initial_val_loss(float(saved["initial_val_loss"]))
        if not record_found:
            self.carried.tokens = int(saved["tokens"])
            self.carried.steps_trained = self.carried.tokens // max(self.tokens_per_step, 1)

    def continue_schedule(self, saved: dict[str, Any]) -> str | None:
        """After `restore`: keep the checkpoint's learning-rate schedule when the config plans the same one
        (bit-identical to a run that was never interrupted); when train.steps / lr / lr_warmup_steps /
        min_lr_ratio changed, continue from the learning rate the checkpoint's schedule gives at this step
        instead of jumping to the new plan's. Returns the line that says so, or None when nothing changed."""
        if self.schedule is None:
            return None
        was = LrSchedule.from_json(saved.get("lr_schedule"))
        if was is None:  # a checkpoint from before lr_schedule was saved: its config planned it from step 0
            train = (saved.get("config") or {}).get("train") if isinstance(saved.get("config"), dict) else None
            try:
                was = LrSchedule.of(train) if isinstance(train, dict) else None
            except (KeyError, TypeError, ValueError):
                was = None
        if was is None:
            return None
        if was.same_plan(self.schedule):
            self.schedule = was
            return None
        new = was.continued(self.schedule, self.step)
        line = was.change_line(new, self.step)
        self.schedule = new
        return line


# ------------------------------------------------------------------ what a person watching sees
PROGRESS_EVERY_S = 30.0  # off a terminal: at most one progress line per cluster this often (and its last)


def progress_every_s() -> float:
    """Seconds between progress lines off a terminal (`EDIT_TRAIN_PROGRESS_EVERY_S`, default 30; 0: every
    logged step)."""
    try:
        return max(float(os.environ.get("EDIT_TRAIN_PROGRESS_EVERY_S", PROGRESS_EVERY_S)), 0.0)
    except ValueError:
        return PROGRESS_EVERY_S


def is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


class Progress:
    """Where each cluster is, for whoever watches the output. On a terminal: one tqdm bar per cluster, and
    the console log handlers write through `tqdm.write` while the bars are up (no log line lands inside a
    bar). Anywhere else — a Slurm .out file, a pipe, torchrun's log — no bar (a bar there is one endless
    line of carriage returns) but a log line per cluster at logged steps, at most every `every_s` seconds,
    plus each cluster's last one: `cluster c0 step 120/420 loss 2.310 tok/s 5,000`."""

    def __init__(self, names: list[str], total: int, desc: str, enabled: bool = True,
                 initial: dict[str, int] | None = None, stream: TextIO | None = None,
                 every_s: float | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.total = total
        self.tty = enabled and is_terminal(self.stream)
        self.lines = enabled and not self.tty
        self.every_s = progress_every_s() if every_s is None else every_s
        self.bars: dict[str, Any] = {}
        self._printed: dict[str, float] = {}  # name -> when its last line was printed
        self._reached: set[str] = set()  # clusters whose line at train.steps was printed
        self._pending: dict[str, str] = {}  # name -> its latest line not printed yet
        self._note: dict[str, str] = {}
        self._redirect: contextlib.ExitStack | None = None
        if self.tty:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            for i, name in enumerate(names):
                self.bars[name] = tqdm(total=total, initial=(initial or {}).get(name, 0), position=i,
                                       desc=f"{desc} {name}", unit="step", dynamic_ncols=True, leave=True,
                                       file=self.stream)
            self._redirect = contextlib.ExitStack()
            self._redirect.enter_context(logging_redirect_tqdm())

    def advance(self, name: str, step: int) -> None:
        """Cluster `name` is at `step` (the bar moves; tqdm redraws at most ~10 times a second)."""
        bar = self.bars.get(name)
        if bar is not None:
            bar.update(min(step, self.total) - bar.n)

    def report(self, name: str, step: int, loss: float, tokens_per_s: float) -> None:
        """A logged step of cluster `name`."""
        bar = self.bars.get(name)
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self.advance(name, step)
        elif self.lines:
            note = self._note.pop(name, "")
            # A-EDiT: a cluster faster than algo.interval steps per interval passes train.steps before the run's
            # last sync (pacer.run_syncs): its line says so instead of "step 450/400"
            where = f"{step:,}/{self.total:,}" if step <= self.total else \
                f"{step:,} (past train.steps {self.total:,}: a fast cluster trains on to the run's last sync)"
            self._pending[name] = (f"cluster {name} step {where} loss {loss:.3f} "
                                   f"tok/s {tokens_per_s:,.0f}" + (f" ({note})" if note else ""))
            now = time.monotonic()
            reached = step >= self.total and name not in self._reached  # the line at train.steps, once; past it
            if name not in self._printed or reached or now - self._printed[name] >= self.every_s:  # every_s
                self._print(name, now)
                if step >= self.total:
                    self._reached.add(name)

    def note(self, name: str, text: str) -> None:
        """Something that just happened to cluster `name` (a sync): the bar's postfix, or the next line's."""
        bar = self.bars.get(name)
        if bar is not None:
            bar.set_postfix_str(text)
        elif self.lines:
            self._note[name] = text

    def write(self, text: str, file: TextIO | None = None) -> None:
        """A line of output that is not a log record (it goes above the bars on a terminal)."""
        if self.bars:
            from tqdm import tqdm

            tqdm.write(text, file=file or self.stream)
        else:
            print(text, file=file or self.stream, flush=True)

    def _print(self, name: str, now: float) -> None:
        line = self._pending.pop(name, None)
        if line is not None:
            self._printed[name] = now
            log.info("%s", line)

    def close(self) -> None:
        """Close the bars (console logging writes directly again); off a terminal, each cluster's latest
        line if it was not printed yet."""
        for name in list(self._pending):
            self._print(name, time.monotonic())
        for bar in self.bars.values():
            bar.close()
        self.bars = {}
        if self._redirect is not None:
            self._redirect.close()
            self._redirect = None
