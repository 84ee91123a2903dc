"""What crosses clusters: the core's `Transport` over torchft's Lighthouse and reconfigurable gloo lanes
(`transport.py`), compressed payloads over lanes (`compressed_reduce.py`; the codec itself is
`edit_train.codec`), the simulated WAN link, heal payloads, and an in-process stand-in for
the network (`inproc.py`)."""
