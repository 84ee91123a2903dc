"""Everything a peer or a file can send is parsed totally, with a size cap before allocation.

Property-based (hypothesis) fuzzing of each parser — checkpoint manifests (and per-rank state JSON), heal
payloads, the gate's frames and member records, cluster names and host addresses: the only outcomes are
the parser's own one-line error or a valid result; no file outside the checkpoint directory is opened; no
allocation beyond the cap; no hang. Then one plain test per finding of the security issue, with its exact
input. Budgets are small (two shared cores): the whole file runs in a few seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import struct
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from edit_train import safejson
from edit_train.config import ClusterConfig, Config, ConfigError, FederationConfig, validate
from edit_train.federation import auth, gate
from edit_train.federation.heal import MAX_HEADER, HealError, decode, encode
from edit_train.train import checkpoint as ckpt_mod
from edit_train.train.checkpoint import MANIFEST, CheckpointError, CheckpointManager

FUZZ = settings(max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

# ------------------------------------------------------------------------------- what was opened
_opened: list[str] | None = None


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _opened is not None and event == "open" and isinstance(args[0], (str, bytes)):
        path = os.path.realpath(os.fsdecode(args[0]))
        if not path.endswith(".py"):  # Python source read for a traceback or warning (linecache) is not a data read
            _opened.append(path)


sys.addaudithook(_audit)  # cannot be removed; records nothing outside `opened()`


@contextlib.contextmanager
def opened() -> Iterator[list[str]]:
    """Every path Python opens (open(), os.open(), ...) in the block, symlinks resolved."""
    global _opened
    _opened = seen = []
    try:
        yield seen
    finally:
        _opened = None


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert text and len(text.splitlines()) == 1, f"not one line: {text!r}"
    return text


# ------------------------------------------------------------------------------- JSON-ish values
scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(st.text(max_size=10), kids, max_size=4), max_leaves=20)


def nested(depth: int, kinds: str = "[{") -> str:
    """`depth` levels of arrays / objects (alternating over `kinds`) around a 0."""
    opens = "".join('{"k":' if kinds[i % len(kinds)] == "{" else "[" for i in range(depth))
    closes = "".join("}" if kinds[i % len(kinds)] == "{" else "]" for i in reversed(range(depth)))
    return opens + "0" + closes


def test_safejson_depth_matches_the_parser() -> None:
    for text in ['0', '[]', '[[1],{"a":[2]}]', '"[[[["', '{"a":"\\"[{"}', nested(70), nested(5, "{")]:
        parsed = json.loads(text)

        def d(v: Any) -> int:
            kids = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
            return 0 if kids is None else 1 + max((d(k) for k in kids), default=0)

        assert safejson.depth(text.encode()) == d(parsed), text


# ------------------------------------------------------------------------------- (a) manifests
def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def ckpt_world(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A run dir with one real checkpoint, a canary file outside the checkpoint root (and one outside the
    run dir), and a symlink in the checkpoint directory pointing at the canary."""
    base = tmp_path_factory.mktemp("manifests")
    run = base / "run"
    root = run / "checkpoints"
    mgr = CheckpointManager(root, keep=5)
    good = mgr.save(1, {"model": {"w": torch.arange(6.0)}}, {"step": 1})
    step = mgr.save(2, {"model": {"w": torch.arange(6.0)}}, {"step": 2})
    canary = base / "canary.safetensors"  # outside the run dir
    canary.write_bytes(good.joinpath("rank0-model.safetensors").read_bytes())
    (step / "link.safetensors").symlink_to(canary)
    return SimpleNamespace(mgr=mgr, root=root, good=good, step=step, canary=canary,
                           manifest=json.loads((step / MANIFEST).read_text()), canary_entry={
                               "bytes": canary.stat().st_size, "sha256": sha(canary.read_bytes())})


def traversal_names(w: SimpleNamespace) -> list[str]:
    rel = os.path.relpath(w.canary, w.step)
    return [rel, "../../../../etc/hostname", str(w.canary), "/etc/hostname", "link.safetensors", "..", ".",
            "./" + rel, "sub/../" + rel, rel.replace("/", "\\"), "a\x00b", "", "rank0-model.safetensors",
            MANIFEST, "x\n", "\u2028"]


