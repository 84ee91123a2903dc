"""Has this run — or this cluster's federation — finished? Read from run.dir's records before anything starts.

A cluster's leader writes `clusters/<name>.json` when the cluster finishes (train/summary.py) and keeps
`clusters/<name>.progress.json` while it trains (train/progress.py). A cluster record is the last word on its
cluster when it was written after the cluster's last progress save (a cluster resumed since then is training
again). A run is finished for a cluster when its own record says so and it reached `train.steps` (or another
cluster did; under a time schedule a cluster ends the run's syncs with its own count: `_reached`); a federation is finished for a
cluster that did not get there when every other configured cluster's record says it finished and one of
them reached `train.steps` (a new launch of it; one its launcher restarts after a failure finishes its part).
Either way the cluster says so in one line and exits 0 (`resume=auto` of a
finished run, a cluster relaunched after its peers finished), instead of training one more interval or
training alone from its last checkpoint. `resume=auto` with a larger `train.steps` continues a finished run.
Across sites (a run.dir per cluster) the gate's signed `finished` notices stand in for the records, and count only
when a strict majority of the configured clusters signed one (`gate_finished_line`): one member's word about itself
ends nobody's run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edit_train.train.progress import Carried, record_path


def _record(run_dir: Path, name: str) -> dict[str, Any] | None:
    """`clusters/<name>.json` when it is the cluster's last word (not trained since), else None."""
    try:
        rec = json.loads((run_dir / "clusters" / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("steps"), int) or not isinstance(rec.get("end"), (int, float)):
        return None
    carried = Carried.load(record_path(run_dir, name))
    if carried is not None and carried.saved_at is not None and carried.saved_at > rec["end"] + 1.0:
        return None  # resumed after it finished and trained since
    return rec


def _recorded(run_dir: Path) -> list[str]:
    folder = run_dir / "clusters"
    if not folder.is_dir():
        return []
    return sorted(p.name[:-len(".json")] for p in folder.glob("*.json")
                  if not p.name.endswith((".progress.json", ".useful.json")))


def finished_line(run_dir: str | Path, name: str, configured: list[str], steps: int, federated: bool,
                  restarted: bool = False) -> str | None:
    """The line a cluster `name` (or a lone run) that has nothing left to do says, or None when it trains.
    `restarted`: its launcher started it again after a failure (run.max_restarts, torchrun's --max-restarts): a
    run in progress counts on it, so it finishes its part even when the others are done (the summary waits for
    its record); only a new launch stops for a federation that finished without it."""
    run_dir = Path(run_dir).expanduser()
    records = {n: r for n in dict.fromkeys([*configured, *_recorded(run_dir), name]) if (r := _record(run_dir, n))}
    reached = sorted(n for n, r in records.items() if _reached(r, steps))
    mine = records.get(name)
    if mine is not None and reached:
        where = f"step {mine['steps']:,} of train.steps={steps:,}"
        if not federated:
            return (f"run.dir {run_dir} holds a finished run ({where}): nothing to resume; {_further(steps)} or "
                    "choose a new run.dir")
        return (f"cluster {name} already finished this run ({where}, {run_dir / 'clusters' / (name + '.json')}): "
                f"nothing to resume; {_further(steps)}")
    others = [n for n in configured if n != name]
    if federated and not restarted and mine is None and reached and others and all(n in records for n in others):
        done = ", ".join(f"{n} at step {records[n]['steps']:,}" for n in others)
        return (f"cluster {name}: its federation finished without it ({done}; records in {run_dir / 'clusters'}): "
                "nothing to join; choose a new run.dir to train again")
    return None


def run_finished_line(run_dir: str | Path, configured: list[str], steps: int) -> str | None:
    """The line a whole run (every configured cluster started here) says when every cluster finished it."""
    run_dir = Path(run_dir).expanduser()
    if len(configured) == 1:
        return finished_line(run_dir, configured[0], configured, steps, federated=False)
    records = {n: r for n in configured if (r := _record(run_dir, n))}
    if len(records) < len(configured) or not any(_reached(r, steps) for r in records.values()):
        return None
    done = ", ".join(f"{n} at step {r['steps']:,}" for n, r in records.items())
    return (f"run.dir {run_dir} holds a finished run (every cluster finished: {done}; train.steps={steps:,}): "
            f"nothing to resume; {_further(steps)} or choose a new run.dir")


def _reached(rec: dict[str, Any], steps: int) -> bool:
    """Did this record end a run of at least `steps` train.steps? Its own count says so under a step schedule; under
    a time schedule a cluster ends at the run's last sync with fewer or more steps than train.steps (pacer.run_syncs),
    so the record's `train_steps` (the run's train.steps it ended) says so too."""
    return rec["steps"] >= steps or (isinstance(rec.get("train_steps"), int) and rec["train_steps"] >= steps)


def _further(steps: int) -> str:
    """What trains a finished run further (a resume keeps the run's configuration: train/run_config.py)."""
    return f"train further with resume=auto train.steps={2 * steps} (any count above {steps})"


def peer_news(run_dir: str | Path, name: str, configured: list[str]) -> str:
    """What run.dir's records say of the other clusters, for a wait's progress line: `a finished (step 20), c
    last trained 12 s ago` ("" when it holds none of theirs: clusters on their own filesystems)."""
    import time

    run_dir = Path(run_dir).expanduser()
    out = []
    for peer in dict.fromkeys([*configured, *_recorded(run_dir)]):
        if peer == name:
            continue
        rec = _record(run_dir, peer)
        if rec is not None:
            out.append(f"{peer} finished (step {rec['steps']:,}, its record)")
            continue
        carried = Carried.load(record_path(run_dir, peer))
        if carried is not None and carried.saved_at is not None:
            out.append(f"{peer} last trained {max(time.time() - carried.saved_at, 0.0):.0f} s ago")
    return ", ".join(out)


def gate_finished_line(name: str, configured: list[str], steps: int, finished: dict[str, int],
                       gate: str, keys: dict[str, str] | None = None) -> tuple[str | None, str | None]:
    """(the line of a cluster `name` whose federation finished without it by the gate's word, or None: it trains;
    the line that says which notices did not count, or None). Across sites each cluster has its own run.dir, and
    each finished cluster told the gate, signed, that it finished this run (the fingerprint). One member's word
    about itself must not end another's run: the notices count only when a strict majority of the configured
    clusters signed one and one of them reached `train.steps` (with two clusters never: a relaunched cluster
    then finishes its part alone). `keys`: each name's roster key id, for the line."""
    signed = sorted(n for n in finished if n in configured and n != name)
    if not signed:
        return None, None
    if 2 * len(signed) > len(configured) and any(finished[n] >= steps for n in signed):
        done = ", ".join(f"{n} at step {finished[n]:,}" for n in signed)
        return (f"cluster {name}: its federation finished without it ({done}, {len(signed)} of {len(configured)} "
                f"configured clusters; told the Lighthouse gate at {gate}): nothing to join; choose a new run.dir to "
                "train again"), None
    who = ", ".join(f"{n} at step {finished[n]:,}" + (f" (roster key {keys[n]})" if keys and keys.get(n) else "")
                    for n in signed)
    return None, (f"cluster {name}: the Lighthouse gate at {gate} says {who} finished this run: {len(signed)} of "
                  f"{len(configured)} configured clusters, not a strict majority: not counted, training on")
