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
