"""Anchor sampling: candidates, per-document caps, fixed budget, reproducibility, uniformity."""

import pytest
import torch

from dflashpipe.anchors import anchor_candidates, sample_anchors


def stream():
    # doc 7: 12 tokens, prompt 0-3; doc 9: 8 tokens, prompt 0-1 and a user turn at 5; padding.
    docs = torch.tensor([7] * 12 + [9] * 8 + [-1] * 4)
    loss_mask = torch.tensor([0] * 4 + [1] * 8 + [0, 0, 1, 1, 1, 0, 1, 1] + [0] * 4)
    return loss_mask, docs


def test_candidates_need_a_supervised_in_document_next_label():
    loss_mask, docs = stream()
    cand = anchor_candidates(loss_mask, docs).nonzero()[:, 0].tolist()
    # 11 is the last token of doc 7 (its next token is in doc 9); 16 is followed by the user
    # token 17; 19 is the last of doc 9.
    assert cand == [4, 5, 6, 7, 8, 9, 10, 14, 15, 18]


def sample(epoch=0, num_anchors=3, budget=8, ids=("a", "b"), seed=0, s=None):
    loss_mask, docs = s or stream()
    return sample_anchors(
        loss_mask, docs, list(ids), num_anchors=num_anchors, budget=budget, seed=seed, epoch=epoch
    )


def test_fixed_budget_with_keep_mask_and_per_document_cap():
    anchors, keep = sample()
    assert anchors.shape == keep.shape == (8,) and anchors.dtype == torch.long
    kept = anchors[keep].tolist()
    assert keep.tolist() == [True] * 6 + [False] * 2  # 3 per document
    assert kept == sorted(kept)
    assert len([a for a in kept if a < 12]) == 3 and len([a for a in kept if a >= 12]) == 3
    assert set(kept) <= {4, 5, 6, 7, 8, 9, 10, 14, 15, 18}
    assert anchors[~keep].tolist() == [0, 0]


def test_reproducible_from_seed_epoch_and_sample_id():
    a1, _ = sample(epoch=1)
    assert torch.equal(a1, sample(epoch=1)[0])
    assert any(not torch.equal(a1, sample(epoch=e)[0]) for e in (2, 3, 4))
    assert any(not torch.equal(a1, sample(epoch=1, seed=s)[0]) for s in (1, 2, 3))


def test_anchors_follow_the_document_not_its_place_in_the_pack():
    loss_mask, docs = stream()
    alone, keep = sample_anchors(
        loss_mask[12:20],
        torch.zeros(8, dtype=torch.long),
        ["b"],
        num_anchors=2,
        budget=4,
        seed=0,
        epoch=5,
    )
    packed, pkeep = sample(epoch=5, num_anchors=2)
    assert (packed[pkeep][packed[pkeep] >= 12] - 12).tolist() == alone[keep].tolist()


def test_over_budget_keeps_a_subset_of_the_candidates():
    anchors, keep = sample(num_anchors=100, budget=5)
    assert keep.all() and len(set(anchors.tolist())) == 5
    assert set(anchors.tolist()) <= {4, 5, 6, 7, 8, 9, 10, 14, 15, 18}
    assert torch.equal(anchors, sample(num_anchors=100, budget=5)[0])


def test_draw_is_uniform_over_candidates():
    # 400 epochs x 3 of 7 candidates of doc 7: each candidate expected 400*3/7 ~ 171 times.
    counts = torch.zeros(24)
    for epoch in range(400):
        anchors, keep = sample(epoch=epoch, budget=8)
        counts[anchors[keep][anchors[keep] < 12]] += 1
    hits = counts[4:11]
    assert counts.sum() == 1200 and hits.sum() == 1200
    assert ((hits - 1200 / 7).abs() < 40).all(), hits.tolist()  # about 4 standard deviations


def test_errors_name_the_mismatch():
    with pytest.raises(ValueError, match="1 sample ids given for 2 documents"):
        sample(ids=("a",))
    loss_mask, docs = stream()
    docs[0] = 9  # doc 9 appears in two places
    with pytest.raises(ValueError, match="not contiguous"):
        sample(s=(loss_mask, docs))
