"""The accelerator's datasheet figures, looked up by the name its driver reports: what the speed
bounds (HBM bandwidth) and MFU (dense bf16 peak) divide by. Benchmarks take them from here, not
from a constant, so a figure measured on an H100 is not divided by an H200's bandwidth."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Card:
    name: str  # the table's entry ("H100 SXM"), or what the driver reported where none matched
    hbm_bytes_per_s: float | None
    bf16_flops: float | None  # dense (no 2:4 sparsity)

    def describe(self) -> str:
        bw = f"{self.hbm_bytes_per_s / 1e12:.2f} TB/s" if self.hbm_bytes_per_s else "bandwidth ?"
        peak = f"{self.bf16_flops / 1e12:.0f} TFLOP/s" if self.bf16_flops else "peak ?"
        return f"{self.name} ({bw}, {peak} dense bf16)"


# (a substring of torch.cuda.get_device_name, entry, TB/s, dense bf16 TFLOP/s); first match wins,
# so the PCIe and NVL parts come before the SXM one whose driver name ("NVIDIA H100 80GB HBM3")
# names no form factor. Vendor datasheets.
TABLE = (
    ("H100 PCIe", "H100 PCIe", 2.0, 756.0),
    ("H100 NVL", "H100 NVL", 3.9, 835.0),
    ("H200", "H200", 4.8, 989.0),
    ("H100", "H100 SXM", 3.35, 989.0),
    ("A100", "A100", 2.0, 312.0),
)


def lookup(device_name: str) -> Card:
    """The table's entry for a driver-reported name; unknown figures (None) for another card."""
    for key, entry, tbs, tflops in TABLE:
        if key in device_name:
            return Card(entry, tbs * 1e12, tflops * 1e12)
    return Card(device_name, None, None)


def card(device: torch.device | str = "cuda", hbm_tbs: float | None = None,
         tflops: float | None = None) -> Card:  # fmt: skip
    """The card of a CUDA `device` (hbm_tbs / tflops override the table's figures); the CPU has
    no entry."""
    device = torch.device(device)
    found = (
        lookup(torch.cuda.get_device_name(device))
        if device.type == "cuda"
        else Card("cpu", None, None)
    )
    return Card(
        found.name,
        hbm_tbs * 1e12 if hbm_tbs else found.hbm_bytes_per_s,
        tflops * 1e12 if tflops else found.bf16_flops,
    )
