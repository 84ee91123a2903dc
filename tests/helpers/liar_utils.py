"""A federation with a liar in it, in one process: toy clusters (`toy_federation`) whose quorums come from a
real gate with a roster (torchft's Lighthouse behind `federation.gate`, signed requests) or from the in-process
hub, lanes over the hub's threads; and the liars: a cluster that holds its own identity and the federation key
and lies in what it claims, in whose name it speaks, or in the heal payloads it sends."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from edit_train.cluster.group import RankGroup
from edit_train.federation import enrol, heal
from edit_train.federation.inproc import InProcessFederation, ThreadGroup
from edit_train.federation.lanes import Lanes
from edit_train.federation.quorum import Lighthouse, QuorumClient
from edit_train.federation.signed import Credentials, load_credentials
from edit_train.federation.transport import LaneTransport
from edit_train.local_sgd.sync.algorithms import LocalSGDConfig
from edit_train.local_sgd.sync.membership import MembershipConfig
from edit_train.local_sgd.protocols import Quorum
from toy_federation import H, Outcome, batch, config, toy_model, train_cluster

FP = "toy-federation"
SYNCS = 4
TOTAL = SYNCS * H
KEY = bytes(range(32))


def toy_config(expected: tuple[str, ...], rule: str = "edit_norm") -> LocalSGDConfig:
    """EDiT at_end over SYNCS intervals; the terms come from the roster (what the gate runs hold)."""
    cfg = config("at_end", rule, syncs=SYNCS)
    return replace(cfg, membership=MembershipConfig(fingerprint=FP, expected=expected, quorum_timeout_s=20,
                                                    authoritative=True, terms_source="the roster"))


def final_loss(out: Outcome, index: int) -> float:
    """The loss of a cluster's final model on held-out batches of the honest clusters' tasks."""
    model = toy_model()
    with torch.no_grad():
        for p, v in zip(model.parameters(), out.params):
            p.copy_(v)
        return sum(float(nn.functional.mse_loss(model(x), y)) for x, y in (batch(i, 9_999) for i in (0, 1))) / 2


@dataclass
class GateRun:
    """A gate with a roster of `names` (the first `honest` of them train), its key and every identity."""

    root: Path
    names: list[str]
    honest: int = 2
    join_timeout_s: float = 2.0
    gate: Lighthouse | None = None
    creds: dict[str, Credentials] = field(default_factory=dict)
    roster: Path | None = None
    speeds: dict[str, float] | None = None  # the roster's declared speeds (None: none declared)

    def start(self) -> GateRun:
        if self.roster is None:
            self.roster = enrol.make(self.root, self.names, (FP, TOTAL, "edit"), self.speeds)
            self.creds = {n: load_credentials(str(enrol.identity_path(self.root, n)), str(self.roster), n)
                          for n in self.names}
        gate_creds = load_credentials(str(self.root / enrol.GATE), str(self.roster), "gate", role="gate")
        bind = f"127.0.0.1:{self.gate.address.rpartition(':')[2]}" if self.gate is not None else "127.0.0.1:0"
        self.gate = Lighthouse(bind, KEY, 1, self.join_timeout_s, 5.0, gate_creds, str(self.roster))
        return self

    @property
    def address(self) -> str:
        assert self.gate is not None
        return self.gate.address

    def restart(self) -> None:
        """The gate process dies and a new one starts where it was (same port, same roster)."""
        assert self.gate is not None
        self.gate.shutdown()
        self.start()

    def client(self, name: str, as_: str | None = None) -> QuorumClient:
        """`name`'s link to the gate, signed with the identity of `as_` (default: its own)."""
        return QuorumClient(self.address, name, KEY, heartbeat_interval_s=0.2, refuse_after_s=3600,
                            credentials=self.creds[as_ or name])

    def train(self, hub: InProcessFederation | None = None) -> dict[str, Outcome]:
        """The honest clusters train the toy model to the end, each a thread, over this gate."""
        hub = hub or InProcessFederation(timeout_s=30.0)
        honest = self.names[:self.honest]
        cfg = toy_config(tuple(honest))
        transports = {n: LaneTransport(n, RankGroup(), Lanes(lambda n=n: ThreadGroup(hub, n)), True, self.client(n),
                                       f"inproc:{n}", key=KEY, quorum_timeout_s=30.0, connect_timeout_s=10.0)
                      for n in honest}
        return run_threads({n: (lambda i=i, n=n: train_cluster(i, transports[n], cfg)) for i, n in enumerate(honest)})

    def close(self) -> None:
        if self.gate is not None:
            self.gate.shutdown()


def run_threads(jobs: dict[str, Callable[[], Outcome]], timeout: float = 120.0) -> dict[str, Outcome]:
    results: dict[str, Outcome] = {}
    errors: list[BaseException] = []

    def one(name: str) -> None:
        try:
            results[name] = jobs[name]()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(n,), daemon=True) for n in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    assert all(not t.is_alive() for t in threads), "a cluster thread hung"
    return results


class Liar:
    """A thread that keeps doing `act()` until stopped (its failures are what a refused liar sees)."""

    def __init__(self, act: Callable[[], Any]) -> None:
        self.act, self.stop, self.tries, self.answered = act, threading.Event(), 0, 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.tries += 1
            try:
                if self.act() is not None:
                    self.answered += 1
            except Exception:  # noqa: BLE001 - refused, as it should be
                time.sleep(0.05)

    def __enter__(self) -> Liar:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


def claims(sync: int = 0, **data: Any) -> tuple[int, dict[str, Any]]:
    """What a cluster's quorum request says, honest unless told otherwise."""
    return sync, {"local_steps": H, "incarnation": secrets.token_hex(4), "fp": FP, "total_steps": H, "anchor": "",
                  **data}


class LyingTransport:
    """A participating cluster's transport that lies: its quorum requests claim `sync` (a function of the true
    one) and a made-up anchor digest (or, not `fake_digest`, its true one), it vets nothing, and the heal payloads it sends carry a finite but wrong
    anchor (`scale` times the true one)."""

    def __init__(self, inner: LaneTransport, sync: Callable[[int], int], scale: float = 1e30,
                 fake_digest: bool = True) -> None:
        self.inner, self.sync, self.scale, self.fake_digest = inner, sync, scale, fake_digest
        self.sent = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def form_start(self, sync: int, data: dict[str, Any], vet: Callable[[Quorum], Quorum] | None = None) -> None:
        self.inner.form_start(self.sync(sync), {**data, "anchor": "f" * 32} if self.fake_digest else data)

    def send_bytes(self, payload: bytes, dst: int) -> None:
        meta, tensors = heal.decode(payload)
        wrong = {k: v * self.scale if "/anchor/" in k else v for k, v in tensors.items()}
        self.sent += 1
        self.inner.send_bytes(heal.encode({k: v for k, v in meta.items() if k not in ("kind", "version")}, wrong), dst)

