"""The time account: exclusive nested spans, blocked seconds moved out of spans, buckets add up to wall."""

from __future__ import annotations

import pytest

from edit_train.timing import BUCKETS, TimeAccount, window


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.blocked = 0.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float, blocked: float = 0.0) -> None:
        self.now += seconds
        self.blocked += blocked


def account(clock: FakeClock) -> TimeAccount:
    return TimeAccount(blocked=lambda: clock.blocked, clock=clock)


def test_nested_spans_are_exclusive_and_blocked_time_moves_out() -> None:
    c = FakeClock()
    acc = account(c)
    c.tick(2.0)  # before any span: other
    with acc.span("compute"):
        c.tick(1.0)
        with acc.span("sync"):  # a layer-wise hook inside the forward
            c.tick(0.25)
            c.tick(0.5, blocked=0.5)  # waiting on the link inside the hook
        c.tick(3.0)
    with acc.span("eval"):
        c.tick(0.75)
    c.tick(0.1, blocked=0.1)  # a quorum wait outside any span
    snap = acc.snapshot()
    assert snap["compute"] == pytest.approx(4.0)
    assert snap["sync"] == pytest.approx(0.25)
    assert snap["blocked"] == pytest.approx(0.6)
    assert snap["eval"] == pytest.approx(0.75)
    assert snap["other"] == pytest.approx(2.0)
    assert snap["wall_s"] == pytest.approx(7.6)
    assert sum(snap[b] for b in BUCKETS) == pytest.approx(snap["wall_s"])
    assert list(snap)[:len(BUCKETS)] == list(BUCKETS)


def test_open_span_is_charged_up_to_now_without_disturbing_it() -> None:
    c = FakeClock()
    acc = account(c)
    with acc.span("compute"):
        c.tick(1.0)
        assert acc.snapshot()["compute"] == pytest.approx(1.0)
        c.tick(1.0, blocked=0.5)
        mid = acc.snapshot()
        assert (mid["compute"], mid["blocked"]) == (pytest.approx(1.5), pytest.approx(0.5))
        c.tick(1.0)
    end = acc.snapshot()
    assert (end["compute"], end["blocked"], end["other"]) == (pytest.approx(2.5), pytest.approx(0.5), pytest.approx(0.0))


def test_keeps_blocked_and_claim_charge_start_up() -> None:
    c = FakeClock()
    acc = account(c)
    c.tick(5.0)  # building the model, reading data
    acc.claim("startup")
    with acc.span("startup", keeps_blocked=True):
        c.tick(3.0, blocked=2.5)  # waiting for the other clusters to come up
    c.tick(1.0, blocked=1.0)
    snap = acc.snapshot()
    assert snap["startup"] == pytest.approx(8.0)
    assert snap["blocked"] == pytest.approx(1.0)  # only the wait after start-up
    assert snap["other"] == pytest.approx(0.0)


def test_attach_blocked_keeps_what_was_counted_and_ignores_a_restored_counter() -> None:
    c = FakeClock()
    acc = TimeAccount(clock=c)
    c.tick(1.0)
    restored = {"blocked": 40.0}  # the comm's counter restored from a checkpoint: not this incarnation's time
    acc.attach_blocked(lambda: restored["blocked"])
    c.tick(1.0)
    restored["blocked"] += 0.5
    assert acc.snapshot()["blocked"] == pytest.approx(0.5)


def test_carry_adds_earlier_incarnations_and_window_is_a_difference() -> None:
    c = FakeClock()
    acc = account(c)
    acc.carry({"compute": 10.0, "other": 1.0, "wall_s": 999.0})
    with acc.span("compute"):
        c.tick(2.0)
    first = acc.snapshot()
    assert first["compute"] == pytest.approx(12.0) and first["wall_s"] == pytest.approx(13.0)
    with acc.span("data"):
        c.tick(0.5)
    w = window(acc.snapshot(), first)
    assert w["data"] == pytest.approx(0.5) and w["compute"] == 0 and w["wall_s"] == pytest.approx(0.5)


def test_unknown_bucket_is_refused() -> None:
    acc = TimeAccount()
    with pytest.raises(ValueError, match="unknown time bucket"):
        with acc.span("gpu"):
            pass
    with pytest.raises(ValueError):
        with acc.span("other"):
            pass
