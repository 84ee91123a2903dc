"""`python -m edit_train.cli.key_check OVERRIDES…`: before a cluster job starts its ranks, check that no other job
still writes this cluster into run.dir (its run lock, on the node of rank 0), its identity and
roster files (missing, unreadable, too open, not this cluster's, another configuration than the roster's: one
line, exit 2) and ask the federation's gate whether it holds this cluster's key and accepts its identity (a
signed hello the Lighthouse never sees).

`launchers/torchrun_multinode.sh` runs it on every node. A gate that refuses the key for
`federation.join_timeout_s` + 20 s stops the job here with one line (exit 2) — before torchrun, which would
otherwise restart a job that can never get in `MAX_RESTARTS` times. A Lighthouse address nobody listens on is the
same kind of mistake (every rank 0 would fail at once with `cannot reach the Lighthouse`, and be restarted): one line,
exit 2, before torchrun and before anything is written into run.dir. (A gate that listens but does not answer the
hello in time is not a refusal: the job starts and waits for it as usual.)
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
    from edit_train.federation.quorum import check_key, check_reachable
    from edit_train.local_sgd.errors import FederationError, FederationRefused
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
        if not check_key(f.lighthouse, name, key, key_source(f.key_file), key_refused_after_s(f), credentials=creds):
            check_reachable(f.lighthouse, 10.0)  # nobody listens there: a wrong address or no Lighthouse yet
    except (auth.KeyFileError, ConfigError, FederationError) as exc:  # FederationRefused is one
        fail(f"cluster {name}: {one_line(exc)}" if isinstance(exc, FederationError) and
             not isinstance(exc, FederationRefused) else one_line(exc))


if __name__ == "__main__":
    main()
