"""Per-cluster identities and the operator's roster (issue 37): the files (each problem one line at start), the
signatures (a roster only from the pinned operator, a record only under its own name), adding a cluster mid-run
as the operator's signed act, what the local launcher makes per run, and checkpoints that refuse NaN or a
wrong dtype with one line (and load for forensics with EDIT_TRAIN_CHECKPOINT_UNCHECKED=1)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from edit_train.federation import enrol, gate
from edit_train.federation.identity import IdentityError, load_identity, new_identity
from edit_train.federation.roster import Roster, load_roster, save_roster
from edit_train.federation.signed import load_credentials

KEY = bytes(range(32))
TERMS = ("fp", 100, "edit")


@pytest.fixture
def fed(tmp_path: Path) -> Path:
    enrol.make(tmp_path / "fed", ["c0", "c1"], TERMS)
    return tmp_path / "fed"


def test_the_files_have_the_modes_they_need(fed: Path) -> None:
    for name in ("operator.key", "gate.identity", "c0.identity", "c1.identity"):
        assert (fed / name).stat().st_mode & 0o777 == 0o600, name
    assert (fed / "roster.json").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize(("broken", "needle"), [
    ("missing", "federation.identity_file: cannot read"),
    ("open", "is open to others (mode 0o640); run `chmod 600"),
    ("garbage", "is not an edit-train identity file"),
    ("roster missing", "federation.roster_file: cannot read"),
    ("roster writable", "is writable by others (mode 0o666)"),
    ("roster tampered", "the operator's signature does not verify"),
    ("roster of another operator", "signed for another operator"),
    ("another cluster's identity", "is cluster 'c1''s identity, this is cluster 'c0'"),
    ("not on the roster", "cluster 'c0' is not on the roster"),
    ("only the roster", "federation.identity_file is not set (the other one is)"),
])
def test_every_problem_with_the_files_is_one_line(fed: Path, tmp_path: Path, broken: str, needle: str) -> None:
    ident, roster = fed / "c0.identity", fed / "roster.json"
    if broken == "missing":
        ident = tmp_path / "nope.identity"
    elif broken == "open":
        os.chmod(ident, 0o640)
    elif broken == "garbage":
        ident.write_text("{}")
    elif broken == "roster missing":
        roster = tmp_path / "nope.json"
    elif broken == "roster writable":
        os.chmod(roster, 0o666)
    elif broken == "roster tampered":
        doc = json.loads(roster.read_text())
        doc["body"]["federation"]["total_steps"] = 2**53 - 1
        roster.write_text(json.dumps(doc))
    elif broken == "roster of another operator":
        other = new_identity(tmp_path / "op2.key", "operator", "operator")
        save_roster(roster, Roster.make(other, {"c0": load_identity(ident).public}, None, *TERMS))
    elif broken == "another cluster's identity":
        ident = fed / "c1.identity"
    elif broken == "not on the roster":
        operator = load_identity(fed / "operator.key")
        save_roster(roster, Roster.make(operator, {"c1": load_identity(fed / "c1.identity").public}, None, *TERMS))
    with pytest.raises(IdentityError) as err:
        load_credentials("" if broken == "only the roster" else str(ident), str(roster), "c0")
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_cluster_started_with_a_missing_identity_stops_at_start_with_one_line(
        fed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """The multi-host launcher's check before any rank starts (`key_check`): exit 2, one line, no traceback."""
    from edit_train.cli import key_check

    monkeypatch.setenv("EDIT_TRAIN_CLUSTER", "c0")
    monkeypatch.delenv("EDIT_TRAIN_IDENTITY_FILE", raising=False)
    with pytest.raises(SystemExit) as code:
        key_check.main(["federation.lighthouse=127.0.0.1:9", f"federation.roster_file={fed / 'roster.json'}",
                        f"federation.identity_file={tmp_path / 'gone.identity'}"])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert code.value.code == 2 and len(lines) == 1, err
    assert "gone.identity" in lines[0] and "cannot read" in lines[0], err


