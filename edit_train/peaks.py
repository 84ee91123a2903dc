"""Dense bf16 tensor FLOP/s of known accelerators (vendor data sheets, no 2:4 sparsity), without torch: the
one table MFU (`train/mfu.py`) and the planner (`plan/hardware.py`) read."""

from __future__ import annotations

# (substring of torch.cuda.get_device_name(), dense bf16 FLOP/s); first match wins, so specific names first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100 NVL", 835.0e12),
    ("H100", 989.4e12),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H800", 989.4e12),
    ("H20", 148.0e12),
    ("A100", 312.0e12),
    ("A800", 312.0e12),
    ("L40S", 362.05e12),
    ("L40", 181.0e12),
    ("L4", 121.0e12),
    ("RTX 4090", 165.2e12),
    ("MI325X", 1307.4e12),
    ("MI300X", 1307.4e12),
    ("MI300A", 980.6e12),
    ("MI250X", 383.0e12),
    ("MI250", 362.1e12),
)


def _norm(name: str) -> str:
    return name.lower().replace(" ", "").replace("-", "").replace("_", "")


def lookup_peak(device_name: str) -> float | None:
    """Dense bf16 FLOP/s of a known device name (`torch.cuda.get_device_name()` or a type such as `rtx4090`),
    else None. Spaces, dashes and case do not matter."""
    name = _norm(device_name)
    for key, peak in PEAK_BF16_FLOPS:
        if _norm(key) in name:
            return peak
    return None
