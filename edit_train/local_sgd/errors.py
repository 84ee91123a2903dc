"""The errors of the sync core and of every transport that implements it (one place for all of them).

A `FederationError` is always survivable: the sync it happened in is skipped or rolled back and the cluster
keeps training. Only `FederationRefused` stops a cluster (its configuration or its name can never be
admitted). `HealError` is a `FederationError`: a bad heal payload keeps the healer out of this sync and it
tries again at the next one.
"""

from __future__ import annotations

__all__ = ["FederationError", "FederationRefused", "SyncAborted", "HealError", "ClusterError"]


class FederationError(RuntimeError):
    """Cross-cluster communication failed (peer lost, timeout, unreachable Lighthouse)."""


class FederationRefused(FederationError):
    """The federation refuses this cluster for good (another configuration, a name already taken): trying
    again cannot help, so the run stops with this message instead of skipping the sync."""


class SyncAborted(RuntimeError):
    """A cluster was lost mid-sync: every unit was rolled back; the caller retries its step."""


class ForwardStale(SyncAborted):
    """The layer-wise sync committed, but only after it gathered again (its sketched SUM did not check out):
    the parameters the forward pass already used have changed since, so the caller runs that forward again."""


class HealError(FederationError):
    """A healing payload that is not ours or does not fit this model (refused; nothing in it was executed
    or adopted)."""


class ClusterError(RuntimeError):
    """The ranks of one cluster lost each other (a rank died or stalled past `cluster.timeout_s`): this
    cluster stops with one line, and its launcher restarts it alone; the other clusters are not affected."""
