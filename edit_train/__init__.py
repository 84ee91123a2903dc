"""edit-train: asynchronous cross-cluster trainer for Mixture-of-Experts LMs (EDiT local SGD)."""

__version__ = "0.1.0"
