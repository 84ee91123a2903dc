"""The federation's roster: who its clusters are (name -> Ed25519 public key), who its gate is, and what the
federation is (configuration fingerprint, total steps, algorithm) — signed by the operator.

    {"kind": "edit-train-roster",
     "body": {"version": 1, "operator": "<hex>", "gate": "<hex>",
              "federation": {"fingerprint": "...", "total_steps": 1000, "algorithm": "a_edit"},
              "clusters": {"c0": "<hex>", "c1": "<hex>"}, "added": ["c2"], "speeds": {"c0": 3.0, "c1": 1.0}},
     "sig": "<hex: the operator's signature of body>"}

A roster is accepted only when its body names the operator whose public key the reader holds (the pin in the
reader's identity file) and that key signed it. It is public (mode 0644 is fine) but may not be writable by
others. The gate and every cluster accept a record under a name only with that name's signature; a name not
on the roster is a stranger. Adding a cluster is the operator's act: a new version signed with the operator's
key (`edit-train-keygen add`); the gate rereads its roster file when it changes and hands a newer version to
every cluster in its answers (each checks the operator's signature before adopting it). `added` lists the
clusters added after the roster was made, in the order the operator added them (a removed one keeps its place):
a cluster that joins a running federation takes its index and data part from that order (train/build.py).
`speeds` (optional; when present, one per cluster) is each cluster's hardware speed as the operator declares it,
in any unit the operator likes (relative: only ratios count): under A-EDiT a member's claimed speed counts at
most `DECLARED_SPAN` times its declared share of the quorum's (judge.time_caps), so a member's word about its
own speed buys at most that much weight (issue 69). Without it the claim is bounded by `SPEED_SPAN` only.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edit_train.federation.identity import Identity, IdentityError, read_file, verify

log = logging.getLogger(__name__)

KIND = "edit-train-roster"
ROSTER_ENV = "EDIT_TRAIN_ROSTER_FILE"
MAX_ROSTER = 1 << 20
CONTEXT = "roster"


@dataclass(frozen=True)
class Roster:
    version: int
    fingerprint: str
    total_steps: int
    algorithm: str
    clusters: dict[str, bytes]
    gate: bytes | None
    operator: bytes
    doc: dict[str, Any]  # the signed document, as it travels
    added: tuple[str, ...] = ()  # clusters added to a running federation, in order (a removed one keeps its place)
    speeds: dict[str, float] = field(default_factory=dict)  # declared hardware speed per cluster ({}: none)

    def key(self, name: str) -> bytes | None:
        return self.clusters.get(name)

    @staticmethod
    def make(operator: Identity, clusters: dict[str, bytes], gate: bytes | None, fingerprint: str,
             total_steps: int, algorithm: str, version: int = 1, added: tuple[str, ...] = (),
             speeds: dict[str, float] | None = None) -> Roster:
        assert operator.role == "operator"
        body: dict[str, Any] = {
            "version": version, "operator": operator.public.hex(), "gate": gate.hex() if gate else "",
            "federation": {"fingerprint": fingerprint, "total_steps": total_steps, "algorithm": algorithm},
            "clusters": {n: k.hex() for n, k in sorted(clusters.items())}}
        if added:  # absent from a roster nobody was added to (its signed body is what it always was)
            body["added"] = list(added)
        if speeds:  # likewise absent when the operator declares none
            body["speeds"] = {n: float(v) for n, v in sorted(speeds.items())}
        return parse({"kind": KIND, "body": body, "sig": operator.sign(CONTEXT, body)}, operator.public)

    def add(self, operator: Identity, name: str, public: bytes, speed: float | None = None) -> Roster:
        """The next version, with cluster `name` (signed by the operator), last in `added`; `speed`: its declared
        speed (required when the roster declares speeds, refused when it does not)."""
        if bool(self.speeds) != (speed is not None):
            raise ValueError(f"the roster declares every cluster's speed: give {name}'s (--speed)" if self.speeds
                             else f"the roster declares no speeds: {name}'s cannot be the only one")
        speeds = {**self.speeds, name: speed} if speed is not None else None
        return Roster.make(operator, {**self.clusters, name: public}, self.gate, self.fingerprint, self.total_steps,
                           self.algorithm, self.version + 1, (*[n for n in self.added if n != name], name), speeds)

    def without(self, operator: Identity, name: str) -> Roster:
        """The next version without cluster `name` (its place in `added` kept: nobody else takes its index)."""
        return Roster.make(operator, {n: k for n, k in self.clusters.items() if n != name}, self.gate,
                           self.fingerprint, self.total_steps, self.algorithm, self.version + 1, self.added,
                           {n: v for n, v in self.speeds.items() if n != name})


def parse(doc: Any, pin: bytes, where: str = "the roster") -> Roster:
    """A roster document checked against the operator key `pin` (IdentityError naming `where` otherwise)."""
    def bad(why: str) -> IdentityError:
        return IdentityError(f"{where}: {why}")

    if not isinstance(doc, dict) or doc.get("kind") != KIND or not isinstance(doc.get("body"), dict):
        raise bad("not an edit-train roster")
    body = doc["body"]
    if body.get("operator") != pin.hex():
        raise bad("signed for another operator than the one this identity trusts")
    if not verify(pin, CONTEXT, body, doc.get("sig")):
        raise bad("the operator's signature does not verify (altered, or not the operator's)")
    fed, clusters = body.get("federation"), body.get("clusters")
    try:
        out = Roster(int(body["version"]), str(fed["fingerprint"]), int(fed["total_steps"]), str(fed["algorithm"]),
                     {str(n): _key(k) for n, k in clusters.items()}, _key(body["gate"]) if body["gate"] else None,
                     pin, doc, tuple(str(n) for n in body.get("added", [])), _speeds(body.get("speeds", {})))
        if out.speeds and set(out.speeds) != set(out.clusters):
            raise ValueError(f"speeds must name every cluster and only those (missing "
                             f"{sorted(set(out.clusters) - set(out.speeds))}, not on it "
                             f"{sorted(set(out.speeds) - set(out.clusters))})")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise bad(f"malformed ({exc})") from None
    return out


def _speeds(d: Any) -> dict[str, float]:
    out = {str(n): float(v) for n, v in dict(d).items()}
    if not all(math.isfinite(v) and v > 0 for v in out.values()):
        raise ValueError("a declared speed is a positive finite number")
    return out


def _key(h: Any) -> bytes:
    b = bytes.fromhex(h)
    if len(b) != 32:
        raise ValueError("a public key is 32 bytes")
    return b


def load_roster(path: str | Path, pin: bytes, field: str = "federation.roster_file") -> Roster:
    """The roster in `path`, checked against `pin` (one line naming `field` otherwise)."""
    path = Path(path)
    make = "the operator makes it with `edit-train-keygen federation DIR`"
    data = read_file(path, field, make, MAX_ROSTER, private=False)
    try:
        doc = json.loads(data[:MAX_ROSTER].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise IdentityError(f"{field}: {path} is not JSON; {make}") from None
    return parse(doc, pin, f"{field}: {path}")


def save_roster(path: str | Path, roster: Roster) -> Path:
    """Write `roster` to `path` atomically (mode 0644: public, writable by its owner only)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(roster.doc, indent=1) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


class RosterFile:
    """A roster file the gate rereads when it changes (one stat per request): the operator adds a cluster by
    writing a newer version there. A file that does not check out is one line, and the roster in use stays."""

    def __init__(self, path: str | Path, pin: bytes) -> None:
        self.path, self.pin = Path(path), pin
        self._stamp = self._stat()

    def _stat(self) -> tuple[int, int, int]:
        try:
            st = self.path.stat()
        except OSError:
            return (0, 0, 0)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def newer(self) -> Roster | None:
        """The file's roster when it changed since the last look (None otherwise, or when it is unusable)."""
        stamp = self._stat()
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        try:
            return load_roster(self.path, self.pin)
        except IdentityError as exc:
            log.warning("the gate's roster file changed but cannot be used: %s; keeping the roster in use", exc)
            return None