def test_a_roster_says_what_the_federation_runs(fed: Path) -> None:
    """A cluster whose configuration is not the roster's stops at start with one line."""
    from edit_train.cli.common import compose
    from edit_train.config import ConfigError
    from edit_train.train.build import credentials

    cfg = compose(["cluster=local", "cluster.count=2", f"federation.roster_file={fed / 'roster.json'}",
                   f"federation.identity_file={fed / 'c0.identity'}"])
    with pytest.raises(ConfigError, match="the roster .* says the federation runs configuration fingerprint 'fp'"):
        credentials(cfg, "c0")


def _serve(fed: Path) -> gate.Gate:
    creds = load_credentials(str(fed / "gate.identity"), str(fed / "roster.json"), "gate", role="gate")
    return gate.Gate("127.0.0.1:0", KEY, 1, 0.5, 5.0, creds, str(fed / "roster.json"))


def test_a_cluster_added_mid_run_is_the_operators_signed_act(fed: Path) -> None:
    """c2 is a stranger until `edit-train-keygen add` signs roster version 2: the gate rereads its file and
    answers c0 with the new version, which c0 adopts (the operator it trusts signed it); `remove` takes it out."""
    g = _serve(fed)
    try:
        c0 = load_credentials(str(fed / "c0.identity"), str(fed / "roster.json"), "c0")
        hello = {"kind": "hello", "name": "c2"}
        stranger = load_credentials(str(fed / "c1.identity"), str(fed / "roster.json"), "c1")
        with pytest.raises(gate.IdentityRefused):  # not on the roster, whoever signs
            gate.call(g.address, hello, KEY, 5, stranger)
        enrol.add(fed, "c2")
        time.sleep(0.01)
        c2 = load_credentials(str(fed / "c2.identity"), str(fed / "roster.json"), "c2")
        assert gate.call(g.address, hello, KEY, 5, c2)["kind"] == "ok"
        assert c0.roster.version == 1
        gate.call(g.address, {"kind": "hello", "name": "c0"}, KEY, 5, c0)
        assert c0.roster.version == 2 and c0.roster.key("c2") == c2.identity.public
        enrol.remove(fed, "c2")  # ... and removing it is one too: refused from the next request on
        time.sleep(0.01)
        with pytest.raises(gate.IdentityRefused):
            gate.call(g.address, hello, KEY, 5, c2)
    finally:
        g.shutdown()


def test_a_roster_from_anyone_but_the_operator_is_not_adopted(fed: Path, tmp_path: Path) -> None:
    c0 = load_credentials(str(fed / "c0.identity"), str(fed / "roster.json"), "c0")
    other = new_identity(tmp_path / "op2.key", "operator", "operator")
    forged = Roster.make(other, {"evil": other.public}, None, *TERMS, version=99)
    assert not c0.adopt(forged.doc) and c0.roster.version == 1


def test_the_gate_keeps_its_roster_when_the_file_turns_bad(fed: Path, caplog: pytest.LogCaptureFixture) -> None:
    g = _serve(fed)
    try:
        (fed / "roster.json").write_text("{}")
        creds = g.credentials
        assert creds is not None and g.who({"name": "x"}) is not None  # rereads, refuses the file, keeps v1
        assert creds.roster.version == 1 and "cannot be used" in caplog.text
    finally:
        g.shutdown()


def test_the_local_launcher_makes_a_roster_per_run_and_restates_it(tmp_path: Path) -> None:
    from edit_train.cli.common import compose
    from edit_train.cli.launcher import local_roster

    cfg = compose(["cluster=local", "cluster.count=2", "train.steps=40", f"run.dir={tmp_path}"])
    roster = Path(local_roster(cfg, tmp_path))
    assert roster == tmp_path / "federation" / "roster.json"
    r1 = load_roster(roster, load_identity(tmp_path / "federation" / "operator.key").public)
    assert sorted(r1.clusters) == ["c0", "c1"] and r1.total_steps == 40
    cfg.train.steps, cfg.cluster.only = 60, "c7"  # a resume with more steps; a cluster joining from outside
    local_roster(cfg, tmp_path)
    r2 = load_roster(roster, r1.operator)
    assert r2.version == 2 and r2.total_steps == 60 and sorted(r2.clusters) == ["c0", "c1", "c7"]
    assert r2.clusters["c0"] == r1.clusters["c0"]  # identities are kept
    cfg.federation.lighthouse = "10.0.0.5:29510"  # joining a Lighthouse this run did not start: no roster made
    assert local_roster(cfg, tmp_path / "other") == ""
    assert local_roster(cfg, tmp_path) == str(roster)  # ... unless its own run made one (a late cluster, locally)
    cfg.federation.insecure = True
    assert local_roster(cfg, tmp_path / "other") == ""


