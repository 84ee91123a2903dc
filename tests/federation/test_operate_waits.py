"""Issue 48, waits: every wait for the federation says what it waits for every N seconds, ends in one plain
sentence, and yields to Ctrl-C / SIGTERM within a few seconds; torchft's raw timeout status never reaches users."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from conftest import cli_env
from edit_train.federation.quorum import lighthouse_error
from edit_train.local_sgd.sync import waits

# a cluster's leader waiting for a Lighthouse that never answers (the quorum request of a cluster resumed after
# its peers finished), with the trainer's own signal handler installed, as in a run
WAITER = textwrap.dedent('''
    import logging, sys, threading, time
    from edit_train.cluster.group import RankGroup
    from edit_train.federation.forming import Forming
    from edit_train.federation.link import LinkClock
    from edit_train.local_sgd.sync.waits import WaitInterrupted
    from edit_train.train.signals import StopSignal

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    stop = StopSignal()
    never = threading.Event()
    forming = Forming(RankGroup(), LinkClock(None), lambda: never.wait() and {}, lambda q: True, lambda: None,
                      deadlines=(300.0, 30.0), label="cluster b, sync 3")
    print("waiting", flush=True)
    t0 = time.monotonic()
    try:
        forming.poll(block=True)
    except WaitInterrupted as exc:
        print(f"gave up after {time.monotonic() - t0:.1f} s: {exc}", flush=True)
        sys.exit(0)
    sys.exit(1)
''')


def test_a_wait_prints_progress_and_honours_sigint(tmp_path: Path) -> None:
    """The leader waits for the Lighthouse's quorum (a 300 s deadline): it says so every second here
    (EDIT_TRAIN_WAIT_EVERY_S=1) with how long of how long, and a SIGINT ends the wait within 5 s (it used to
    sit out the whole deadline, then torchrun SIGKILLed it)."""
    proc = subprocess.Popen([sys.executable, "-c", WAITER], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=cli_env(EDIT_TRAIN_WAIT_EVERY_S="1"), cwd=tmp_path)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "waiting"
        time.sleep(3.5)
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert took <= 5.0, (took, out)
    progress = [line for line in out.splitlines() if line.startswith("waiting for the Lighthouse's answer")]
    assert len(progress) >= 2, out
    assert "(cluster b, sync 3)" in progress[0] and " of 315 s" not in progress[0] and " of 300 s" in progress[0], out
    last = out.strip().splitlines()[-1]
    assert last.startswith("gave up after") and "stopped waiting for the Lighthouse's answer" in last, out
    assert "Traceback" not in out


def test_a_wait_says_the_peers_news_and_ends_in_one_sentence(monkeypatch) -> None:
    """Progress lines carry what run.dir's records say of the peers; a wait that reported ends in one sentence;
    one nobody noticed stays silent."""
    now = [0.0]
    said: list[str] = []
    monkeypatch.setattr(waits, "NEWS", [lambda: "a finished (step 20, its record), c last trained 12 s ago"])
    monkeypatch.setenv("EDIT_TRAIN_WAIT_EVERY_S", "10")
    w = waits.Wait("the federation (cluster b joining)", 60.0, detail=lambda: "missing: c", clock=lambda: now[0],
                   say=said.append)
    answers = iter([False, False, True])

    def ready(_slice: float) -> bool:
        now[0] += 6.0
        return next(answers)

    assert w.until(ready)
    w.done("met a, b, c")
    assert said == ["waiting for the federation (cluster b joining): 12 s of 60 s; missing: c; "
                    "a finished (step 20, its record), c last trained 12 s ago",
                    "the federation (cluster b joining): met a, b, c after 18 s"]
    quiet: list[str] = []
    w = waits.Wait("x", 60.0, clock=lambda: 0.0, say=quiet.append)
    assert w.until(lambda _s: True)
    w.done("it came")
    assert quiet == []


def test_torchfts_raw_timeout_status_becomes_one_plain_line() -> None:
    raw = ('status: Cancelled, message: "Timeout expired", details: [], metadata: MetadataMap { headers: '
           '{"content-type": "application/grpc"} }')
    line = lighthouse_error(raw, "b", "lh0:29510", 300.0)
    assert line.startswith("cluster b: no quorum within 300 s (federation.quorum_timeout_s) from the Lighthouse")
    assert "MetadataMap" not in line and "Cancelled" not in line and "\n" not in line
    other = lighthouse_error('status: Internal, message: "replica id mismatch", details: [], metadata: MetadataMap '
                             '{ headers: {} }', "b", "lh0:29510", 300.0)
    assert other == "cluster b: the Lighthouse at lh0:29510 failed: replica id mismatch"


def test_a_stop_ends_the_wait_at_once_and_is_cleared_by_the_next_run() -> None:
    from edit_train.train.signals import StopSignal

    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        waits.STOP.set()
        w = waits.Wait("the Lighthouse", 300.0, say=lambda _line: None)
        t0 = time.monotonic()
        try:
            w.until(lambda s: time.sleep(s) or False)
        except waits.WaitInterrupted as exc:
            assert "stopped waiting for the Lighthouse" in str(exc)
        else:
            raise AssertionError("the wait did not stop")
        assert time.monotonic() - t0 < 2.0
        StopSignal()  # a new run in this process: no stop left over
        assert not waits.STOP.is_set()
    finally:
        waits.STOP.clear()
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])


def test_joining_says_who_is_missing_and_how_it_ended(monkeypatch, caplog) -> None:
    """A fresh cluster c1 joining a federation whose c0 never comes: while it waits (quorum_timeout_s) it says
    who the last quorum held and who is missing, and it ends in one sentence (it used to be silent for minutes)."""
    import logging

    from edit_train.federation.inproc import InProcessFederation
    from toy_federation import H, config, run_inproc

    monkeypatch.setenv("EDIT_TRAIN_WAIT_EVERY_S", "0.5")
    cfg = config("layerwise", "uniform", syncs=1)
    cfg.membership.expected, cfg.membership.quorum_timeout_s = ("c0", "c1"), 2.5
    with caplog.at_level(logging.INFO, logger="edit_train.local_sgd.sync.waits"):
        out = run_inproc(["c1"], cfg, hub=InProcessFederation(min_clusters=1, join_timeout_s=0.02, timeout_s=30.0))
    assert out["c1"].steps == H
    said = [r.getMessage() for r in caplog.records if r.name == "edit_train.local_sgd.sync.waits"]
    progress = [m for m in said if m.startswith("waiting for the federation (cluster c1 joining): ")]
    assert progress and all(" of 2 s; in the last quorum: c1; missing: c0" in m for m in progress), said
    assert said[-1].startswith("the federation (cluster c1 joining): nobody else came: training alone"), said


def test_joining_yields_to_a_stop(monkeypatch) -> None:
    """A signal while a cluster waits for the federation at start: the wait ends at once (the loop then stops at
    its first step boundary) instead of running out quorum_timeout_s."""
    from edit_train.federation.inproc import InProcessFederation
    from edit_train.local_sgd.sync import membership
    from toy_federation import config, run_inproc

    meet = membership.Membership.meet
    took: list[float] = []

    def stopped_meet(self: membership.Membership):  # type: ignore[no-untyped-def]
        threading.Timer(0.5, waits.STOP.set).start()
        t0 = time.monotonic()
        try:
            return meet(self)
        finally:
            took.append(time.monotonic() - t0)
            waits.STOP.clear()

    monkeypatch.setattr(membership.Membership, "meet", stopped_meet)
    cfg = config("layerwise", "uniform", syncs=1)
    cfg.membership.expected, cfg.membership.quorum_timeout_s = ("c0", "c1"), 60.0
    run_inproc(["c1"], cfg, hub=InProcessFederation(min_clusters=1, join_timeout_s=0.02, timeout_s=30.0))
    assert took and took[0] < 5.0, took
