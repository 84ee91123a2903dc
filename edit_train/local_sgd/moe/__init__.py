"""Expert handling (torch only): which rows of a unit are which expert's, the routed counts, per-expert
weights, and which experts each cluster holds (`assignment.py`). Imports only edit_train.local_sgd's
root modules.
"""
