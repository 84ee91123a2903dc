"""The aggregation rules and what they judge on (behind the `aggregator` seam): the built-in rules
and the registry (`rules.py`, `verified.py`), their tests (direction, scale, the sketch check),
who misbehaved (`suspects.py`, `claims.py`) and taking an update back (`retract.py`).
Imports only edit_train.local_sgd's root modules and `moe`.
"""