def manifests(w: SimpleNamespace) -> st.SearchStrategy[Any]:
    """Manifests near the real one (the writer's schema; traversal names, the canary's true size and
    digest, perturbed entries), and arbitrary JSON values."""
    names = st.sampled_from(traversal_names(w) + sorted(w.manifest["files"])) | st.text(max_size=12)
    entries = (st.sampled_from([w.canary_entry, *w.manifest["files"].values()])
               | st.fixed_dictionaries({"bytes": st.integers(-2, 1 << 70) | json_values,
                                        "sha256": st.text(max_size=70) | json_values}) | json_values)
    plain = st.dictionaries(st.sampled_from([*sorted(w.manifest["files"]), "link.safetensors", "gone.bin"]),
                            st.sampled_from([w.canary_entry, *w.manifest["files"].values()]), max_size=3)
    near = st.fixed_dictionaries({"step": st.just(2), "world_size": st.just(1),
                                  "files": plain | st.dictionaries(names, entries, max_size=4)})
    loose = st.fixed_dictionaries({"step": st.integers(-1, 3) | json_values, "world_size": st.integers(-1, 2)
                                   | json_values, "files": st.dictionaries(names, entries, max_size=3) | json_values})
    return st.integers(0, 9).flatmap(lambda i: near if i < 6 else loose if i < 8 else json_values)


def write_manifest(w: SimpleNamespace, data: bytes) -> None:
    (w.step / MANIFEST).write_bytes(data)


def check_manifest_outcome(w: SimpleNamespace, doc: Any) -> None:
    """verify / latest_valid / load: only CheckpointError (one line), and nothing outside the step dir read."""
    with opened() as seen:
        try:
            w.mgr.verify(w.step)
            verified = True
        except CheckpointError as exc:
            one_line(exc)
            verified = False
        latest = w.mgr.latest_valid()
        try:
            w.mgr.load(w.step)
        except CheckpointError as exc:
            one_line(exc)
    assert latest in (w.step, w.good)
    assert str(w.canary.resolve()) not in seen and "/etc/hostname" not in seen
    step = str(w.step.resolve())
    assert all(p.startswith(step + os.sep) for p in seen if not p.startswith(str(w.good.resolve()))), seen
    if verified:  # the verified set of paths stays inside the checkpoint directory
        assert isinstance(doc, dict) and latest == w.step
        for name in doc["files"]:
            assert "/" not in name and name not in ("..", ".")
            assert (w.step / name).resolve().parent == w.step.resolve()


@FUZZ
@given(data=st.data())
def test_fuzz_manifest_values(ckpt_world: SimpleNamespace, data: st.DataObject) -> None:
    doc = data.draw(manifests(ckpt_world))
    write_manifest(ckpt_world, json.dumps(doc).encode())
    check_manifest_outcome(ckpt_world, doc)


@FUZZ
@given(raw=st.binary(max_size=512) | st.builds(lambda d, k: nested(d, k).encode(), st.integers(0, 5000),
                                               st.sampled_from(["[", "{", "[{"])))
def test_fuzz_manifest_bytes(ckpt_world: SimpleNamespace, raw: bytes) -> None:
    write_manifest(ckpt_world, raw)
    check_manifest_outcome(ckpt_world, None)


@FEW
@given(doc=json_values, deep=st.integers(0, 3000))
def test_fuzz_state_json(ckpt_world: SimpleNamespace, doc: Any, deep: int) -> None:
    """The per-rank state JSON is read like the manifest: an object, capped, bounded depth."""
    w = ckpt_world
    write_manifest(w, json.dumps(w.manifest).encode())
    state = w.step / "rank0-state.json"
    before = state.read_bytes()
    expected = doc if deep < 1500 else None
    try:
        state.write_text(json.dumps(doc) if deep < 1500 else nested(deep))
        try:
            _, got = w.mgr.load(w.step)
            assert isinstance(expected, dict) and json.dumps(got) == json.dumps(expected)
        except CheckpointError as exc:
            assert "rank0-state.json" in one_line(exc)
    finally:
        state.write_bytes(before)


def test_symlink_to_outside_is_refused(ckpt_world: SimpleNamespace) -> None:
    """`link.safetensors` is a plain name, but a symlink to the canary outside the run dir, with the
    canary's true size and digest in the manifest: refused without opening it."""
    w = ckpt_world
    doc = {**w.manifest, "files": {**w.manifest["files"], "link.safetensors": w.canary_entry}}
    write_manifest(w, json.dumps(doc).encode())
    with opened() as seen:
        with pytest.raises(CheckpointError, match="link.safetensors: resolves outside the checkpoint directory"):
            w.mgr.verify(w.step)
    assert str(w.canary.resolve()) not in seen
    write_manifest(w, json.dumps(w.manifest).encode())
    w.mgr.verify(w.step)


