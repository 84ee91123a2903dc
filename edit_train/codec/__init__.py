"""The compression codec: what a pseudo-gradient becomes on the cross-cluster wire and back. Pure tensor math
(torch, numpy, numba), no network: nothing here imports ``torch.distributed`` or touches a process group.

`dense.py` holds the dense formats (none, bf16, int8, fp8), `CompressionConfig`, `quantize` / `dequantize`,
`wire_bytes` and error feedback; `sparse.py` the top-k codec (its eager torch path), `sparse_format.py` its
torch-free wire layout (the planner's `plan/traffic.py` reads it too), and `sparse_fused.py` with
`sparse_select.py`, `sparse_elements.py` and `sparse_bits.py` the one-pass numba CPU codec. Moving payloads
over process groups is the network's: `edit_train.federation.compressed_reduce`. From edit_train the codec
imports only `edit_train.local_sgd.errors` (a refused payload is a survivable `FederationError`)."""