# ------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize(("part", "tensor", "needle"), [
    ("model", torch.tensor([1.0, float("nan")]), "holds 1 non-finite value(s)"),
    ("outer", torch.tensor([float("inf")]), "non-finite"),
    ("model", torch.zeros(2, dtype=torch.int8), "is torch.int8, where this part holds floating-point values"),
    ("optim", torch.zeros(2, dtype=torch.bool), "torch.bool"),
    ("rng", torch.zeros(2, dtype=torch.float32), "where this part holds torch.uint8"),
])
def test_a_checkpoint_with_nan_or_a_wrong_dtype_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture, part: str,
                                                           tensor: torch.Tensor, needle: str) -> None:
    from edit_train.train.checkpoint import UNCHECKED_ENV, CheckpointError, CheckpointManager

    ckpt = CheckpointManager(tmp_path)
    path = ckpt.save(3, {part: {"w": tensor}}, {"step": 3})
    monkeypatch.delenv(UNCHECKED_ENV, raising=False)
    with pytest.raises(CheckpointError) as err:
        ckpt.load(path)
    assert needle in str(err.value) and f"rank0-{part}.safetensors" in str(err.value) and UNCHECKED_ENV in str(err.value)
    assert "\n" not in str(err.value)
    monkeypatch.setenv(UNCHECKED_ENV, "1")  # forensics: loaded, with a warning
    tensors, _ = ckpt.load(path)
    assert torch.equal(tensors[part]["w"].isnan(), tensor.isnan()) and "loaded anyway" in caplog.text


def test_a_models_count_buffers_load_and_other_integer_buffers_do_not(tmp_path: Path) -> None:
    """A MoE block's routed-token tally is an int64 buffer of the model part: it loads; an int8 buffer does not."""
    from edit_train.train.checkpoint import CheckpointError, CheckpointManager

    ckpt = CheckpointManager(tmp_path)
    counts = torch.arange(4, dtype=torch.int64)
    path = ckpt.save(3, {"model": {"buffer/layers.1.mlp.routed_tokens": counts, "w": torch.ones(2)}}, {"step": 3})
    assert torch.equal(ckpt.load(path)[0]["model"]["buffer/layers.1.mlp.routed_tokens"], counts)
    path = ckpt.save(4, {"model": {"buffer/b": torch.zeros(2, dtype=torch.int8)}}, {"step": 4})
    with pytest.raises(CheckpointError, match="'buffer/b' is torch.int8"):
        ckpt.load(path)


def test_a_checkpoint_of_another_float_dtype_is_refused_for_the_model() -> None:
    from edit_train.train.checkpoint import CheckpointError
    from edit_train.train.state import load_model_tensors

    model = torch.nn.Linear(2, 2)
    half = {f"param/{n}": p.detach().to(torch.float16) for n, p in model.named_parameters()}
    with pytest.raises(CheckpointError, match="checkpoint dtype torch.float16 != the model's torch.float32"):
        load_model_tensors(model, half)


def test_a_gate_without_the_roster_is_one_line_for_a_cluster_with_it(fed: Path) -> None:
    """The operator gave the clusters a roster but started the gate without it: its answers carry no gate
    signature, and the cluster stops (after the bounded wait for refusals) with one line saying what to fix."""
    from edit_train.federation.quorum import check_key
    from edit_train.local_sgd.errors import FederationRefused

    g = gate.Gate("127.0.0.1:0", KEY, 1, 0.5, 5.0)
    try:
        c0 = load_credentials(str(fed / "c0.identity"), str(fed / "roster.json"), "c0")
        with pytest.raises(FederationRefused) as err:
            check_key(g.address, "c0", KEY, "federation.key_file=k", refuse_after_s=1.5, credentials=c0)
        assert "answered without the signature of the gate this cluster's roster names" in str(err.value)
        assert "\n" not in str(err.value)
    finally:
        g.shutdown()