def test_manifest_size_cap_is_checked_before_reading(ckpt_world: SimpleNamespace, monkeypatch) -> None:
    monkeypatch.setattr(ckpt_mod, "MAX_MANIFEST_BYTES", 4096)
    write_manifest(ckpt_world, b" " * 1_000_000 + b"{}")
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="exceeds the 4096-byte cap"):
            ckpt_world.mgr.verify(ckpt_world.step)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak
    write_manifest(ckpt_world, json.dumps(ckpt_world.manifest).encode())
    ckpt_world.mgr.verify(ckpt_world.step)


def test_symlinked_checkpoint_dir_outside_the_root_is_skipped(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path / "run" / "checkpoints", keep=5)
    good = mgr.save(1, {"model": {"w": torch.zeros(2)}}, {"step": 1})
    outside = tmp_path / "elsewhere" / "step_00000009"
    outside.parent.mkdir()
    mgr.save(9, {"model": {"w": torch.ones(2)}}, {"step": 9})
    mgr.step_dir(9).rename(outside)
    mgr.step_dir(9).symlink_to(outside, target_is_directory=True)
    with opened() as seen:
        assert mgr.latest_valid() == good
        with pytest.raises(CheckpointError, match="outside the checkpoint root"):
            mgr.load(mgr.step_dir(9))
    assert not any(p.startswith(str(outside.resolve())) for p in seen), seen


# ------------------------------------------------------------------------------- (b) heal payloads
def framed(header: bytes, body: bytes = b"", n: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if n is None else n) + header + body


def check_heal(payload: bytes) -> None:
    try:
        meta, tensors = decode(payload, peer="cluster evil")
    except HealError as exc:
        assert "cluster evil" in one_line(exc)
        return
    assert isinstance(meta, dict) and meta["kind"] == "edit-train-heal" and meta["version"] == 1
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())


@FUZZ
@given(payload=st.binary(max_size=2048))
def test_fuzz_heal_bytes(payload: bytes) -> None:
    check_heal(payload)


GOOD_BODY = encode({}, {"a": torch.arange(4.0), "b": torch.ones(2, 2, dtype=torch.int64)})[8 + len(
    json.dumps({"kind": "edit-train-heal", "version": 1}).encode()):]
headers = (st.builds(lambda extra: {"kind": "edit-train-heal", "version": 1, **extra},
                     st.dictionaries(st.text(max_size=8), json_values, max_size=3))
           | st.fixed_dictionaries({"kind": st.text(max_size=20) | json_values, "version": json_values})
           | json_values)
bodies = (st.just(b"") | st.just(GOOD_BODY) | st.binary(max_size=256)
          | st.builds(lambda cut: GOOD_BODY[:cut], st.integers(0, len(GOOD_BODY)))
          | st.builds(lambda i, b: GOOD_BODY[:i] + bytes([b]) + GOOD_BODY[i + 1:],
                      st.integers(0, len(GOOD_BODY) - 1), st.integers(0, 255)))
lengths = st.none() | st.integers(0, (1 << 64) - 1) | st.sampled_from([1 << 33, MAX_HEADER + 1, 640, 0])


@FUZZ
@given(header=headers, body=bodies, n=lengths, deep=st.integers(0, 20_000))
def test_fuzz_heal_structured(header: Any, body: bytes, n: int | None, deep: int) -> None:
    head = json.dumps(header).encode() if deep < 10_000 else nested(deep).encode()
    payload = framed(head, body, n)
    tracemalloc.start()
    try:
        check_heal(payload)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * len(payload) + (1 << 20), (peak, len(payload))  # never sized by the length prefix


def test_heal_header_cap_and_depth() -> None:
    ok = json.dumps({"kind": "edit-train-heal", "version": 1, "pad": "x" * (MAX_HEADER - 100)}).encode()
    assert decode(framed(ok))[0]["pad"]
    big = json.dumps({"kind": "edit-train-heal", "version": 1, "pad": "x" * MAX_HEADER}).encode()
    with pytest.raises(HealError, match="exceeds"):
        decode(framed(big))
    deep = {"kind": "edit-train-heal", "version": 1, "rule": json.loads(nested(20))}
    assert decode(framed(json.dumps(deep).encode()))[0]["rule"]
    with pytest.raises(HealError, match="nested deeper"):
        decode(framed(nested(65).encode()))
    with pytest.raises(HealError, match="not an edit-train"):
        decode(framed(json.dumps({"kind": "edit-train-heal", "version": True}).encode()))


