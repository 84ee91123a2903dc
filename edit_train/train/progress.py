"""What one cluster has done so far: the loop's position (restored from a checkpoint) and the counters that
span its incarnations (a cluster restarted, resumed or healed keeps counting where the last one stopped).
Resume and the summary read this object, not the trainer.

The counters across incarnations live in `run.dir/clusters/<name>.progress.json`, written by the cluster's
leader at every committed sync and every logged step (atomically): tokens and steps this cluster trained,
the compute seconds a sync committed (goodput), the downtime between incarnations.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from edit_train.fsutil import atomic_write_json


def record_path(run_dir: Path, name: str) -> Path:
    return run_dir / "clusters" / f"{name}.progress.json"


@dataclass
class Carried:
    """Counters across incarnations (JSON in `clusters/<name>.progress.json`)."""

    tokens: int = 0  # tokens this cluster trained, every incarnation (a step redone after a crash counts again)
    steps_trained: int = 0
    useful_s: float = 0.0  # compute seconds whose progress a sync committed
    downtime_s: float = 0.0  # between an incarnation's last record and the next one's start
    first_start: float = field(default_factory=time.time)
    incarnations: int = 0
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
            return Carried(**{k: v for k, v in data.items() if k in known})
        except TypeError:
            return None


@dataclass
class TrainingState:
    name: str
    run_dir: Path
    tokens_per_step: int
    step: int = 0  # the loop's position: the next step to take (checkpointed)
    skipped_steps: int = 0  # inner steps skipped for a non-finite loss/gradient (checkpointed)
    wall_offset: float = 0.0  # wall seconds of earlier segments of this run (checkpointed)
    carried: Carried = field(default_factory=Carried)
    t_start: float = field(default_factory=time.time)  # this process
    t0: float = 0.0  # this incarnation's loop
    startup_s: float = 0.0
    initial_val_loss: float | None = None
    mfu: list[float] = field(default_factory=list)

    @staticmethod
    def begin(run_dir: Path, name: str, tokens_per_step: int) -> TrainingState:
        """A new incarnation of cluster `name` (the first, or after a restart / resume)."""
        state = TrainingState(name, run_dir, tokens_per_step)
        earlier = Carried.load(record_path(run_dir, name))
        if earlier is not None:
            if earlier.incarnations > 0 and earlier.saved_at:
                earlier.downtime_s += max(state.t_start - earlier.saved_at, 0.0)
            state.carried = earlier
        state.carried.incarnations += 1
        return state

    @property
    def tokens(self) -> int:
        return self.carried.tokens

    def trained(self) -> None:
        """One more step taken by this cluster."""
        self.step += 1
        self.carried.tokens += self.tokens_per_step
        self.carried.steps_trained += 1

    def wall(self) -> float:
        return self.wall_offset + time.time() - self.t0

    def save(self, every_s: float = 0.0) -> None:
        """The counters across incarnations, for the next one (the leader calls this); with `every_s`, only
        if that long has passed since the last save."""
        now = time.time()
        if every_s > 0 and self.carried.saved_at is not None and now - self.carried.saved_at < every_s:
            return
        self.carried.saved_at = now
        atomic_write_json(record_path(self.run_dir, self.name), asdict(self.carried))

    # ------------------------------------------------------------ checkpoint
    def checkpoint_json(self) -> dict[str, Any]:
        return {"step": self.step, "tokens": self.tokens, "skipped_steps": self.skipped_steps,
                "wall_s": self.wall()}

    def restore(self, saved: dict[str, Any], record_found: bool) -> None:
        """The loop's position from a checkpoint; its token count only when no record survived (the record
        also counts what was trained after that checkpoint)."""
        self.step, self.skipped_steps = int(saved["step"]), int(saved["skipped_steps"])
        self.wall_offset = float(saved["wall_s"])
        if not record_found:
            self.carried.tokens = int(saved["tokens"])
            self.carried.steps_trained = self.carried.tokens // max(self.tokens_per_step, 1)
