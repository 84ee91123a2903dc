"""Naming liars: every claim, vote or contribution of another cluster that this cluster refuses, ignores or
bounds is said once in the log — one line naming the cluster and the roster key that signed its records — and
in every `sync` event this cluster emits after it (`suspects`: [{cluster, key, what}], docs/architecture.md §5).

An honest cluster can be named too (a bounded norm after a legitimate outlier interval); the name is evidence
for the operator, not a verdict: what a named cluster sent was already refused or bounded where it was said.
"""

from __future__ import annotations

import logging
from typing import Any

from edit_train.local_sgd.protocols import Quorum

log = logging.getLogger(__name__)


class Suspects:
    """What this cluster (`me`) named since its last `sync` event."""

    def __init__(self, me: str) -> None:
        self.me = me
        self._said: set[tuple[str, str]] = set()
        self._pending: list[dict[str, Any]] = []

    def name(self, q: Quorum, i: int, what: str, kind: str = "") -> None:
        """Member `i` of `q` did `what` (one clause: "voted to stop at step 8 (ignored: ...)"). Logged once per
        cluster and `kind` (default: `what`); always kept for the next `sync` event."""
        m = q.members[i]
        entry = {"cluster": m.name, "key": m.signer, "what": what}
        if entry not in self._pending:
            self._pending.append(entry)
        said = (m.name, kind or what)
        if said not in self._said:
            self._said.add(said)
            signed = f" (its records signed by roster key {m.signer})" if m.signer else " (no roster: unsigned)"
            log.warning("cluster %s: cluster %s %s%s", self.me, m.name, what, signed)

    def take(self) -> list[dict[str, Any]]:
        """The entries since the last call (for a `sync` event)."""
        out, self._pending = self._pending, []
        return out
