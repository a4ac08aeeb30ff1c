"""The card table: the figures the benchmarks' bounds and the MFU divide by."""

import pytest

from dflashpipe.cards import card, lookup


@pytest.mark.parametrize(
    "reported, entry, tbs",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 3.35),
        ("NVIDIA H200", "H200", 4.8),
        ("NVIDIA H100 PCIe", "H100 PCIe", 2.0),
        ("NVIDIA H100 NVL", "H100 NVL", 3.9),
    ],
)
def test_a_driver_name_finds_its_entry(reported, entry, tbs):
    found = lookup(reported)
    assert (found.name, found.hbm_bytes_per_s) == (entry, tbs * 1e12)
    assert found.bf16_flops > 7e14


def test_an_unknown_card_has_no_figures_and_overrides_fill_them():
    assert lookup("Some Future GPU").hbm_bytes_per_s is None
    cpu = card("cpu")
    assert (cpu.name, cpu.hbm_bytes_per_s, cpu.bf16_flops) == ("cpu", None, None)
    given = card("cpu", hbm_tbs=3.35, tflops=989)
    assert (given.hbm_bytes_per_s, given.bf16_flops) == (3.35e12, 989e12)
    assert "3.35 TB/s" in given.describe() and "989 TFLOP/s" in given.describe()
