"""Expert subsets per site (issue 54, SPES-style; `algo.rule.verified.expert_subsets`): which experts a
cluster owns, the merge (an expert's update only from its owners), the rows it keeps frozen at the anchor, what
it saves, and that its assignment survives a resume or a heal (a pure function of the config and its index)."""

from __future__ import annotations

import pytest
import torch

from edit_train.config import ConfigError, validate
from edit_train.local_sgd.aggregator import capabilities_of
from edit_train.local_sgd.aggregation.rules import make_rule
from edit_train.local_sgd.moe.experts import Experts, RoutedCounts, UnitExperts, expert_weights, owned_counts, owned_experts


def _cfg(*overrides: str):
    from edit_train.cli.common import compose

    return compose(["logger=none", *overrides])


SUBSETS = ("algo=edit", "algo.rule.verified.expert_weights=tokens", "algo.rule.verified.expert_subsets=split")


def test_which_experts_a_cluster_owns() -> None:
    assert owned_experts("", 0, 2, 8) is None
    assert owned_experts("split", 0, 2, 8) == (True, False) * 4
    assert owned_experts("split", 2, 3, 4) == (False, False, True, False)
    assert owned_experts("0+1+2|2+3", 1, 2, 4) == (False, False, True, True)
    for spec, clusters, why in (("0+1|2", 2, r"expert\(s\) \[3\] belong to no cluster"),
                                ("0+1+2+3", 2, "names 1 clusters' experts, the federation has 2"),
                                ("0+1|2+3+9", 2, r"expert\(s\) \[9\] not in the model's 4"),
                                ("a|b", 2, "use split, routed, or each cluster's experts as 0\\+1\\|2\\+3")):
        with pytest.raises(ValueError, match=why) as err:
            owned_experts(spec, 0, clusters, 4)
        assert "\n" not in str(err.value)


def test_the_config_refuses_a_bad_map_in_one_line() -> None:
    validate(_cfg(*SUBSETS))
    for extra, why in ((["algo.rule.verified.expert_weights=none"], "expert_subsets: needs algo.rule.verified.expert_"
                                                                      "weights=tokens"),
                       (["algo.rule.verified.expert_subsets=0+1+2|3"], r"expert\(s\) \[4, 5, 6, 7\] belong to no"),
                       (["sync.compression=int8"], r"expert_subsets: needs sync.compression=none \(now int8")):
        with pytest.raises((ConfigError, ValueError), match=why) as err:  # the rule's own check: ValueError
            validate(_cfg(*SUBSETS, *extra))
        assert "\n" not in str(err.value)


def test_every_unmet_prerequisite_of_expert_subsets_is_in_one_line() -> None:
    """Issue 64: expert subsets revealed its prerequisites one error per launch (weights, then compression, ...)."""
    with pytest.raises(ConfigError) as err:
        validate(_cfg("algo=edit", "algo.rule.verified.expert_subsets=split", "sync.compression=int8",
                      "sync.gather_max=1", "experiment=noniid_lang_2"))
    line = str(err.value)
    assert "\n" not in line and line.startswith("algo.rule.verified.expert_subsets: needs "), line
    for need in ("algo.rule.verified.expert_weights=tokens (now none", "sync.compression=none (now int8",
                 "sync.gather_max >= 2 (now 1"):
        assert need in line, line
    with pytest.raises(ConfigError, match=r"the verified rule of algo=edit or algo=a_edit \(now algo=diloco"):
        validate(_cfg("algo=diloco", "algo.rule.verified.expert_weights=tokens",
                      "algo.rule.verified.expert_subsets=split", "experiment=noniid_lang_2"))


def _experts(min_tokens: int) -> tuple[Experts, list[torch.nn.Parameter]]:
    """One unit with 4 experts of 2 rows each in one stacked parameter [4, 2, 3], and a parameter no expert's."""
    params = [torch.nn.Parameter(torch.zeros(4, 2, 3)), torch.nn.Parameter(torch.zeros(5))]
    pieces = [[(0, slice(e, e + 1))] for e in range(4)]
    routed = RoutedCounts(take=lambda: torch.zeros(1, 4), pieces=lambda name, m, p: (0, pieces))
    return Experts(routed, [("layers.1", torch.nn.Module(), params)], min_tokens=min_tokens), params


