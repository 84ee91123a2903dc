"""The sync core (torch only): one sync round driven three ways, behind two seams.

`Transport` / `ClusterGroup` (`protocols.py`) are what crosses clusters / what a cluster's ranks do
together; `Aggregator` (`rules.py`) weighs the clusters. `LocalSGD` (`algorithms.py`) is what a training
loop sees. No model, data, Hydra or W&B code is imported here.
"""
