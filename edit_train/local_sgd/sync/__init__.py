"""The sync sequence: one round (`core.py`, `round.py`, `judge.py`, `merges.py`, the round's expert hook
`expert_rows.py`, the usefulness `probe.py`) driven three ways (`drivers.py`), the pacer, membership,
healing, the outer step and `LocalSGD` (`algorithms.py`). The top layer: imports `aggregation`, `moe`
and the root modules; nothing in local_sgd imports it.
"""
