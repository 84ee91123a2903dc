"""Transports by name: `sync.transport` picks how a cluster's rank reaches the others.

* `lighthouse` (default) — torchft's Lighthouse behind our gate for the quorum, gloo lanes between hosts
  (`transport.lighthouse_transport`);
* `inproc` — clusters that are threads of one process, over the hub installed with
  `InProcessFederation.install()` (tests, notebooks; refused with one line when none is installed);
* `"package.module:factory"` — your own: a callable taking a `TransportRequest` and returning an object that
  implements `edit_train.local_sgd.protocols.Transport` (imported on first use).

A factory registered with `@register_transport("name")` is selectable by that name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from edit_train.codec.dense import CompressionConfig
from edit_train.federation import auth
from edit_train.federation.link import LinkModel
from edit_train.importpath import load
from edit_train.local_sgd.protocols import ClusterGroup, Transport

if TYPE_CHECKING:
    from edit_train.federation.signed import Credentials

__all__ = ["TransportRequest", "register_transport", "make_transport", "transport_names"]


@dataclass
class TransportRequest:
    """Everything a transport factory is told about the rank it serves."""

    name: str  # this cluster's name
    cluster: ClusterGroup  # its ranks
    federated: bool  # False: a lone cluster (every call stays local)
    lighthouse: str | None = None  # host:port of the federation's gate (lighthouse transport)
    host: str = "127.0.0.1"  # the address this rank binds cross-cluster traffic to
    chunks: int = 4
    link: LinkModel | None = None
    quorum_timeout_s: float = 300.0
    collective_timeout_s: float = 30.0
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    key: bytes = auth.INSECURE
    key_source: str = "federation.key_file"
    refuse_after_s: float = 25.0
    credentials: Credentials | None = None  # this cluster's identity and the roster (None: no roster)


Factory = Callable[[TransportRequest], Transport]
_TRANSPORTS: dict[str, Factory] = {}


def register_transport(name: str) -> Callable[[Factory], Factory]:
    """Decorator: make a factory selectable as `sync.transport=<name>`."""
    def add(factory: Factory) -> Factory:
        _TRANSPORTS[name] = factory
        return factory
    return add


def transport_names() -> list[str]:
    return sorted(_TRANSPORTS)


def resolve(spec: str) -> Factory:
    """The factory `spec` names (a registered name or "module:attr"); ValueError in one line otherwise."""
    if spec in _TRANSPORTS:
        return _TRANSPORTS[spec]
    factory = load(spec, "sync.transport", "transport", transport_names())
    if not callable(factory):
        raise ValueError(f"sync.transport: {spec!r} is not a factory (a callable taking a TransportRequest)")
    return factory


def make_transport(spec: str, request: TransportRequest) -> Transport:
    return resolve(spec)(request)


@register_transport("lighthouse")
def _lighthouse(r: TransportRequest) -> Transport:
    from edit_train.federation.transport import lighthouse_transport

    return lighthouse_transport(name=r.name, cluster=r.cluster, lighthouse=r.lighthouse if r.federated else None,
                                host=r.host, chunks=r.chunks, link=r.link, quorum_timeout_s=r.quorum_timeout_s,
                                collective_timeout_s=r.collective_timeout_s, compression=r.compression, key=r.key,
                                key_source=r.key_source, refuse_after_s=r.refuse_after_s,
                                credentials=r.credentials)


@register_transport("inproc")
def _inproc(r: TransportRequest) -> Transport:
    from edit_train.federation.inproc import InProcessFederation

    hub = InProcessFederation.installed()
    if hub is None:
        raise ValueError("sync.transport=inproc: clusters must be threads of one process with a hub installed "
                         "(InProcessFederation.install()); across processes or hosts use sync.transport=lighthouse")
    return hub.transport(r.name, r.cluster, chunks=r.chunks, link=r.link, compression=r.compression)
