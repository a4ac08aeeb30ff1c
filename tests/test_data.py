import pytest
import torch

from dflashpipe.data import PackedBatches, Sample, epoch_plan, index_samples, make_loader


def _samples(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Sample(0, i, int(x)) for i, x in enumerate(torch.randint(20, 120, (n,), generator=g))]


def test_plan_is_disjoint_balanced_and_epoch_dependent():
    samples = _samples()
    plans = [epoch_plan(samples, 256, seed=1, epoch=0, rank=r, world=3) for r in range(3)]
    assert len({len(p) for p in plans}) == 1  # same step count on every rank
    seen = [i for p in plans for b in p for i in b]
    assert len(seen) == len(set(seen))  # no sample on two ranks
    for p in plans:
        for b in p:
            assert sum(samples[i].length for i in b) <= 256
    again = epoch_plan(samples, 256, seed=1, epoch=0, rank=0, world=3)
    assert again == plans[0]
    assert epoch_plan(samples, 256, seed=1, epoch=1, rank=0, world=3) != plans[0]


def test_index_skips_unsupervised_samples(tiny_features):
    stats = {}
    samples = index_samples(tiny_features["shards"], 256, stats)
    assert len(samples) == 24 and stats == {}
    assert all(s.length <= 256 for s in samples)


def test_batches_have_fixed_shapes_and_resume(tiny_features):
    shards = tiny_features["shards"]
    samples = index_samples(shards, 128, {})
    plan = epoch_plan(samples, 128, seed=0, epoch=0, rank=0, world=1)
    ds = PackedBatches(shards, samples, plan, tokens=128, anchors=16, seed=0, epoch=0)
    shapes = {tuple((k, tuple(v.shape)) for k, v in ds[k].items()) for k in range(len(ds))}
    assert len(shapes) == 1  # every micro-batch has the same shapes
    b = ds[0]
    docs = b["document_ids"]
    n_docs = len(plan[0])
    assert docs.max() == n_docs - 1 and (docs[docs >= 0].diff() >= 0).all()
    assert b["target_hidden"].dtype == torch.bfloat16 and b["target_hidden"].shape == (128, 128)
    kept = b["anchors"][b["keep"]]
    assert (b["loss_mask"][kept] == 1).all() and (docs[kept] >= 0).all()
    # resuming at micro-batch 2 yields exactly the items an uninterrupted pass yields from 2 on
    full = list(make_loader(ds, 0, workers=0, pin=False))
    resumed = list(make_loader(ds, 2, workers=2, pin=False))
    assert len(resumed) == len(full) - 2
    for a, c in zip(full[2:], resumed, strict=True):
        assert all(torch.equal(a[k], c[k]) for k in a)


def test_packed_states_are_the_shards_rows_and_padding_is_zero(tiny_features):
    """Samples decode straight into the batch (cut to the budget), in workers too, where the
    batch is born in shared memory; the rows after the last sample are zeros."""
    from dflashpipe.shards import FeatureShard

    shards = tiny_features["shards"]
    samples = index_samples(shards, 64, {})  # 64-token budget: longer samples are cut
    assert any(s.length == 64 for s in samples)
    plan = epoch_plan(samples, 64, seed=0, epoch=0, rank=0, world=1)
    ds = PackedBatches(shards, samples, plan, tokens=64, anchors=8, seed=0, epoch=0)
    opened = [FeatureShard(p) for p in shards]
    for _ in range(2):  # a second pass reuses freed memory: padding must still be zeroed
        batches = list(make_loader(ds, 0, workers=1, pin=False)) + [ds[k] for k in range(len(ds))]
        for k, b in enumerate(batches):
            at = 0
            for i in plan[k % len(plan)]:
                s = samples[i]
                want = opened[s.shard].sample(s.row)["hidden"][: s.length]
                assert torch.equal(b["target_hidden"][at : at + s.length], want)
                at += s.length
            assert (b["target_hidden"][at:] == 0).all()
    assert any(sum(samples[i].length for i in bins) < 64 for bins in plan)  # padding was tested


def _shard(path, codec: str, lengths: list[int], seed: int, H: int = 32, taps=(0, 1)):
    """A feature shard of random states (a real codec, real schema) and its samples."""
    from dflashpipe.codecs import encode
    from dflashpipe.shards import ShardInfo, feature_row, write_shard

    group = 16 if codec == "fp4-zstd" else None
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, n in enumerate(lengths):
        states = (torch.randn(n, len(taps) * H, generator=g) * 3).to(torch.bfloat16)
        ids = torch.randint(0, 100, (n,), generator=g).tolist()
        rows.append(feature_row(f"s{seed}-{i}", ids, [0] * 3 + [1] * (n - 3),
                                encode(states, codec, len(taps), group_size=group)))  # fmt: skip
    info = ShardInfo(codec, list(taps), H, {"name": "random"}, group_size=group)
    return write_shard(path, rows, info)


@pytest.mark.parametrize("codec", ["fp8-zstd", "fp4-zstd"])
def test_quantized_packs_dequantize_on_the_device_to_the_workers_bf16(tmp_path, codec):
    """quantized=True: a pack of fp8-zstd (fp4-zstd) samples carries the arrays as stored (e4m3
    bytes + scales; packed codes + group and layer scales), and to_device gives bit for bit the
    bf16 states a worker decodes (padding zero); a pack that mixes in a bf16-zstd shard is
    decoded in the worker as before."""
    from dflashpipe.data import to_device

    quant = _shard(tmp_path / "a.arrow", codec, [20, 33, 9, 41], seed=0)
    bf16 = _shard(tmp_path / "b.arrow", "bf16-zstd", [17, 25], seed=1)
    samples = [Sample(0, i, n) for i, n in enumerate([20, 33, 9, 41])]
    samples += [Sample(1, i, n) for i, n in enumerate([17, 25])]
    plan = [[0, 1, 2], [3], [1, 4]]  # quantized only (with padding), quantized only, + bf16
    args = ([quant, bf16], samples, plan, 72, 8, 0, 0)
    plain, quantized = PackedBatches(*args), PackedBatches(*args, quantized=True)
    # 2 taps of 32: fp8 a byte per value + a scale per layer; fp4 half a byte + a group of 16
    shapes = {"fp8-zstd": {"target_fp8": (72, 64), "target_scales": (72, 2)},
              "fp4-zstd": {"target_fp4": (72, 32), "target_group_scales": (72, 4),
                            "target_scales": (72, 2)}}[codec]  # fmt: skip
    for k in range(len(plan)):
        want, got = plain[k], quantized[k]
        assert all((key in got) == (k < 2) for key in shapes) and ("target_hidden" in got) == (
            k == 2
        )
        if k < 2:
            assert {key: tuple(got[key].shape) for key in shapes} == shapes
        moved = to_device(got, torch.device("cpu"))
        assert set(moved) == set(want)
        for key in want:
            assert torch.equal(moved[key].view(-1).view(torch.uint8),
                               want[key].view(-1).view(torch.uint8)), (k, key)  # fmt: skip
    used = sum(samples[i].length for i in plan[0])
    assert (
        used < 72
        and (to_device(quantized[0], torch.device("cpu"))["target_hidden"][used:] == 0).all()
    )
