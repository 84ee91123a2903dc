"""Issue 69, "believe only what you can check": the honest clusters' loss with and without each liar of items 1, 2,
5 and 7, on the toy federation over a real gate with a roster — the runs of `tests/federation/test_insiders_first_heal.py`,
`tests/federation/test_insiders_claimed_steps.py` (and `_a_edit.py`: a time schedule), `tests/federation/test_insiders_stalled.py` and
`tests/federation/test_insiders_rollback.py` (4 syncs of 4 steps, the same seed); and what is left of item 2 under
A-EDiT, a member that claims 4x its speed with 4x its steps (consistent: the time caps hold) and sends 15x its Δ,
bounded by the token cap and the scale bound only. Prints one line per item and cluster count:
(cluster, loss without the lie, loss with it, change); item 5 against the honest clusters' run without the staller,
with the syncs they lost. docs/security.md quotes it. ~4 min."""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path[:0] = [str(TESTS / d) for d in ("helpers", "federation", "local_sgd")]  # the tests it reruns (and theirs)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from liar_utils import final_loss  # noqa: E402
import test_insiders_claimed_steps as claimed  # noqa: E402
import test_insiders_claimed_steps_a_edit as claimed_a  # noqa: E402
from test_insiders_claimed_steps_a_edit import ClaimsFaster  # noqa: E402
import test_insiders_first_heal as first  # noqa: E402
import test_insiders_rollback as rollback  # noqa: E402
import test_insiders_stalled as stalled  # noqa: E402
from edit_train.local_sgd.sync.judge import EXTRA  # noqa: E402


def _line(item: str, n: int, honest: list[str], base: dict, lied: dict) -> None:
    row = []
    for h in honest:
        b, x = final_loss(base[h], 0), final_loss(lied[h], 0)
        lost = sum(e["event"] == "sync_aborted" for e in lied[h].events)
        row.append(f"{h}: {b:.4f} -> {x:.4f} ({100 * (x / b - 1):+.1f} %, {lost} syncs lost)")
    print(f"{item}, {n} clusters: " + "; ".join(row), flush=True)


def main(argv: list[str] | None = None) -> None:
    a = C.parse(C.parser(__doc__), argv)
    logging.disable(logging.CRITICAL)
    root = C.SMOKE or Path(tempfile.mkdtemp(prefix="insiders_checked-"))
    for n in (2,) if a.smoke else (2, 3):  # --smoke: item 7 at 2 clusters
        names = [f"c{i}" for i in range(n)]
        honest = names[:-1]
        late = {"c1": first.GateRun.join_timeout_s + 1.0} if n == 3 else {}
        if not a.smoke:
            _line("1 first heal", n, honest, first._run(root / f"1c{n}", names, False, late)[0],
                  first._run(root / f"1l{n}", names, True, late)[0])
            _line("2 claimed steps", n, honest, claimed._run(root / f"2c{n}", names, False)[0],
                  claimed._run(root / f"2l{n}", names, True)[0])
            _line("2 claimed steps, A-EDiT", n, honest, claimed_a._run(root / f"2ac{n}", [1] * n, False)[0],
                  claimed_a._run(root / f"2al{n}", [1] * n, True)[0])
            _line("2 claimed speed and steps, A-EDiT", n, honest, claimed_a._run(root / f"2sc{n}", [1] * n, False)[0],
                  claimed_a._run(root / f"2sl{n}", [1] * n, True, ClaimsFaster)[0])
            declared = {x: 1.0 for x in names}  # the roster declares every cluster's speed (equal hardware)
            _line("2 claimed speed and steps, A-EDiT, speeds in the roster", n, honest,
                  claimed_a._run(root / f"2dc{n}", [1] * n, False, speeds=declared)[0],
                  claimed_a._run(root / f"2dl{n}", [1] * n, True, ClaimsFaster, speeds=declared)[0])
        _line("7 commit-then-rollback", n, honest, rollback._run(root / f"7c{n}", names, False)[0],
              rollback._run(root / f"7l{n}", names, True)[0])
        if not a.smoke:
            _line("5 stalled exchange", n, honest, stalled._run(root / f"5c{n}", honest, None)[0],
                  stalled._run(root / f"5l{n}", names, names[-1])[0])


if __name__ == "__main__":
    main()