def test_an_experts_update_comes_only_from_its_owners_in_closed_form() -> None:
    """Three clusters, four experts: c0 owns {0, 1}, c1 {1, 2}, c2 {3} ("0+1|1+2|3"). Each reports 0 tokens for the
    experts it does not own, so none sends them (min_tokens >= 1, what the rule sets under subsets); expert 0 and
    3 take their single owner's Δ alone (weight 1: the outer step then treats it as the merged pseudo-gradient),
    expert 1 its two owners' Δs weighed by their token backing; the rest of the unit by the module weights."""
    owned = [owned_experts("0+1|1+2|3", i, 3, 4) for i in range(3)]
    routed = torch.tensor([[30., 10., 50., 10.], [20., 60., 10., 10.], [25., 25., 25., 25.]])  # [P, E] true
    counts = torch.stack([owned_counts(routed[i:i + 1], owned[i])[0] for i in range(3)])
    assert counts.tolist() == [[30, 10, 0, 0], [0, 60, 10, 0], [0, 0, 0, 25]]
    ex, params = _experts(min_tokens=1)
    sent = ex.sent(counts)
    backing = torch.tensor([100.0, 100.0, 100.0])  # equal token claims, all accepted
    w = expert_weights(counts, sent, backing, torch.zeros(3))  # [E, P]
    s = counts / counts.sum(1, keepdim=True)  # each cluster's share of its own (reported) routed tokens
    assert w[0].tolist() == [1.0, 0.0, 0.0] and w[3].tolist() == [0.0, 0.0, 1.0] and w[2].tolist() == [0.0, 1.0, 0.0]
    a, b = float(s[0, 1]), float(s[1, 1])  # 10/40 and 60/70
    assert w[1].tolist() == pytest.approx([a / (a + b), b / (a + b), 0.0])
    # the merge the round makes from those weights (UnitExperts.accumulate), against Σᵢ wᵢₑ Δᵢₑ by hand
    ue = ex.units["layers.1"]
    deltas = [[torch.randn(4, 2, 3), torch.randn(5)] for _ in range(3)]
    module_w = [1 / 3] * 3
    total = [torch.zeros(4, 2, 3), torch.zeros(5)]
    for i in range(3):
        ue.accumulate(total, deltas[i], params, 0, 1, module_w[i], w[:, i].tolist())
    assert torch.allclose(total[0][0], deltas[0][0][0]) and torch.allclose(total[0][3], deltas[2][0][3])
    assert torch.allclose(total[0][2], deltas[1][0][2])
    assert torch.allclose(total[0][1], w[1, 0] * deltas[0][0][1] + w[1, 1] * deltas[1][0][1])
    assert torch.allclose(total[1], sum(d[1] for d in deltas) / 3)
    # what c0 sends: its own experts' rows only; what stays at home, exactly (2 experts x 2 rows x 3)
    assert ex.gathered("layers.1", sent, params, 0)[1] == 2 * 2 * 3 == ue.unsent(list(sent[0]), params)


def test_the_rule_sends_no_unowned_expert_under_subsets() -> None:
    plain, subsets = _cfg("algo=edit"), _cfg(*SUBSETS)
    caps = [capabilities_of(make_rule(c.algo.rule)) for c in (plain, subsets)]
    assert caps[0].expert_min_tokens == 0 and caps[0].expert_subsets == ""
    assert (caps[1].expert_min_tokens, caps[1].weighs_experts, caps[1].expert_subsets) == (1, True, "split")


def _tiny_model():
    from edit_train.model import CausalLM

    cfg = _cfg("model=tiny")
    torch.manual_seed(0)
    return cfg, CausalLM(cfg.model)


