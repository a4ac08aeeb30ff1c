import pytest

from dflashpipe.devices import resolve_devices, visible_gpus
from dflashpipe.errors import ConfigError


def test_auto_takes_every_visible_gpu():
    assert resolve_devices("auto", [0, 1, 2], "devices.extract") == [0, 1, 2]
    assert resolve_devices("auto", [], "devices.extract") == []  # CPU


def test_explicit_list_must_be_visible():
    assert resolve_devices([2, 0], [0, 1, 2], "devices.train") == [2, 0]
    with pytest.raises(ConfigError, match=r"devices.train lists GPU\(s\) \[5\].*\[0, 1\]"):
        resolve_devices([1, 5], [0, 1], "devices.train")
    with pytest.raises(ConfigError, match="visible GPUs are none"):
        resolve_devices([0], [], "devices.train")


def test_cuda_visible_devices_wins(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert visible_gpus() == [0, 1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []
