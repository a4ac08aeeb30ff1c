"""The weighted block loss against a plain dense implementation, labels, and metrics."""

import math

import pytest
import torch
import torch.nn.functional as F

from dflashpipe.loss import (
    block_labels,
    block_soft_targets,
    default_gamma,
    dflash_loss,
    slot_metrics,
    slot_weights,
)


def test_gamma_defaults_by_block_size():
    assert [default_gamma(b) for b in (16, 10, 8)] == [7.0, 5.0, 4.0]
    with pytest.raises(ValueError, match="block_size 12"):
        default_gamma(12)


def test_slot_weights_decay_from_slot_one():
    w = slot_weights(4, gamma=2.0)
    torch.testing.assert_close(w, torch.tensor([0.0, 1.0, math.exp(-0.5), math.exp(-1.0)]))


def test_block_labels_hand_checked():
    # Documents: 0 = positions 0-4, 1 = positions 5-8. loss_mask 0 on 0,1 and on 5.
    ids = torch.arange(100, 109)
    docs = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 1])
    loss_mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1])
    anchors = torch.tensor([0, 3, 6, 7, 2])
    keep = torch.tensor([True, True, True, True, False])
    labels, valid = block_labels(ids, docs, loss_mask, anchors, keep, 3)
    assert valid.tolist() == [
        [False, False, True],  # slot 1 -> position 1 is unsupervised; slot 2 -> 2 is supervised
        [False, True, False],  # block of 3 runs past the end of document 0 at 4
        [False, True, True],
        [False, True, False],  # position 9 is past the end of the stream
        [False, False, False],  # dropped anchor
    ]
    assert labels[0, 2] == 102 and labels[1, 1] == 104 and labels[2].tolist() == [0, 107, 108]


def dense_reference(hidden, weight, labels, valid, gamma):
    """Full float32 logits, plain cross-entropy, the DFlash weights."""
    A, B, _ = hidden.shape
    logits = (hidden.double() @ weight.double().T)[:, 1:]  # (A, B-1, V)
    ce = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), reduction="none")
    k = torch.arange(1, B, dtype=torch.float64)
    w = torch.exp(-(k - 1) / gamma)[None] * valid[:, 1:]
    loss = (ce.view(A, B - 1) * w).sum() / w.sum()
    correct = (logits.argmax(-1) == labels[:, 1:]) & valid[:, 1:]
    accuracy = correct.sum(0) / valid[:, 1:].sum(0).clamp_min(1)
    return loss, accuracy


@pytest.mark.parametrize("chunk_rows", [5, 7, 4096])
def test_loss_and_gradient_equal_the_dense_reference(chunk_rows):
    g = torch.Generator().manual_seed(0)
    A, B, H, V = 6, 8, 16, 50
    hidden = torch.randn(A, B, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (A, B), generator=g)
    valid = torch.rand(A, B, generator=g) > 0.3
    valid[:, 0] = False
    # Make some predictions right so the accuracies are not all zero.
    labels[:, 1:3] = (hidden[:, 1:3].detach() @ weight.T).argmax(-1)

    loss, metrics = dflash_loss(hidden, weight, labels, valid, gamma=4.0, chunk_rows=chunk_rows)
    (grad,) = torch.autograd.grad(loss, hidden)

    ref_hidden = hidden.detach().double().requires_grad_()
    ref_loss, ref_acc = dense_reference(ref_hidden, weight, labels, valid, gamma=4.0)
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_hidden)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(metrics["slot_accuracy"], ref_acc.float())
    assert metrics["slot_labels"].tolist() == valid[:, 1:].sum(0).tolist()
    assert ref_acc[:2].min() > 0.9


def test_invalid_labels_do_not_change_loss_or_gradient():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 4, 8, generator=g, requires_grad=True)
    weight = torch.randn(20, 8, generator=g)
    labels = torch.randint(0, 20, (3, 4), generator=g)
    valid = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    loss, _ = dflash_loss(hidden, weight, labels, valid, gamma=7.0)
    other = torch.where(valid, labels, (labels + 3) % 20)
    loss2, _ = dflash_loss(hidden, weight, other, valid, gamma=7.0)
    assert torch.equal(loss, loss2)
    (grad,) = torch.autograd.grad(loss, hidden)
    assert grad[~valid].abs().max() == 0 and grad[valid].abs().min() > 0


