"""A transport selected by import path (`sync.transport=custom_transport:counting`): the in-process hub's
transport, counting the collectives it starts — a stand-in for a transport with other wires."""

from __future__ import annotations

from collections import Counter
from typing import Any

from edit_train.federation.inproc import InProcessFederation
from edit_train.federation.registry import TransportRequest

CALLS: Counter[str] = Counter()


class Counting:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def all_gather(self, *a: Any, **kw: Any) -> Any:
        CALLS["all_gather"] += 1
        return self.inner.all_gather(*a, **kw)

    def reduce_(self, *a: Any, **kw: Any) -> Any:
        CALLS["reduce"] += 1
        return self.inner.reduce_(*a, **kw)

    def gather(self, *a: Any, **kw: Any) -> Any:
        CALLS["gather"] += 1
        return self.inner.gather(*a, **kw)


def counting(request: TransportRequest) -> Counting:
    hub = InProcessFederation.installed()
    assert hub is not None, "install a hub first"
    return Counting(hub.transport(request.name, request.cluster, chunks=request.chunks,
                                  compression=request.compression))
