"""The weighted block loss against a plain dense implementation, labels, and metrics."""

import math

import pytest
import torch
import torch.nn.functional as F

from dflashpipe.loss import block_labels, default_gamma, dflash_loss, slot_metrics, slot_weights


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