def test_no_grad_mode_and_frozen_head_check():
    hidden, weight = torch.randn(2, 4, 8), torch.randn(10, 8)
    labels, valid = torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool)
    with torch.no_grad():
        loss, _ = dflash_loss(hidden, weight, labels, valid, gamma=4.0, chunk_rows=3)
    assert loss.isfinite() and not loss.requires_grad
    with pytest.raises(ValueError, match="LM head must stay frozen"):
        dflash_loss(hidden, weight.requires_grad_(), labels, valid, gamma=4.0)


def test_acceptance_length_from_slot_accuracies():
    # Slot accuracies 1, 1/2, 1/2 -> 1 + 1 + 1/2 + 1/4.
    correct = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    valid = torch.ones(4, 3, dtype=torch.bool)
    m = slot_metrics(correct, valid)
    torch.testing.assert_close(m["slot_accuracy"], torch.tensor([1.0, 0.5, 0.5]))
    torch.testing.assert_close(m["acceptance_length"], torch.tensor(2.75))


def test_soft_target_of_a_slot_is_the_targets_prediction_one_position_earlier():
    # row t of the stored top-k is the target's distribution over x_{t+1}; slot j of the block
    # anchored at a is labelled x_{a+j}, so it reads row a+j-1 (clamped at the stream's ends)
    ids = torch.arange(8)[:, None] * 10 + torch.arange(2)  # (T=8, k=2): row t holds 10t, 10t+1
    logprobs = -torch.arange(16, dtype=torch.float16).view(8, 2)
    got_ids, got_lp = block_soft_targets(ids, logprobs, torch.tensor([2, 5, 0, 7]), 3)
    assert got_ids[:, :, 0].tolist() == [[10, 20, 30], [40, 50, 60], [0, 0, 10], [60, 70, 70]]
    assert torch.equal(got_lp[1], logprobs[4:7])


def dense_distill_reference(hidden, weight, stream, anchors, keep, topk, gamma, d, r=0.0, rank_k=1):
    """Position by position, float64: the drafter's full-vocabulary log-softmax, the target's
    top-k renormalized over its k ids as a dense distribution, (1 - d - r) CE + d KL + r
    softplus(rank_k-th largest logit among the other tokens - the label's), the DFlash slot
    weights and the hard loss's masks (in-document, supervised, kept, slot >= 1)."""
    ids, docs, loss_mask = stream
    topk_ids, topk_logprobs = topk
    A, B, _ = hidden.shape
    T, V = len(ids), weight.shape[0]
    total = norm = 0.0
    for i in range(A):
        a = int(anchors[i])
        for j in range(1, B):
            p = a + j
            if not (keep[i] and p < T and docs[p] == docs[a] and loss_mask[p]):
                continue
            z = hidden[i, j].double() @ weight.double().T  # (V,)
            log_q = torch.log_softmax(z, -1)
            kl = 0.0
            if d:
                target = torch.zeros(V, dtype=torch.float64)  # the target's p(x_p): row p - 1
                lp = topk_logprobs[p - 1].double()
                target[topk_ids[p - 1]] = lp.exp() / lp.exp().sum()
                on = target > 0
                kl = (target[on] * (target[on].log() - log_q[on])).sum()
            ce = -log_q[ids[p]]
            others = torch.cat([z[: ids[p]], z[ids[p] + 1 :]])  # every token but the label
            rank = F.softplus(others.sort(descending=True).values[rank_k - 1] - z[ids[p]])
            w = math.exp(-(j - 1) / gamma)
            total = total + w * ((1 - d - r) * ce + d * kl + r * rank)
            norm += w
    return total / norm