def test_heal_header_of_640_bytes_is_not_taken_for_a_pickle() -> None:
    """A length prefix 640 = 80 02 00 .. starts like pickle protocol 2: ours must still decode."""
    for size in (640, 896, 1152, 1408):
        meta = {"pad": ""}
        meta["pad"] = "x" * (size - len(json.dumps({"kind": "edit-train-heal", "version": 1, **meta})))
        payload = encode(meta, {"t": torch.arange(3.0)})
        assert payload[:2] in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")
        got, tensors = decode(payload)
        assert got["pad"] == meta["pad"] and torch.equal(tensors["t"], torch.arange(3.0))


# ------------------------------------------------------------------------------- (c) gate frames
KEY = b"k" * 32


@FUZZ
@given(raw=st.binary(max_size=1024) | st.builds(lambda v: json.dumps(v).encode(), json_values)
       | st.builds(lambda d: nested(d).encode(), st.integers(0, 5000)))
def test_fuzz_gate_unpack(raw: bytes) -> None:
    try:
        body = gate.unpack(raw, KEY, "gate/request")
    except gate.FrameError as exc:
        one_line(exc)
    else:
        assert isinstance(body, dict)


@FUZZ
@given(body=st.dictionaries(st.text(max_size=8), json_values, max_size=4), flip=st.integers(0, 200),
       key=st.sampled_from([KEY, b"other" * 8]), context=st.sampled_from(["gate/request", "gate/response"]))
def test_fuzz_gate_signed_frames(body: dict, flip: int, key: bytes, context: str) -> None:
    """A frame is accepted only with the key and context it was signed with, and only unaltered."""
    try:
        framed_ = gate.pack(body, KEY, "gate/request")[4:]
    except (gate.FrameError, ValueError):
        return  # a body the sender itself refuses (too big, NaN)
    raw = bytearray(framed_)
    altered = flip < len(raw)
    if altered:
        raw[flip] ^= 0x01
    try:
        got = gate.unpack(bytes(raw), key, context)
    except gate.FrameError as exc:
        one_line(exc)
        assert altered or key != KEY or context != "gate/request"
        return
    assert key == KEY and context == "gate/request" and not altered  # the signer's key and context, unaltered
    assert auth.canonical(got) == auth.canonical(body)


members = st.fixed_dictionaries({
    "name": st.text(max_size=70) | st.sampled_from(["c0", "a/../../x", "..", "ok-1.b_2"]),
    "sync": st.integers(-1, 1 << 54) | json_values, "size": st.integers(-1, (1 << 20) + 1) | json_values,
    "store": st.text(max_size=300) | json_values,
    "data": st.dictionaries(st.sampled_from(sorted(gate.DATA_KEYS)) | st.text(max_size=5),
                            st.integers(-1, 1 << 54) | st.text(max_size=130) | json_values, max_size=4) | json_values,
}) | json_values


@FUZZ
@given(d=members)
def test_fuzz_gate_check_member(d: Any) -> None:
    try:
        got = gate.check_member(d)
    except gate.FrameError as exc:
        one_line(exc)
        return
    assert gate.NAME_RE.match(got["name"]) and "/" not in got["name"]
    assert 0 <= got["sync"] < 1 << 53 and 1 <= got["size"] <= 1 << 20 and len(got["store"]) <= 256


# ------------------------------------------------------------------------------- (d) names and hosts
env_safe = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=70)
names = env_safe | st.sampled_from(["a/../../x", "..", "a..b", ".hidden", "c0", "x" * 64, "x" * 65, "a\n"]) \
    | st.from_regex(gate.NAME_RE, fullmatch=True)


def accepted(cfg: Config) -> bool:
    try:
        validate(cfg)
    except ConfigError as exc:
        one_line(exc)
        return False
    return True


