"""Membership per sync from torchft's Lighthouse.

Each cluster's leader (its rank 0) keeps a heartbeat to the Lighthouse and, at every sync, asks it for a
quorum. The Lighthouse (torchft's, unchanged) issues one when at least `min_replicas` clusters have asked
and every cluster that is heartbeating has asked too, or when the join timeout (our grace window) has
passed since the first one asked. A cluster that died stops heartbeating and is left out after the
heartbeat timeout; a cluster that is merely late is waited for at most the join timeout.

What each member tells the others rides in the quorum request: its anchor version (`step` = sync index),
its rank count (`world_size`), where its leader's store listens (`store_address`) and a small JSON dict
(`data`: config fingerprint, local steps, incarnation). Nothing is pickled.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from typing import Any

from edit_train.local_sgd.errors import FederationError, FederationRefused
from edit_train.local_sgd.protocols import Member, Quorum

log = logging.getLogger(__name__)

if not os.environ.get("RUST_LOG"):
    os.environ["RUST_LOG"] = "warn"  # torchft's Rust side logs every quorum at INFO otherwise


class QuorumClient:
    """The cluster leader's link to the Lighthouse: heartbeats in the background, a quorum per sync."""

    def __init__(self, lighthouse: str, name: str, connect_timeout_s: float = 10.0,
                 heartbeat_interval_s: float = 0.5) -> None:
        from torchft.coordination import LighthouseClient

        self.lighthouse = lighthouse
        self.name = name
        self._timeout = datetime.timedelta(seconds=connect_timeout_s)
        self._check_reachable(lighthouse, connect_timeout_s)
        self._client = LighthouseClient(_http(lighthouse), self._timeout)
        self._partitioned_until = 0.0
        self._stop = threading.Event()
        self._interval = heartbeat_interval_s
        self._beat: threading.Thread | None = None

    @staticmethod
    def _check_reachable(lighthouse: str, timeout_s: float) -> None:
        """A plain TCP connect: a heartbeat would already count this cluster as present (and make the
        others wait for it) before it is ready to join."""
        import socket

        host, _, port = lighthouse.split("://", 1)[-1].rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
        except (OSError, ValueError) as exc:
            raise FederationError(f"cannot reach the Lighthouse at {lighthouse} (federation.lighthouse): "
                                  f"{_first_line(exc)}; start one (edit-train starts it for local runs, or "
                                  "`torchft_lighthouse --bind [::]:29510 --min_replicas 1`) or fix the address") from None

    def start_heartbeat(self) -> None:
        """From now on the Lighthouse counts this cluster as alive (call when ready to join)."""
        if self._beat is None:
            self._beat = threading.Thread(target=self._heartbeat, name="edit-train-heartbeat", daemon=True)
            self._beat.start()

    # ------------------------------------------------------------ partition
    def partition(self, seconds: float) -> None:
        """Fault injection: this cluster cannot reach the others (nor the Lighthouse) for `seconds`."""
        self._partitioned_until = time.monotonic() + seconds
        log.warning("cluster %s: partitioned from the federation for %.0fs", self.name, seconds)

    @property
    def partitioned(self) -> bool:
        return time.monotonic() < self._partitioned_until

    def _heartbeat(self) -> None:
        while not self._stop.wait(self._interval):
            if self.partitioned:
                continue
            try:
                self._client.heartbeat(self.name, timeout=self._timeout)
            except Exception as exc:  # noqa: BLE001 - keep beating; the quorum call reports for real
                log.debug("heartbeat to %s failed: %s", self.lighthouse, _first_line(exc))

    def close(self) -> None:
        self._stop.set()

    # --------------------------------------------------------------- quorum
    def request(self, sync: int, size: int, store: str, data: dict[str, Any], timeout_s: float) -> Quorum | None:
        """Ask for this sync's quorum. None when partitioned (the cluster keeps training alone)."""
        if self.partitioned:
            return None
        self.start_heartbeat()
        try:
            q = self._client.quorum(replica_id=self.name, timeout=datetime.timedelta(seconds=timeout_s),
                                    address=self.name, store_address=store, step=sync, world_size=size,
                                    shrink_only=False, data=data)
        except Exception as exc:  # noqa: BLE001
            msg = _first_line(exc)
            if "timed out" in msg.lower() or "deadline" in msg.lower():
                raise FederationError(f"cluster {self.name}: no quorum within {timeout_s:.0f}s "
                                      f"(federation.quorum_timeout_s) from the Lighthouse at {self.lighthouse}: "
                                      "are the other clusters running?") from None
            raise FederationError(f"cluster {self.name}: Lighthouse at {self.lighthouse} failed: {msg}") from None
        members = [Member(m.replica_id, int(m.step), int(m.world_size), m.store_address, dict(m.data or {}))
                   for m in q.participants]
        members.sort(key=lambda m: m.name)
        created = getattr(q, "created", None)
        stamp = f"{getattr(created, 'seconds', 0)}.{getattr(created, 'nanos', 0)}" if created is not None else ""
        me = next((i for i, m in enumerate(members) if m.name == self.name), -1)
        if me < 0:
            raise FederationError(f"cluster {self.name}: the Lighthouse issued a quorum without us")
        if members[me].data.get("incarnation") != data.get("incarnation"):
            raise FederationRefused(f"two clusters are named {self.name!r}: cluster names must be unique "
                                  "(set a different EDIT_TRAIN_CLUSTER / cluster.only)")
        return Quorum(int(q.quorum_id), f"q{q.quorum_id}-{stamp}", members, me)


def _http(addr: str) -> str:
    return addr if "://" in addr else f"http://{addr}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class Lighthouse:
    """torchft's Lighthouse, started in this process (the local launcher's, or `edit-train-lighthouse`)."""

    def __init__(self, bind: str, min_clusters: int, join_timeout_s: float, heartbeat_timeout_s: float) -> None:
        from torchft.coordination import LighthouseServer

        self._bind = bind
        self._server = LighthouseServer(bind=bind, min_replicas=min_clusters,
                                        join_timeout_ms=int(join_timeout_s * 1000), quorum_tick_ms=50,
                                        heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))

    @property
    def address(self) -> str:
        port = self._server.address().rsplit(":", 1)[-1]
        host = self._bind.rsplit(":", 1)[0]
        if host in ("0.0.0.0", "[::]", "::", ""):
            host = self._server.address().split("://", 1)[-1].rsplit(":", 1)[0]
        return f"{host}:{port}"

    def shutdown(self) -> None:
        self._server.shutdown()
