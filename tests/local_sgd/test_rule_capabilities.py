"""The rule's optional capabilities are members of the aggregation seam (`Capabilities`, `capabilities_of`):
`LocalSGD`, the trainer and the config ask the rule, so a rule outside the package (tests/helpers/probing_rule.py) turns
the usefulness probe and its retraction on with no change inside edit_train/."""

from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from edit_train.cluster.group import RankGroup
from edit_train.config import Config
from edit_train.federation.inproc import InProcessFederation
from edit_train.local_sgd.aggregator import Capabilities, capabilities_of
from edit_train.local_sgd.aggregation.rules import RuleConfig, make_rule
from edit_train.train import trainer as trainer_module
from toy_federation import LR, Outcome, config, train_cluster

NAMES = ["c0", "c1", "c2"]  # c2 hurts the others' probe slices


def _run(retract: bool) -> dict[str, Outcome]:
    cfg = config("at_end", "probing_rule:ProbingMean", syncs=2, phi=1e9, lr=1.0, momentum=0.0, nesterov=False)
    penalty = dataclasses.replace(cfg.rule, options={"probe_tokens": 8, "retract": retract}, scale_bound=0.0)
    cfg = dataclasses.replace(cfg, rule=penalty)
    hub = InProcessFederation(min_clusters=1, join_timeout_s=30.0, timeout_s=30.0)
    outs = {n: Outcome() for n in NAMES}
    threads = [threading.Thread(target=train_cluster, args=(i, hub.transport(n, RankGroup()), cfg),
                                kwargs={"out": outs[n], "probe": True, "lr": (LR, LR, 1.0)[i]}, daemon=True)
               for i, n in enumerate(NAMES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outs


@pytest.mark.parametrize("retract", [True, False])
def test_a_rule_outside_the_package_turns_the_retraction_on(retract: bool) -> None:
    """Sync 1 admits c2's harmful update; at sync 2 the others' probes show it, and the rule's `retract`
    capability decides whether it is taken back."""
    outs = _run(retract)
    for out in outs.values():
        syncs = [e for e in out.events if e["event"] == "sync"]
        assert [s["sync"] for s in syncs] == [1, 2] and syncs[0]["retracted"] == {}
        assert syncs[1]["retracted"].keys() == ({"c2"} if retract else set())
        assert out.algo is not None and (out.algo.driver.core.retract is not None) == retract  # type: ignore[union-attr]


def test_the_trainer_asks_the_rule_for_its_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer builds the probe batch of as many tokens as the rule asks for, and none for a rule that asks
    for none (`uniform`) or when nothing syncs."""
    asked: list[int] = []
    monkeypatch.setattr(trainer_module, "probe_batch", lambda _d, _s, tokens, _i: asked.append(tokens) or "batch")
    cfg = Config()
    cfg.algo.local_sgd, cfg.algo.rule.name, cfg.algo.rule.options = True, "probing_rule:ProbingMean", \
        {"probe_tokens": 24}
    fake: Any = SimpleNamespace(cfg=cfg, topo=SimpleNamespace(index=0), val_dirs=[], model=None)
    assert callable(trainer_module.Trainer._usefulness_probe(fake)) and asked == [24]
    cfg.algo.rule.name = "uniform"
    assert trainer_module.Trainer._usefulness_probe(fake) is None
    cfg.algo.rule.name, cfg.algo.local_sgd = "probing_rule:ProbingMean", False
    assert trainer_module.Trainer._usefulness_probe(fake) is None and asked == [24]


def test_a_rule_without_capabilities_asks_nothing() -> None:
    """The defaults: no probe, no retraction, every expert row sent; a `sketch_dim` attribute still counts; the
    default rule asks for what its config says."""
    assert capabilities_of(make_rule(RuleConfig(name="uniform"))) == Capabilities()
    assert capabilities_of(make_rule(RuleConfig(name="custom_rule:FirstClusterOnly"))).probe_tokens == 0

    class Sketching:
        sketch_dim = 64

        def decide(self, ev: Any) -> Any: ...

        def state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
            return {}, {}

        def load(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None: ...

    assert capabilities_of(Sketching()) == Capabilities(sketch_dim=64)
    pen = RuleConfig()
    pen.verified.probe_tokens, pen.verified.retract, pen.verified.expert_weights = 16, False, "tokens"
    caps = capabilities_of(make_rule(pen))
    assert (caps.probe_tokens, caps.retract, caps.weighs_experts, caps.sketch_dim) == \
        (16, False, True, pen.verified.sketch_dim)
    assert caps.refuse(6, 4, "none") is not None and caps.refuse(3, 4, "none") is None