@FUZZ
@given(name=names, where=st.sampled_from(["clusters", "only", "env"]))
def test_fuzz_cluster_names(name: str, where: str) -> None:
    cfg = Config()
    env = {}
    if where == "clusters":
        cfg.cluster = ClusterConfig(clusters=[{"name": name, "ranks": 1}])
    elif where == "only":
        cfg.cluster = ClusterConfig(only=name)
    else:
        env = {"EDIT_TRAIN_CLUSTER": name}
    assume(name)  # an empty cluster.only / EDIT_TRAIN_CLUSTER means "not set"
    with mock.patch.dict(os.environ, env):
        if accepted(cfg):
            assert "/" not in name and ".." not in name and "\\" not in name and name.strip() == name
            assert gate.NAME_RE.fullmatch(name)


looked_up: list[Any] = []


def fake_getaddrinfo(host: str, *args: Any, **kwargs: Any) -> list:
    """No network in the fuzzer: names ending in .example resolve, numeric addresses go to the real one."""
    looked_up.append(host)
    if host.endswith(".example"):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("192.0.2.1", 0))]
    if kwargs.get("flags", 0) & socket.AI_NUMERICHOST:
        return real_getaddrinfo(host, *args, **kwargs)
    raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")


real_getaddrinfo = socket.getaddrinfo
hosts = (env_safe | st.sampled_from(["300.1.1.1", "127.0.0.1", "::1", "[::1]", "localhost", "h.example", "1.2.3",
                                     "-a.example", "a..example", "fe80::1%lo", "0.0.0.0", "999999"])
         | st.from_regex(r"[a-z0-9.\-\[\]:]{1,30}", fullmatch=True))
ports = st.sampled_from(["", ":0", ":1", ":65535", ":65536", ":29510", ":x", "::", ":-1", ":+5"])


@FUZZ
@given(host=hosts, port=ports, scheme=st.sampled_from(["", "http://", "x y://"]),
       field=st.sampled_from(["host", "lighthouse"]))
def test_fuzz_hosts(host: str, port: str, scheme: str, field: str) -> None:
    value = host if field == "host" else scheme + host + port
    assume(value)  # an empty federation.lighthouse means "start one"
    cfg = Config(federation=FederationConfig(host=value) if field == "host" else FederationConfig(lighthouse=value))
    looked_up.clear()
    with mock.patch.object(socket, "getaddrinfo", fake_getaddrinfo):
        try:
            validate(cfg)
        except ConfigError as exc:
            assert f"federation.{field}" in one_line(exc)
        else:
            assert value and value.isprintable() and " " not in value
            if field == "lighthouse":
                assert 1 <= int(value.rpartition(":")[2]) <= 65535
    # only syntactically valid hosts are ever looked up
    assert all(isinstance(h, str) and h.isprintable() and " " not in h and "/" not in h for h in looked_up), looked_up


# ------------------------------------------------------------------------------- the findings
def test_finding_manifest_traversal_is_not_verified(tmp_path: Path) -> None:
    """`../../../../etc/hostname` in a manifest used to be read and 'verified OK'."""
    mgr = CheckpointManager(tmp_path / "run" / "checkpoints", keep=5)
    good = mgr.save(1, {"model": {"w": torch.zeros(2)}}, {"step": 1})
    bad = mgr.save(2, {"model": {"w": torch.zeros(2)}}, {"step": 2})
    canary = tmp_path / "canary"  # outside the run dir, with a matching size and digest in the manifest
    canary.write_bytes(b"secret\n")
    for name in ("../../../../etc/hostname", os.path.relpath(canary, bad)):
        target = (bad / name)
        info = ({"bytes": canary.stat().st_size, "sha256": sha(canary.read_bytes())} if "canary" in name else
                {"bytes": target.stat().st_size if target.is_file() else 0,
                 "sha256": sha(target.read_bytes()) if target.is_file() else "0" * 64})
        (bad / MANIFEST).write_text(json.dumps({"step": 2, "world_size": 1, "files": {name: info}}))
        with opened() as seen:
            with pytest.raises(CheckpointError) as exc:
                mgr.verify(bad)
            assert mgr.latest_valid() == good
        assert name in one_line(exc.value) and "not a plain file name" in str(exc.value)
        assert str(canary.resolve()) not in seen and "/etc/hostname" not in seen
        run = str((tmp_path / "run").resolve())
        assert all(p.startswith(run + os.sep) for p in seen), seen


