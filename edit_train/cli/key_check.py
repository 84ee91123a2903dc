"""`python -m edit_train.cli.key_check OVERRIDES…`: before a cluster job starts its ranks, check that no other job
still writes this cluster into run.dir (its run lock, on the node of rank 0), its identity and
roster files (missing, unreadable, too open, not this cluster's, another configuration than the roster's: one
line, exit 2) and ask the federation's gate whether it holds this cluster's key and accepts its identity (a
signed hello the Lighthouse never sees).

`launchers/torchrun_multinode.sh` runs it on every node. A gate that refuses the key for
`federation.join_timeout_s` + 20 s stops the job here with one line (exit 2) — before torchrun, which would
otherwise restart a job that can never get in `MAX_RESTARTS` times. A gate that cannot be reached is not a
refusal: the job starts and waits for the Lighthouse as usual.
"""

from __future__ import annotations

import os
import sys

from edit_train.cli.common import compose, fail, one_line


def main(argv: list[str] | None = None) -> None:
    try:
        cfg = compose(sys.argv[1:] if argv is None else argv)
    except Exception as exc:  # noqa: BLE001 - one line for a bad override
        fail(one_line(exc))
    from edit_train.federation import auth
    from edit_train.federation.quorum import check_key
    from edit_train.local_sgd.errors import FederationRefused
    from edit_train.config import ConfigError
    from edit_train.train.build import credentials, key_refused_after_s, key_source

    f = cfg.federation
    name = os.environ.get("EDIT_TRAIN_CLUSTER", "") or cfg.cluster.only
    if not f.lighthouse:
        fail("federation.lighthouse is not set")
    if os.environ.get("EDIT_TRAIN_NODE_RANK", "0") == "0":  # the node of the cluster's rank 0, which takes the lock
        from edit_train.train.runlock import RunLocked, check_free

        try:
            check_free(cfg.run.dir, [name])  # another job still writes this cluster: say who, before torchrun
        except RunLocked as exc:
            fail(one_line(exc))
    try:
        from edit_train.fields import check_host_here

        check_host_here("federation.host", os.environ.get("EDIT_TRAIN_HOST") or f.host)
        key = auth.resolve(f.key_file, f.insecure, [f.lighthouse])
        creds = credentials(cfg, name)
        check_key(f.lighthouse, name, key, key_source(f.key_file), key_refused_after_s(f), credentials=creds)
    except (auth.KeyFileError, ConfigError, FederationRefused) as exc:
        fail(one_line(exc))


if __name__ == "__main__":
    main()
