import pytest
import torch

from dflashpipe.devices import ANY_DEVICE, DeviceLease, resolve_devices, visible_gpus
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


def _no_scheduler(monkeypatch, tmp_path, visible: str) -> None:
    monkeypatch.chdir(tmp_path)  # leases lock results/.locks/gpu-<i>.lock under the cwd
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


def test_a_lease_holds_the_shards_device_or_another_free_one(monkeypatch, tmp_path):
    _no_scheduler(monkeypatch, tmp_path, "0,1")
    with DeviceLease([0, 1], shard=1).hold() as device:
        assert device == torch.device("cuda", 1)
        with DeviceLease([0, 1], shard=1).hold() as other:  # 1 is held: the free one
            assert other == torch.device("cuda", 0)
    with DeviceLease([0, 1], key="devices.train").hold_all() as held:
        assert held == [0, 1]
    with DeviceLease(fixed="cpu").hold() as device:  # evaluate --device: no lease
        assert device == torch.device("cpu")
    refused = pytest.raises(ConfigError, match=r"devices\.train lists GPU\(s\) \[4\]")
    with refused, DeviceLease([4], key="devices.train").hold_all():
        pass


def test_without_a_gpu_a_lease_is_the_cpu(monkeypatch, tmp_path):
    _no_scheduler(monkeypatch, tmp_path, "")
    with ANY_DEVICE.hold() as device:
        assert device == torch.device("cpu")
    with DeviceLease(key="devices.train").hold_all() as held:
        assert held == []


def test_every_gpu_stage_takes_its_lease_from_one_place():
    """cli.device_lease: regenerate, extract and evaluate draw on devices.extract (the shard's),
    train on devices.train, evaluate's --device names one outright."""
    from dflashpipe.cli import build_parser, device_lease
    from dflashpipe.config import Config

    cfg = Config.from_dict({
        "target": {"model": "x"}, "devices": {"extract": [0, 1], "train": [2]},
        "prompts": {"sources": [{"name": "x", "kind": "jsonl", "path": "unused.jsonl"}]},
    })  # fmt: skip
    parse = build_parser().parse_args
    extract = parse(["extract", "--config", "c", "--sequences", "s", "--shard", "3", "--out", "o"])
    assert device_lease(extract, cfg) == DeviceLease([0, 1], 3, "devices.extract")
    train = parse(["train", "--config", "c", "--manifest", "m", "--run-dir", "r", "--drafter", "d",
                   "--metrics", "x"])  # fmt: skip
    assert device_lease(train, cfg) == DeviceLease([2], 0, "devices.train")
    evaluate = parse(["evaluate", "--drafter", "d", "--device", "cpu"])
    assert device_lease(evaluate, None) == DeviceLease("auto", 0, "devices.extract", "cpu")