@pytest.mark.parametrize(("doc", "why"), [
    ([{"rank0-state.json": {"bytes": 1, "sha256": "0" * 64}}], "a JSON list, not an object"),
    ({"step": 2, "world_size": 1, "files": {"rank0-state.json": {"sha256": "0" * 64}}},
     "not an object with bytes and sha256"),
])
def test_finding_manifest_list_or_without_bytes(tmp_path: Path, caplog, doc: Any, why: str) -> None:
    """A manifest that is a list / lacks `bytes` used to raise AttributeError / KeyError tracebacks."""
    mgr = CheckpointManager(tmp_path / "ckpt", keep=5)
    good = mgr.save(1, {"model": {"w": torch.zeros(2)}}, {"step": 1})
    bad = mgr.save(2, {"model": {"w": torch.zeros(2)}}, {"step": 2})
    (bad / MANIFEST).write_text(json.dumps(doc))
    for call in (mgr.verify, mgr.load):
        with pytest.raises(CheckpointError) as exc:
            call(bad)
        assert why in one_line(exc.value) and str(bad / MANIFEST) in str(exc.value)
    with caplog.at_level("WARNING", logger="edit_train.train.checkpoint"):
        assert mgr.latest_valid() == good  # skipped in one line, the older one is used
    assert any(why in r.getMessage() and "\n" not in r.getMessage() for r in caplog.records)


def _cli_one_line(monkeypatch, capsys, tmp_path: Path, *overrides: str, env: dict | None = None) -> str:
    from conftest import tiny_overrides

    from edit_train.cli.train import main

    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "argv", ["edit-train", *tiny_overrides(tmp_path / "run"), *overrides])
    with pytest.raises(SystemExit) as exc:
        main()
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith("error:"), err
    assert "Traceback" not in err[0] and not (tmp_path / "run").exists()
    return err[0]


def test_finding_cluster_name_with_a_path(monkeypatch, capsys, tmp_path: Path) -> None:
    """Cluster name `a/../../x` used to be accepted, and used in a checkpoint path."""
    line = _cli_one_line(monkeypatch, capsys, tmp_path, "cluster.only=a/../../x")
    assert "cluster.only: a/../../x is not a cluster name" in line
    line = _cli_one_line(monkeypatch, capsys, tmp_path, "+cluster.clusters=[{name: a/../../x, ranks: 1}]")
    assert "cluster.clusters[0].name" in line
    line = _cli_one_line(monkeypatch, capsys, tmp_path, env={"EDIT_TRAIN_CLUSTER": "a/../../x"})
    assert "EDIT_TRAIN_CLUSTER" in line
    assert not list(tmp_path.rglob("x"))


def test_finding_host_that_does_not_resolve(monkeypatch, capsys, tmp_path: Path) -> None:
    """`federation.host=300.1.1.1` used to pass validation, then fail with a socket.gaierror traceback."""
    line = _cli_one_line(monkeypatch, capsys, tmp_path, "federation.host=300.1.1.1")
    assert "federation.host: 300.1.1.1 does not resolve (" in line
    line = _cli_one_line(monkeypatch, capsys, tmp_path, "federation.lighthouse=300.1.1.1:29510")
    assert "federation.lighthouse: 300.1.1.1:29510 does not resolve (" in line
    with pytest.raises(ConfigError, match=r"^federation\.lighthouse: 127\.0\.0\.1:70000 is not a valid host:port"):
        validate(Config(federation=FederationConfig(lighthouse="127.0.0.1:70000")))
    for ok in ("127.0.0.1", "localhost", "::1", "0.0.0.0"):  # the common loopback case: no DNS wait
        validate(Config(federation=FederationConfig(host=ok, lighthouse="127.0.0.1:29510")))


def test_finding_heal_200k_deep_json() -> None:
    """A heal header 200k levels deep used to raise an uncaught RecursionError."""
    for head in (b"[" * 200_000 + b"]" * 200_000, nested(200_000).encode()):
        with pytest.raises(HealError) as exc:
            decode(framed(head), peer="cluster evil")
        assert "cluster evil" in one_line(exc.value) and "nested deeper" in str(exc.value)


def test_finding_heal_length_prefix_2_33() -> None:
    """A length prefix of 2**33 used to allocate 8 GiB before anything was checked."""
    tracemalloc.start()
    try:
        with pytest.raises(HealError) as exc:
            decode(struct.pack("<Q", 1 << 33) + b'{"kind": "edit-train-heal", "version": 1}', peer="cluster evil")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "cluster evil" in one_line(exc.value) and "exceeds" in str(exc.value)
    assert peak < 1 << 20, peak
