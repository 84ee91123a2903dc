"""Issue 69, item 2's residue: the roster may declare each cluster's hardware speed (`edit-train-keygen federation
DIR --speeds c0=3,c1=1`), signed by the operator like the rest of it; a member's record carries the speed the
*receiver's* roster declares for it, never its own say; an added cluster declares one when the others have one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from edit_train.federation import enrol
from edit_train.federation.identity import IdentityError, load_identity
from edit_train.federation.roster import load_roster, parse

TERMS = ("fp", 100, "a_edit")


def _pin(fed: Path) -> bytes:
    return load_identity(fed / enrol.OPERATOR, role="operator").public


def test_declared_speeds_are_signed_kept_and_required_of_every_cluster(tmp_path: Path) -> None:
    fed = tmp_path / "fed"
    enrol.make(fed, ["c0", "c1"], TERMS, {"c0": 3.0, "c1": 1.0})
    roster = load_roster(fed / enrol.ROSTER, _pin(fed))
    assert roster.speeds == {"c0": 3.0, "c1": 1.0}
    with pytest.raises(ValueError, match="declares every cluster's speed: add c2 with --speed"):
        enrol.add(fed, "c2")
    enrol.add(fed, "c2", 0.5)
    enrol.remove(fed, "c0")
    roster = load_roster(fed / enrol.ROSTER, _pin(fed))
    assert roster.version == 3 and roster.speeds == {"c1": 1.0, "c2": 0.5}
    # the operator signed the speeds: changing one breaks the signature
    doc = json.loads((fed / enrol.ROSTER).read_text())
    doc["body"]["speeds"]["c1"] = 100.0
    with pytest.raises(IdentityError, match="signature does not verify"):
        parse(doc, _pin(fed))


def test_a_roster_without_speeds_is_what_it_always_was(tmp_path: Path) -> None:
    fed = tmp_path / "fed"
    enrol.make(fed, ["c0", "c1"], TERMS)
    assert "speeds" not in json.loads((fed / enrol.ROSTER).read_text())["body"]
    with pytest.raises(ValueError, match="declares no speeds"):
        enrol.add(fed, "c2", 2.0)
    with pytest.raises(ValueError, match="must name every cluster"):
        enrol.make(tmp_path / "other", ["c0", "c1"], TERMS, {"c0": 1.0})


@pytest.mark.parametrize("bad", ["c0=3,c1=0", "c0=3,c1=-1", "c0=fast,c1=1", "c0=3,c1", "c0=inf,c1=1"])
def test_a_bad_speed_is_one_line(tmp_path: Path, bad: str) -> None:
    out = subprocess.run([sys.executable, "-m", "edit_train.cli.keygen", "federation", str(tmp_path / "f"),
                          "--clusters", "c0,c1", f"--speeds={bad}"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert [x for x in out.stderr.splitlines() if x.strip()] == \
        [x for x in out.stderr.splitlines() if "--speeds" in x], out.stderr
    assert not (tmp_path / "f").exists() or not any((tmp_path / "f").iterdir())


def test_a_records_speed_is_the_receivers_roster_not_the_records_say(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The quorum a cluster reads: each member's speed from its own roster (a record claiming one is ignored)."""
    from edit_train.federation import quorum
    from edit_train.federation.quorum import QuorumClient
    from edit_train.federation.signed import load_credentials

    fed = tmp_path / "fed"
    enrol.make(fed, ["c0", "c1"], TERMS, {"c0": 3.0, "c1": 1.0})
    creds = load_credentials(str(fed / "c0.identity"), str(fed / enrol.ROSTER), "c0")
    monkeypatch.setattr(quorum, "check_reachable", lambda *a: None)  # no gate: the answer is handed in below
    client = QuorumClient("127.0.0.1:1", "c0", bytes(32), credentials=creds)
    records = [{"name": n, "sync": 0, "size": 1, "store": "h:1", "speed": 50.0,
                "data": {"incarnation": "i" if n == "c0" else "j"}} for n in ("c0", "c1")]
    records = [creds.sign_member(r) if r["name"] == "c0" else r for r in records]
    client._left_out = lambda r: False  # type: ignore[method-assign]  # the records' signatures are another test's
    q = client._quorum({"members": records, "quorum_id": 1, "nonce": "n"}, {"incarnation": "i"})
    assert [m.speed for m in q.members] == [3.0, 1.0]