@pytest.mark.parametrize(("distill_weight", "chunk_rows"), [(0.3, 5), (1.0, 4096)])
def test_distillation_loss_and_gradient_equal_the_dense_reference(distill_weight, chunk_rows):
    g = torch.Generator().manual_seed(2)
    T, A, B, H, V, k = 24, 7, 5, 16, 40, 4
    ids = torch.randint(0, V, (T,), generator=g)
    docs = torch.tensor([0] * 10 + [1] * 9 + [-1] * 5)  # two documents, then padding
    loss_mask = (torch.rand(T, generator=g) > 0.25).long()
    anchors = torch.tensor([0, 3, 8, 10, 14, 17, 2])  # 8: block runs into document 1
    keep = torch.tensor([True] * 6 + [False])
    topk_ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(T)]).int()
    raw = torch.randn(T, V, generator=g).log_softmax(-1)
    topk_logprobs = raw.gather(1, topk_ids.long()).sort(-1, descending=True).values.half()
    hidden = torch.randn(A, B, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g)

    labels, valid = block_labels(ids, docs, loss_mask, anchors, keep, B)
    soft = block_soft_targets(topk_ids, topk_logprobs, anchors, B)
    loss, _ = dflash_loss(hidden, weight, labels, valid, 4.0, chunk_rows=chunk_rows, soft=soft,
                          distill_weight=distill_weight)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, hidden)

    ref_hidden = hidden.detach().double().requires_grad_()
    stream, topk = (ids, docs, loss_mask), (topk_ids.long(), topk_logprobs)
    ref = dense_distill_reference(
        ref_hidden, weight, stream, anchors, keep, topk, 4.0, distill_weight
    )
    (ref_grad,) = torch.autograd.grad(ref, ref_hidden)
    torch.testing.assert_close(loss.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-6, rtol=1e-4)
    hard, _ = dflash_loss(hidden.detach(), weight, labels, valid, 4.0)
    assert abs(loss.item() - hard.item()) > 1e-3  # the soft term is really in the loss
    with pytest.raises(ValueError, match="needs the soft targets"):
        dflash_loss(hidden, weight, labels, valid, 4.0, distill_weight=distill_weight)


@pytest.mark.parametrize(
    ("distill_weight", "rank_weight", "rank_k"), [(0.0, 0.4, 3), (0.3, 0.5, 1)]
)
def test_ranking_term_equals_the_dense_reference(distill_weight, rank_weight, rank_k):
    """The tree-aware term (train.rank_weight): loss and gradient as the dense float64 sum, alone
    with cross-entropy and beside the soft-target KL; the shares are checked."""
    g = torch.Generator().manual_seed(5)
    T, A, B, H, V, k = 20, 6, 4, 8, 30, 3
    ids = torch.randint(0, V, (T,), generator=g)
    docs, loss_mask = torch.zeros(T, dtype=torch.long), torch.ones(T, dtype=torch.long)
    anchors, keep = torch.tensor([0, 2, 5, 9, 13, 18]), torch.ones(6, dtype=torch.bool)
    topk_ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(T)]).int()
    topk_logprobs = torch.randn(T, k, generator=g).log_softmax(-1).half()
    hidden = torch.randn(A, B, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g)
    labels, valid = block_labels(ids, docs, loss_mask, anchors, keep, B)
    soft = block_soft_targets(topk_ids, topk_logprobs, anchors, B)
    loss, _ = dflash_loss(hidden, weight, labels, valid, 4.0, chunk_rows=4, soft=soft,
                          distill_weight=distill_weight, rank_weight=rank_weight, rank_k=rank_k)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, hidden)
    ref_hidden = hidden.detach().double().requires_grad_()
    ref = dense_distill_reference(
        ref_hidden, weight, (ids, docs, loss_mask), anchors, keep, (topk_ids.long(), topk_logprobs),
        4.0, distill_weight, rank_weight, rank_k,
    )  # fmt: skip
    (ref_grad,) = torch.autograd.grad(ref, ref_hidden)
    torch.testing.assert_close(loss.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-6, rtol=1e-4)
    without, _ = dflash_loss(hidden.detach(), weight, labels, valid, 4.0, soft=soft,
                             distill_weight=distill_weight)  # fmt: skip
    assert abs(loss.item() - without.item()) > 1e-3  # the ranking term is really in the loss
    with pytest.raises(ValueError, match="sum to at most 1"):
        dflash_loss(hidden, weight, labels, valid, 4.0, soft=soft, distill_weight=0.6,
                    rank_weight=0.5)  # fmt: skip
    with pytest.raises(ValueError, match="rank_k 30 is not in"):
        dflash_loss(hidden, weight, labels, valid, 4.0, rank_weight=0.1, rank_k=V)
