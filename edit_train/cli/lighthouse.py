"""`edit-train-lighthouse`: the federation's Lighthouse (torchft's) behind its authenticating gate.

Start one per federation on a host every cluster can reach, on an address you name, with the federation key
(`edit-train-keygen PATH` makes one), then point each cluster job at it (`LIGHTHOUSE=host:port` for the
launchers, `federation.lighthouse=host:port` for `edit-train`):

    edit-train-lighthouse --bind 10.0.0.5:29510 federation.key_file=/secrets/fed.key \
        federation.roster_file=/secrets/roster.json federation.identity_file=/secrets/gate.identity \
        federation.min_clusters=2 federation.join_timeout_s=30

With a roster (`edit-train-keygen federation DIR` makes the files) the gate forwards a request only when the
cluster it names is on the roster and signed it, and signs its answers with the gate's identity; it rereads
the roster file when it changes (the operator's `edit-train-keygen add`) and hands the new version on.

Only requests signed with the key reach torchft's Lighthouse, which runs in a network namespace of its own
that only the gate reaches (`federation/inner.py`), with its dashboard and the dashboard's unauthenticated kill
endpoint; where the kernel allows no user namespaces it listens on 127.0.0.1 of this host (it says so): reach
the dashboard with an SSH tunnel then, never by exposing the port. There is no default address: binding every interface is something you say
(`--bind 0.0.0.0:29510`), and across hosts a key is required unless `federation.insecure=true`. Its quorum
rules come from the keys the clusters read (`federation.min_clusters`, `join_timeout_s`,
`heartbeat_timeout_s`). It prints its address, then serves until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from edit_train.cli.common import compose, fail, one_line


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="edit-train-lighthouse",
                                description="torchft's Lighthouse for an edit-train federation; other arguments "
                                            "are edit-train config overrides (federation.*).")
    p.add_argument("--bind", required=True, help="host:port to listen on (e.g. the host's address on the network "
                                                 "the clusters share; no default)")
    p.add_argument("--address-file", default="", help="also write the address (host:port) to this file")
    return p.parse_known_args(argv)


def main(argv: list[str] | None = None) -> None:
    args, overrides = parse(sys.argv[1:] if argv is None else argv)
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        fail(f"unknown option(s) {bad}; see edit-train-lighthouse --help")
    try:
        cfg = compose(overrides)
        from edit_train.config import check_federation_timeouts

        check_federation_timeouts(cfg.federation)  # inf / nan / <= 0: one line, exit 2
    except Exception as exc:  # noqa: BLE001 - one line for a bad override
        fail(one_line(exc))
    from edit_train.federation import auth
    from edit_train.federation.quorum import Lighthouse
    from edit_train.federation.roster import ROSTER_ENV
    from edit_train.federation.signed import load_credentials

    f = cfg.federation
    try:
        key = auth.resolve(f.key_file, f.insecure, [args.bind])
        creds = load_credentials(f.identity_file, f.roster_file, "gate", role="gate")
    except auth.KeyFileError as exc:
        fail(one_line(exc))
    try:
        house = Lighthouse(args.bind, key, f.min_clusters, f.join_timeout_s, f.heartbeat_timeout_s, creds,
                           f.roster_file or os.environ.get(ROSTER_ENV, ""))
    except Exception as exc:  # noqa: BLE001 - e.g. the port is taken
        fail(f"cannot start the Lighthouse on {args.bind}: {one_line(exc)}")
    kind = "insecure: no key" if key == auth.INSECURE else f"key id {auth.fingerprint(key)}"
    if creds is not None:
        kind += f", roster version {creds.roster.version} of {len(creds.roster.clusters)} clusters"
    elif key != auth.INSECURE:
        kind += ", no roster: any key holder may speak for any cluster"
    print(f"edit-train-lighthouse: serving at {house.address} ({kind}; min_clusters={f.min_clusters}, "
          f"join_timeout_s={f.join_timeout_s:g}, heartbeat_timeout_s={f.heartbeat_timeout_s:g})", flush=True)
    if house.isolated:
        print("edit-train-lighthouse: torchft's Lighthouse (and its dashboard) in a network namespace only the gate "
              "reaches", flush=True)
    else:
        print(f"edit-train-lighthouse: torchft's dashboard (no authentication) on loopback only: {house.dashboard} "
              "(reach it with an SSH tunnel)", flush=True)
    if args.address_file:
        with open(args.address_file, "w") as fh:
            fh.write(house.address + "\n")
    wait_for_signal()
    house.shutdown()
    # no interpreter teardown: the gate's handler threads may still be inside torchft's client, and a thread
    # unwound by force there aborts with a raw "FATAL: exception not rethrown" (issue 64)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


STOP = [False]  # set by the signal handler: a plain store, no lock (a second signal can never deadlock it)


def _stop(_sig: int, _frame: object) -> None:
    STOP[0] = True


def wait_for_signal(poll_s: float = 0.1) -> None:
    """Serve until SIGINT/SIGTERM. The handler only sets a flag; this loop reads it (a sleep is cut short by a
    signal's handler and resumed, so the flag is seen within `poll_s`). A signal that came before returns at once."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stop)
    while not STOP[0]:
        time.sleep(poll_s)


if __name__ == "__main__":
    main()
