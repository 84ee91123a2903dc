"""The operator's acts: make a federation's identities and roster, add a cluster, restate what it runs.

A federation directory (`edit-train-keygen federation DIR`, or `run.dir/federation/` of a local run):

    DIR/operator.key        the operator's identity (0600): signs rosters; stays with the operator
    DIR/roster.json         the signed roster (0644): to the gate and to every cluster
    DIR/gate.identity       the gate's identity (0600): to the Lighthouse's host only
    DIR/<cluster>.identity  one per cluster (0600): to that cluster's nodes only

Every act is a roster signed with the operator's key: the gate picks a newer version up from its file and
hands it on to the clusters (`roster.py`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from edit_train.federation.identity import Identity, load_identity, new_identity
from edit_train.federation.roster import Roster, load_roster, save_roster

log = logging.getLogger(__name__)

OPERATOR, ROSTER, GATE = "operator.key", "roster.json", "gate.identity"


def identity_path(directory: str | Path, name: str) -> Path:
    return Path(directory) / f"{name}.identity"


def make(directory: str | Path, names: list[str], terms: tuple[str, int, str],
         speeds: dict[str, float] | None = None) -> Path:
    """A new federation in `directory` running `terms` (configuration fingerprint, total steps, algorithm):
    the operator's, the gate's and each cluster's identity and the roster (refuses to overwrite any of them);
    `speeds`: each cluster's declared hardware speed (roster.py). Returns the roster's path."""
    d = Path(directory)
    if speeds and set(speeds) != set(names):
        raise ValueError(f"--speeds must name every cluster of {names} and only those (got {sorted(speeds)})")
    operator = new_identity(d / OPERATOR, "operator", "operator")
    gate = new_identity(d / GATE, "gate", "gate", operator.public)
    clusters = {n: new_identity(identity_path(d, n), n, "cluster", operator.public).public for n in names}
    roster = Roster.make(operator, clusters, gate.public, *terms, speeds=speeds)
    return save_roster(d / ROSTER, roster)


def _operator(d: Path) -> tuple[Identity, Roster]:
    operator = load_identity(d / OPERATOR, field=f"the operator's key {d / OPERATOR}", role="operator")
    return operator, load_roster(d / ROSTER, operator.public, field=f"the roster {d / ROSTER}")


def add(directory: str | Path, name: str, speed: float | None = None) -> Path:
    """Cluster `name` joins: its identity, and the next roster version with it (`speed`: its declared speed,
    needed when the roster declares speeds). Returns its identity's path."""
    d = Path(directory)
    operator, roster = _operator(d)
    if roster.key(name) is not None:
        raise ValueError(f"cluster {name!r} is already on the roster {d / ROSTER} (version {roster.version})")
    if bool(roster.speeds) != (speed is not None):
        raise ValueError(f"the roster {d / ROSTER} declares every cluster's speed: add {name} with --speed S"
                         if roster.speeds else f"the roster {d / ROSTER} declares no speeds: add {name} without "
                         "--speed")
    ident = new_identity(identity_path(d, name), name, "cluster", operator.public)
    save_roster(d / ROSTER, roster.add(operator, name, ident.public, speed))
    return identity_path(d, name)


def remove(directory: str | Path, name: str) -> Path:
    """Cluster `name` leaves (a lost node, a leaked identity, a member that misbehaves): the next roster version
    without it. The gate refuses it from the moment it reads the file; every cluster drops its records once it
    holds that version. Returns the roster's path (its identity file is left for the operator to delete)."""
    d = Path(directory)
    operator, roster = _operator(d)
    if roster.key(name) is None:
        raise ValueError(f"cluster {name!r} is not on the roster {d / ROSTER} (version {roster.version})")
    return save_roster(d / ROSTER, roster.without(operator, name))


def ensure(directory: str | Path, names: list[str], terms: tuple[str, int, str]) -> Path:
    """A local run's federation (`edit-train` makes it per run): made when absent, a cluster not yet on it
    added, the terms restated when the run's configuration changed (a resume with other train.steps)."""
    d = Path(directory)
    if not (d / ROSTER).exists():
        return make(d, names, terms)
    operator, roster = _operator(d)
    clusters, added = dict(roster.clusters), list(roster.added)
    for n in names:
        if n not in clusters:
            clusters[n] = new_identity(identity_path(d, n), n, "cluster", operator.public).public
            added.append(n)  # a cluster joining the running federation (cluster.only=<a name not configured>)
    if roster.speeds and set(clusters) != set(roster.speeds):
        raise ValueError(f"the roster {d / ROSTER} declares every cluster's speed: add "
                         f"{sorted(set(clusters) - set(roster.speeds))} with `edit-train-keygen add DIR NAME --speed S`")
    if clusters != roster.clusters or terms != (roster.fingerprint, roster.total_steps, roster.algorithm):
        save_roster(d / ROSTER, Roster.make(operator, clusters, roster.gate, *terms, version=roster.version + 1,
                                            added=tuple(added), speeds=roster.speeds))
        log.info("roster %s: version %d (clusters %s)", d / ROSTER, roster.version + 1, sorted(clusters))
    return d / ROSTER