def test_unowned_experts_stay_at_the_anchor_through_steps_with_weight_decay() -> None:
    from edit_train.model.moe import MoEBlock
    from edit_train.train.expert_subsets import FrozenRows

    cfg, model = _tiny_model()
    owned = owned_experts("split", 1, 2, cfg.model.num_experts)  # cluster c1: the odd experts
    frozen = FrozenRows(model, owned)
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    before = [b.experts.gate_proj.detach().clone() for b in blocks]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x = torch.randint(0, 256, (2, 32))
    for _ in range(3):
        model(x, x).loss.backward()
        frozen.hold()
        assert all(float(b.experts.gate_proj.grad[0].abs().sum()) == 0.0 for b in blocks)  # no gradient
        opt.step()
        frozen.restore()
        opt.zero_grad()
    for b, old in zip(blocks, before):
        now = b.experts.gate_proj.detach()
        assert torch.equal(now[0::2], old[0::2])  # experts 0, 2, 4, 6: untouched, bit for bit
        assert not torch.equal(now[1::2], old[1::2])  # its own experts trained
    assert frozen.elements == 4 * 3 * 3 * cfg.model.hidden_size * cfg.model.moe_intermediate_size  # 4 experts x 3


def test_the_assignment_survives_a_resume_and_a_heal() -> None:
    """Nothing about the assignment is saved or healed: it is the configuration's (its fingerprint is checked
    across the federation) and the cluster's configured index — a restarted, resumed or healed cluster, or a
    fresh process, computes the same experts."""
    from edit_train.config import cluster_specs
    from edit_train.train.build import fingerprint
    from edit_train.train.expert_subsets import frozen_rows

    cfg = _cfg(*SUBSETS, "experiment=noniid_lang_4")
    specs = cluster_specs(cfg)
    _, model = _tiny_model()
    first = [frozen_rows(cfg, model, s.index, len(specs)).owned for s in specs]
    again = _cfg(*SUBSETS, "experiment=noniid_lang_4", "resume=auto")  # a restarted job's config
    _, fresh = _tiny_model()
    assert [frozen_rows(again, fresh, s.index, len(specs)).owned for s in cluster_specs(again)] == first
    assert first == [tuple(e % 4 == i for e in range(8)) for i in range(4)]
    other = _cfg("algo=edit", "algo.rule.verified.expert_weights=tokens",
                 "algo.rule.verified.expert_subsets=0+1|2+3|4+5|6+7", "experiment=noniid_lang_4")
    assert fingerprint(other) != fingerprint(cfg)  # a cluster with another map is refused by the fingerprint
    assert frozen_rows(_cfg("experiment=noniid_lang_4"), model, 0, 4) is None  # off by default


def test_edit_train_info_reports_the_bytes_and_memory_each_cluster_saves() -> None:
    from edit_train.cli.info import estimate

    cfg = _cfg(*SUBSETS, "experiment=noniid_lang_2")
    plan = estimate(cfg)["expert_subsets"]
    per_expert = 3 * cfg.model.hidden_size * cfg.model.moe_intermediate_size
    home = 4 * per_expert * 3  # 4 of 8 experts, 3 MoE layers
    assert plan["c0"]["experts"] == [0, 2, 4, 6] and plan["c1"]["experts"] == [1, 3, 5, 7]
    for c in ("c0", "c1"):
        assert plan[c]["unsent_params_per_sync"] == home
        assert plan[c]["bytes_saved_per_sync"] == 4 * home  # gathered, 2 clusters: fp32 rows to the other one
        assert plan[c]["frozen_copy_bytes_per_rank"] == 4 * home
    assert "expert_subsets" not in estimate(_cfg("experiment=noniid_lang_2"))


def test_the_memory_plan_counts_the_frozen_rows_copy_and_no_optimizer_saving() -> None:
    from edit_train.cli.info import estimate
    from edit_train.memplan import plan_for_config

    on = estimate(_cfg(*SUBSETS, "experiment=noniid_lang_4"))
    off = plan_for_config(_cfg("algo=edit", "algo.rule.verified.expert_weights=tokens", "experiment=noniid_lang_4"))
    mem = on["memory_plan"]
    held = max(c["frozen_copy_bytes_per_rank"] for c in on["expert_subsets"].values())  # 6 of 8 experts each
    assert held > 0
    assert mem["bytes"]["frozen_rows"] == held
    assert off["bytes"]["frozen_rows"] == 0
    assert mem["bytes"]["inner_optimizer"] == off["bytes"]["inner_optimizer"]  # one AdamW state per stacked tensor
    assert mem["phases"]["backward_end"] - off["phases"]["backward_end"] == held
