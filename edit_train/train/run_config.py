"""A run's own configuration: `config.json` in run.dir, written once by the run's first launch and never
rewritten, plus the changes later resumes made to it, one JSON line each in `resumes.jsonl`.

A resume (`resume=auto`) continues the run it names with that configuration, not with the command line's
defaults: a key the command line does not set keeps the run's value. A key the command line sets to another
value is refused in one line naming the keys, except the keys in `RESUMABLE`, which say how or where the run
goes on, not what it trains:

* its length and learning-rate plan: `train.steps`, `train.time_budget_s`, `train.lr`, `train.lr_warmup_steps`,
  `train.min_lr_ratio` (a changed plan continues the learning rate from the resume step: train/lr.py);
* how the same model is computed and where: `train.device`, `train.threads`, `train.compile`,
  `train.activation_checkpointing`, `train.peak_flops`, `model.init_from`, `model.expert_impl`,
  `model.loss_chunk` (the same keys a checkpoint does not hold against a resume: train/resume.py);
* what is saved, logged and shown: `checkpoint.*`, `logger.*`, `train.log_every`, `train.progress`, `run.name`;
* how it is supervised and reached: `run.max_restarts`, `run.restart_delay_s`, `cluster.only`, `cluster.backend`,
  `cluster.timeout_s`, `data.workers`, `data.cache_dir`, the federation's addresses, credentials and timeouts.

An allowed change is said in one line and appended to `resumes.jsonl` (`{"time", "changes": {key: [was, now]}}`);
the run's configuration is then config.json with every line of resumes.jsonl applied in order. config.json is
the first cluster's job's (its leader writes it): the job of another cluster of a federation sharing run.dir,
whose command line may differ in its own keys, is not held to it. This module imports no torch (the command
line checks a resume before anything starts).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

CONFIG = "config.json"
RESUMES = "resumes.jsonl"

# keys (or sections, ending in ".") a resume may change; see the module docstring for why each
RESUMABLE = ("train.steps", "train.time_budget_s", "train.lr", "train.lr_warmup_steps", "train.min_lr_ratio",
             "train.device", "train.threads", "train.compile", "train.activation_checkpointing", "train.peak_flops",
             "model.init_from", "model.expert_impl", "model.loss_chunk",
             "checkpoint.", "logger.", "train.log_every", "train.progress", "run.name",
             "run.max_restarts", "run.restart_delay_s", "cluster.only", "cluster.backend", "cluster.timeout_s",
             "data.workers", "data.cache_dir",
             "federation.lighthouse", "federation.host", "federation.key_file", "federation.insecure",
             "federation.identity_file", "federation.roster_file", "federation.join_timeout_s",
             "federation.heartbeat_timeout_s", "federation.quorum_timeout_s", "federation.collective_timeout_s")
# keys that name the run or ask to resume it: never part of its configuration's comparison
IDENTITY = ("run.dir", "resume")


def resumable(key: str) -> bool:
    """Whether a resume may change `key` (a dotted config key)."""
    return key in IDENTITY or any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUMABLE)


def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"train": {"steps": 8}}` -> `{"train.steps": 8}`; lists (and anything not a dict) are leaves."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat(value, name + "."))
        else:
            out[name] = value
    return out


def differences(was: dict[str, Any], now: dict[str, Any]) -> dict[str, list[Any]]:
    """`{key: [was, now]}` for every dotted key whose value differs (a key only one side has: None there);
    the identity keys (`run.dir`, `resume`) left out."""
    a, b = flat(was), flat(now)
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b))
            if k not in IDENTITY and a.get(k) != b.get(k)}


def _set(tree: dict[str, Any], key: str, value: Any) -> None:
    *path, leaf = key.split(".")
    for part in path:
        node = tree.get(part)
        if not isinstance(node, dict):
            node = tree[part] = {}
        tree = node
    tree[leaf] = value


def recorded(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's configuration: config.json with the changes of resumes.jsonl applied in order; None when
    run.dir holds no readable config.json (a fresh run, or a cluster that is not the federation's first)."""
    run_dir = Path(run_dir).expanduser()
    try:
        cfg = json.loads((run_dir / CONFIG).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    try:
        lines = (run_dir / RESUMES).read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            changes = json.loads(line).get("changes", {})
        except (ValueError, AttributeError):
            continue  # a torn last line (a crash mid-append): the changes before it stand
        for key, pair in changes.items() if isinstance(changes, dict) else ():
            if isinstance(pair, list) and len(pair) == 2:
                _set(cfg, key, pair[1])
    return cfg


class ResumeRefused(ValueError):
    """A resume whose command line changes the run's configuration in keys a resume may not change."""


def refused_line(run_dir: str | Path, refused: dict[str, list[Any]]) -> str:
    """One line naming the keys (with the run's value and the command line's) and what to do instead."""
    shown = ", ".join(f"{k}={pair[1]!r} (the run has {pair[0]!r})" for k, pair in list(refused.items())[:4])
    more = f" and {len(refused) - 4} more" if len(refused) > 4 else ""
    return (f"resume: run.dir {run_dir} continues its own configuration ({CONFIG}); the command line changes "
            f"{shown}{more}: drop {'that override' if len(refused) == 1 else 'those overrides'} to continue the run, "
            f"or choose a new run.dir (a resume may change only its length, learning-rate plan, device, logging, "
            f"checkpointing and federation addresses: docs/configuration.md)")


def resolve(record: dict[str, Any], given: dict[str, Any], changed_by_command_line: set[str],
            resumable_given: set[str]) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """The configuration a resume trains with, and the allowed changes it makes.

    `record`: the run's configuration (`recorded`); `given`: the configuration the command line composes;
    `changed_by_command_line`: the dotted keys the command line's overrides change (against the same command
    line without them); `resumable_given`: the dotted keys of resumable settings the command line sets. A
    non-resumable key the command line changes to another value than the run's raises `ResumeRefused`."""
    was, now = flat(record), flat(given)
    refused = {k: [was.get(k), now.get(k)] for k in sorted(changed_by_command_line)
               if not resumable(k) and k in now and was.get(k) != now.get(k)}
    if refused:
        raise ResumeRefused(refused_line(given.get("run", {}).get("dir", ""), refused))
    changes = {k: [was.get(k), now[k]] for k in sorted(resumable_given)
               if k in now and k not in IDENTITY and was.get(k) != now[k]}
    out = json.loads(json.dumps(record))
    for key, pair in changes.items():
        _set(out, key, pair[1])
    for key in IDENTITY:
        if key in now:
            _set(out, key, now[key])
    return out, changes


def note_start(run_dir: str | Path, cfg: dict[str, Any]) -> dict[str, list[Any]]:
    """At a launch, by the run's first cluster's leader: write config.json when run.dir holds none; else, when
    `cfg` differs from the run's configuration, append the difference to resumes.jsonl (config.json is never
    rewritten). Returns the difference ({} for a first launch or none)."""
    run_dir = Path(run_dir)
    path = run_dir / CONFIG
    record = recorded(run_dir)
    if record is None:
        tmp = path.with_name(f".{CONFIG}.tmp")
        tmp.write_text(json.dumps(cfg, indent=1))
        tmp.replace(path)
        return {}
    changes = differences(record, cfg)
    if changes:
        with open(run_dir / RESUMES, "a", encoding="utf-8") as f:
            f.write(json.dumps({"time": time.time(), "changes": changes}) + "\n")
    return changes
