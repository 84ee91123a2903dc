"""`edit-train-keygen`: the federation's keys.

    edit-train-keygen PATH                         a federation key (32 random bytes, hex, mode 0600) at PATH
    edit-train-keygen federation DIR [OVERRIDES…]  a whole federation in DIR: its key, the operator's key, the
                                                   gate's and every cluster's identity, and the roster the
                                                   operator signs (what the federation runs comes from the
                                                   edit-train config the OVERRIDES compose, as for edit-train)
                      [--speeds c0=3,c1=1]         and each cluster's hardware speed, declared (any unit: only
                                                   ratios count; under A-EDiT a member's claimed speed counts at
                                                   most its declared share, docs/security.md)
    edit-train-keygen add DIR NAME [--speed S]     cluster NAME joins: its identity and the next roster version
    edit-train-keygen remove DIR NAME              cluster NAME leaves: the next roster version without it

Where the files go (docs/architecture.md, "Security model"): `federation.key` and `roster.json` to the
Lighthouse and every cluster; `gate.identity` to the Lighthouse's host only; `<cluster>.identity` to that
cluster's nodes only; `operator.key` nowhere (it signs rosters: keep it with the operator). Copy them over a
channel you trust (scp, your secrets manager). Nothing is ever overwritten: rotating a key is a new file, then
a restart of the federation with it; adding a cluster mid-run is `add`, then copying the new roster.json to
the Lighthouse's host (its gate rereads the file and hands the new version to every cluster); removing one
(a leaked identity, a member that misbehaves) is `remove`, the same way.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from edit_train.cli.common import fail, one_line


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "federation":
        return federation(args[1:])
    if args and args[0] in ("add", "remove"):
        return change(args[0], args[1:])
    p = argparse.ArgumentParser(prog="edit-train-keygen", description="Make a federation key (mode 0600); "
                                "`edit-train-keygen federation DIR` makes identities and a roster too.")
    p.add_argument("path", help="where to write the key (refused if the file exists)")
    path = _key(p.parse_args(args).path)
    from edit_train.federation import auth

    print(f"edit-train-keygen: wrote a federation key to {path} (mode 0600, id {auth.fingerprint(auth.load_key(path))}); "
          f"give every cluster and the Lighthouse federation.key_file={path}")


def _key(path: str | Path) -> Path:
    from edit_train.federation import auth

    try:
        out = auth.new_key(path)
        auth.load_key(out)
    except (auth.KeyFileError, OSError) as exc:
        fail(str(exc) if isinstance(exc, auth.KeyFileError) else f"cannot write {path}: {exc.strerror}")
    return out


def federation(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="edit-train-keygen federation",
                                description="Make a federation's key, identities and signed roster in DIR.")
    p.add_argument("dir", help="a new (or empty) directory")
    p.add_argument("--clusters", default="", help="comma-separated cluster names (default: the config's clusters)")
    p.add_argument("--speeds", default="", help="each cluster's declared hardware speed, NAME=S comma-separated "
                   "(relative: only ratios count), e.g. c0=3,c1=1; under A-EDiT a member's claimed speed counts at "
                   "most its declared share")
    args, overrides = p.parse_known_args(argv)
    speeds = _speeds(args.speeds)
    from edit_train.cli.common import compose
    from edit_train.config import cluster_specs
    from edit_train.federation import enrol
    from edit_train.federation.identity import IdentityError
    from edit_train.train.build import fingerprint

    try:
        cfg = compose(overrides)
    except Exception as exc:  # noqa: BLE001 - one line for a bad override
        fail(one_line(exc))
    names = [n for n in args.clusters.split(",") if n] or [s.name for s in cluster_specs(cfg)]
    d = Path(args.dir)
    if d.exists() and any(d.iterdir()):
        fail(f"{d} is not empty: a federation is made in a new directory (nothing is ever overwritten)")
    key = _key(d / "federation.key")
    try:
        roster = enrol.make(d, names, (fingerprint(cfg), cfg.train.steps, cfg.algo.name), speeds or None)
    except (IdentityError, OSError, ValueError) as exc:
        fail(one_line(exc))
    print(f"edit-train-keygen: a federation of {names} in {d}: {key.name} and {roster.name} to the Lighthouse and "
          f"every cluster, gate.identity to the Lighthouse's host, <cluster>.identity to that cluster only, "
          f"operator.key to no one (it signs rosters); the roster says: {cfg.algo.name}, train.steps="
          f"{cfg.train.steps}, configuration {fingerprint(cfg)}"
          + (f", declared speeds {speeds}" if speeds else ""))


def _speeds(text: str) -> dict[str, float]:
    """`c0=3,c1=1` -> {"c0": 3.0, "c1": 1.0} (one line for anything else)."""
    out: dict[str, float] = {}
    for part in (x.strip() for x in text.split(",") if x.strip()):
        name, eq, value = part.partition("=")
        try:
            speed = float(value) if eq and name.strip() else math.nan
        except ValueError:
            speed = math.nan
        if not (math.isfinite(speed) and speed > 0):
            fail(f"--speeds: {part!r} is not NAME=S with S a positive number (e.g. c0=3,c1=1)")
        out[name.strip()] = speed
    return out


def change(act: str, argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog=f"edit-train-keygen {act}", description=f"{act.capitalize()} cluster NAME "
                                "to/from the roster in DIR (the next version, signed with DIR/operator.key).")
    p.add_argument("dir")
    p.add_argument("name")
    if act == "add":
        p.add_argument("--speed", type=float, default=None, help="its declared hardware speed (needed when the "
                       "roster declares speeds)")
    args = p.parse_args(argv)
    from edit_train.federation import enrol
    from edit_train.federation.frames import valid_name

    if not valid_name(args.name):
        fail(f"{args.name!r} is not a cluster name (letters, digits, '-', '_', '.'; at most 64)")
    try:
        if act == "add" and args.speed is not None and not (math.isfinite(args.speed) and args.speed > 0):
            fail(f"--speed: {args.speed} is not a positive number")
        path = enrol.add(args.dir, args.name, args.speed) if act == "add" else enrol.remove(args.dir, args.name)
    except (ValueError, OSError) as exc:
        fail(one_line(exc))
    done = f"added ({path}, to its nodes only)" if act == "add" else "removed"
    print(f"edit-train-keygen: cluster {args.name} {done}; copy {Path(args.dir) / 'roster.json'} to the Lighthouse's "
          "host: its gate picks the new version up and hands it to every cluster")


if __name__ == "__main__":
    main()
