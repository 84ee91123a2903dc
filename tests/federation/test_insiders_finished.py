"""The gate's finished record (`<roster_file>.finished.json`, issue 48) is kept per run — the configuration
fingerprint each signed request carries — so it does not outlive its run: a new run with the same roster file
(re-enrolled for another configuration) starts clean, while a relaunch of the same run still learns who
finished (issue 49 (f))."""

from __future__ import annotations

import json
from pathlib import Path

from edit_train.federation import auth, enrol, gate
from edit_train.federation.quorum import finished_peers, tell_finished
from edit_train.federation.signed import Credentials, load_credentials

KEY = auth.INSECURE
NAMES = ["a", "b"]


def _enrol(d: Path, fp: str) -> None:
    for p in list(d.glob("*")) if d.is_dir() else []:
        if not p.name.endswith(".finished.json"):  # a new federation in the same place: its finished file stays
            p.unlink()
    enrol.make(d, NAMES, (fp, 20, "diloco"))


def _creds(d: Path, name: str) -> Credentials:
    creds = load_credentials(str(enrol.identity_path(d, name)), str(d / enrol.ROSTER), name)
    assert creds is not None
    return creds


def _serve(d: Path) -> gate.Gate:
    creds = load_credentials(str(d / enrol.GATE), str(d / enrol.ROSTER), "gate", role="gate")
    return gate.Gate("127.0.0.1:0", KEY, 1, 0.5, 5.0, creds, str(d / enrol.ROSTER))


def test_a_new_run_with_the_same_roster_file_does_not_read_the_old_runs_finished(tmp_path: Path) -> None:
    d = tmp_path / "fed"
    _enrol(d, "model/algo/sync=1111111111111111 tokenizer=byte")
    g = _serve(d)
    try:
        assert tell_finished(g.address, "a", 20, KEY, _creds(d, "a"))
        assert finished_peers(g.address, "b", KEY, _creds(d, "b")) == {"a": 20}
    finally:
        g.shutdown()
    g = _serve(d)  # the same run, its gate restarted: still known
    try:
        assert finished_peers(g.address, "b", KEY, _creds(d, "b")) == {"a": 20}
    finally:
        g.shutdown()
    _enrol(d, "model/algo/sync=2222222222222222 tokenizer=byte")  # a new run, the same roster file
    g = _serve(d)
    try:
        assert finished_peers(g.address, "b", KEY, _creds(d, "b")) == {}
        assert tell_finished(g.address, "b", 20, KEY, _creds(d, "b"))
        assert finished_peers(g.address, "a", KEY, _creds(d, "a")) == {"b": 20}
    finally:
        g.shutdown()
    runs = json.loads((d / (enrol.ROSTER + ".finished.json")).read_text())["runs"]
    assert runs == {"model/algo/sync=1111111111111111 tokenizer=byte": {"a": 20},
                    "model/algo/sync=2222222222222222 tokenizer=byte": {"b": 20}}


def test_a_finished_file_of_the_old_format_or_a_request_without_a_run_is_no_ones_finish(tmp_path: Path) -> None:
    d = tmp_path / "fed"
    _enrol(d, "model/algo/sync=1111111111111111 tokenizer=byte")
    (d / (enrol.ROSTER + ".finished.json")).write_text(json.dumps({"a": 20}))  # {name: steps}: which run?
    g = _serve(d)
    try:
        assert finished_peers(g.address, "b", KEY, _creds(d, "b")) == {}
        assert gate.call(g.address, {"kind": "hello", "name": "b"}, KEY, 5.0, _creds(d, "b"))["finished"] == {}
    finally:
        g.shutdown()


def test_the_finished_file_keeps_the_newest_runs_only(tmp_path: Path) -> None:
    d = tmp_path / "fed"
    _enrol(d, "model/algo/sync=1111111111111111 tokenizer=byte")
    g = _serve(d)
    try:
        for i in range(gate.MAX_RUNS + 3):
            body = {"kind": "finished", "name": "a", "steps": i, "fp": f"run-{i}"}
            assert gate.call(g.address, body, KEY, 5.0, _creds(d, "a"))["kind"] == "ok"
    finally:
        g.shutdown()
    runs = json.loads((d / (enrol.ROSTER + ".finished.json")).read_text())["runs"]
    assert list(runs) == [f"run-{i}" for i in range(3, gate.MAX_RUNS + 3)]
