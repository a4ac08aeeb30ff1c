"""The weighted block loss against a plain dense implementation, labels, and metrics."""

import math
import re

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


def test_chain_acceptance_follows_each_blocks_chain_to_its_first_miss():
    """Misses that cluster in hard blocks: per-slot rates 1/2, 1/2, 3/4, so the product of rates
    gives 1 + 1/2 + 1/4 + 3/16; the chains (two blocks all right, two missing slot 1) give 2.5.
    A right slot after a miss (block 3, slot 3) counts for the rate, not for the chain."""
    from dflashpipe.metrics import chain_acceptance

    correct = torch.tensor([[1, 1, 1], [1, 1, 1], [0, 0, 0], [0, 0, 1]], dtype=torch.bool)
    valid = torch.ones(4, 3, dtype=torch.bool)
    m = slot_metrics(correct, valid)
    torch.testing.assert_close(m["acceptance_length"], torch.tensor(1.9375))
    assert m["slot_chain"].tolist() == [2, 2, 2]
    assert chain_acceptance(m["slot_chain"].tolist(), m["slot_labels"].tolist()) == 2.5
    # an unlabelled slot (the answer ended) counts in neither the chain nor its denominator
    valid[1, 2] = False
    m = slot_metrics(correct, valid)
    assert m["slot_chain"].tolist() == [2, 2, 1] and m["slot_labels"].tolist() == [4, 4, 3]
    chain = chain_acceptance(m["slot_chain"].tolist(), m["slot_labels"].tolist())
    assert chain == pytest.approx(1 + 2 / 4 + 2 / 4 + 1 / 3)


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
    with pytest.raises(ValueError, match="needs the target.s distribution"):
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


# Issue 62: the weights decided after every chunk (decay, D-PACE, expected length), the KL's
# temperature and greedy-consistent labels. References below are plain loops in float64.


def random_blocks(seed, A=4, B=6, H=12, V=30, k=4):
    """Drafter outputs, a head, labels, valid (a mid-block gap, an all-invalid block) and the
    target's top-k per slot, sorted most likely first as extract stores them."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(A, B, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g) / 2
    labels = torch.randint(0, V, (A, B), generator=g)
    valid = torch.ones(A, B, dtype=torch.bool)
    valid[:, 0] = False
    valid[1, 3] = False  # a gap: D-PACE and expected length cut block 1's chain at slot 3
    valid[2, 4:] = False  # the block runs past its document
    valid[3] = False  # a dropped anchor
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(A * B)]).view(A, B, k)
    logprobs = torch.randn(A, B, V, generator=g).log_softmax(-1).gather(2, ids)
    order = logprobs.argsort(-1, descending=True)
    ids, logprobs = ids.gather(2, order).int(), logprobs.gather(2, order).half()
    assert (logprobs[..., :-1] >= logprobs[..., 1:]).all()  # extract's topk: most likely first
    return hidden, weight, labels, valid, (ids, logprobs)


def dense_slots(hidden, weight, labels, valid, soft, d=0.0, T=1.0):
    """Per valid slot (i, j): its loss (1 - d) CE + d T^2 KL(p_T || q_T) over the full vocabulary
    (a float64 tensor, differentiable) and its acceptance (a float, detached): q(label), or with
    d > 0 sum_v min(p_v, q_v) over the top-k at temperature 1."""
    A, B, _ = hidden.shape
    V = weight.shape[0]
    loss, accept = {}, {}
    for i in range(A):
        for j in range(1, B):
            if not valid[i, j]:
                continue
            z = hidden[i, j].double() @ weight.double().T  # (V,)
            ce = -torch.log_softmax(z, -1)[labels[i, j]]
            p = torch.zeros(V, dtype=torch.float64)
            p[soft[0][i, j].long()] = torch.softmax(soft[1][i, j].double(), -1)
            q = torch.softmax(z, -1)
            if d:
                p_t = torch.zeros(V, dtype=torch.float64)
                p_t[soft[0][i, j].long()] = torch.softmax(soft[1][i, j].double() / T, -1)
                log_q_t = torch.log_softmax(z / T, -1)
                on = p_t > 0
                kl = (p_t[on] * (p_t[on].log() - log_q_t[on])).sum()
                loss[i, j] = (1 - d) * ce + d * T * T * kl
                accept[i, j] = float(torch.minimum(p, q.detach()).sum())
            else:
                loss[i, j] = ce
                accept[i, j] = float(q.detach()[labels[i, j]])
    return loss, accept


def dpace_by_loops(accept, A, B, mix):
    """D-PACE weights as the module docstring defines them, unnormalized, as floats."""
    w = {}
    for i in range(A):
        blended = []
        for j in range(1, B):
            if (i, j) not in accept:
                break  # the chain is cut at the block's first invalid slot
            blended.append(mix + (1 - mix) * accept[i, j])
        prefix = [math.prod(blended[: k + 1]) for k in range(len(blended))]
        for j in range(1, B):
            w[i, j] = sum(prefix[j - 1 :]) if j <= len(blended) else 0.0
    return w


def test_default_is_the_old_chunk_formula_to_float32_rounding():
    """Before issue 62 the kernel multiplied each row's normalized decay weight into its dlogits
    before the matmul with the head; now it scales the gradient rows afterwards. Same numbers:
    the old formula, written out in float32 with the ranking and KL terms in the mix."""
    hidden, weight, labels, valid, soft = random_blocks(3, V=40)
    d, r, rank_k, gamma = 0.3, 0.2, 2, 4.0
    loss, _ = dflash_loss(hidden, weight, labels, valid, gamma, chunk_rows=5, soft=soft,
                          distill_weight=d, rank_weight=r, rank_k=rank_k)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, hidden)

    A, B, H = hidden.shape
    k = torch.arange(B, dtype=torch.float32)
    w = torch.where(k > 0, torch.exp(-(k - 1) / gamma), 0.0) * valid
    w = (w / w.sum()).flatten()  # (A*B,)
    rows, lab = hidden.detach().reshape(-1, H), labels.flatten()
    ids, lp = soft[0].reshape(A * B, -1).long(), soft[1].reshape(A * B, -1).float()
    z = rows @ weight.T  # (A*B, V) float32
    q = z.softmax(-1)
    p = lp.softmax(-1)
    others = z.scatter(1, lab[:, None], float("-inf"))
    kth, kth_ids = others.topk(rank_k, -1)
    margin = kth[:, -1] - z.gather(1, lab[:, None])[:, 0]
    ce = -z.log_softmax(-1).gather(1, lab[:, None])[:, 0]
    kl = (p * (p.log() - z.log_softmax(-1).gather(1, ids))).sum(-1)
    old_loss = (w * ((1 - d - r) * ce + d * kl + r * F.softplus(margin))).sum()
    dz = (1 - r) * q
    dz.scatter_add_(1, lab[:, None], torch.full((A * B, 1), -(1 - d - r)))
    dz.scatter_add_(1, ids, -d * p)
    push = r * torch.sigmoid(margin)[:, None]
    dz.scatter_add_(1, kth_ids[:, -1:], push).scatter_add_(1, lab[:, None], -push)
    old_grad = ((dz * w[:, None]) @ weight).view(A, B, H)
    torch.testing.assert_close(loss, old_loss, atol=0, rtol=1e-6)
    torch.testing.assert_close(grad, old_grad, atol=1e-7, rtol=1e-5)
    # and the new keywords at their defaults are exactly today's call
    same, _ = dflash_loss(hidden, weight, labels, valid, gamma, chunk_rows=5, soft=soft,
                          distill_weight=d, rank_weight=r, rank_k=rank_k, weighting="decay",
                          dpace_mix=0.5, objective="cross_entropy", kl_temperature=1.0)  # fmt: skip
    assert torch.equal(same, loss)


def test_dpace_and_expected_length_weights_hand_computed():
    from dflashpipe.loss import dpace_weights, expected_length_weights

    a = torch.tensor([[0.8, 0.6, 0.4], [0.5, 0.9, 0.9], [0.3, 0.3, 0.3]])
    valid = torch.tensor([[1, 1, 1], [1, 0, 1], [0, 0, 0]], dtype=torch.bool)
    # mix 0.5: blended 0.9, 0.8, 0.7 -> prefix products 0.9, 0.72, 0.504 -> suffix sums;
    # block 1 is cut at its invalid slot 2 (its valid slot 3 weighs nothing); block 2 is empty
    want = [[0.9 + 0.72 + 0.504, 0.72 + 0.504, 0.504], [0.75, 0, 0], [0, 0, 0]]
    torch.testing.assert_close(dpace_weights(a, valid, 0.5), torch.tensor(want))
    want_one = [[3.0, 2.0, 1.0], [1.0, 0, 0], [0, 0, 0]]  # mix 1: the chain's remaining length
    torch.testing.assert_close(dpace_weights(a, valid, 1.0), torch.tensor(want_one))
    # expected length: P = 0.8, 0.48, 0.192 and 0.5; two blocks with a valid slot
    loss, w = expected_length_weights(a, valid)
    torch.testing.assert_close(loss, torch.tensor(-(0.8 + 0.48 + 0.192 + 0.5) / 2))
    want_c = [[(0.8 + 0.48 + 0.192) / 2, (0.48 + 0.192) / 2, 0.192 / 2], [0.25, 0, 0], [0, 0, 0]]
    torch.testing.assert_close(w, torch.tensor(want_c))


@pytest.mark.parametrize(("distill_weight", "T", "mix"), [(0.0, 1.0, 0.5), (1.0, 2.0, 0.25)])
def test_dpace_loss_and_gradient_equal_the_dense_reference(distill_weight, T, mix):
    """D-PACE over cross-entropy (acceptance q(label)) and over the tempered KL (acceptance
    sum min(p, q)): the loss is sum w l / sum w with the weights as constants, so its gradient
    is that of the weighted losses alone (detached weights)."""
    hidden, weight, labels, valid, soft = random_blocks(4)
    A, B, _ = hidden.shape
    loss, metrics = dflash_loss(hidden, weight, labels, valid, 4.0, chunk_rows=5, soft=soft,
                                distill_weight=distill_weight, kl_temperature=T,
                                weighting="dpace", dpace_mix=mix)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, hidden)

    ref_hidden = hidden.detach().double().requires_grad_()
    slots, accept = dense_slots(ref_hidden, weight, labels, valid, soft, distill_weight, T)
    w = dpace_by_loops(accept, A, B, mix)
    assert w[1, 4] == w[1, 5] == 0 and w[0, 1] > w[0, 5] > 0  # the cut, and the decreasing sums
    ref = sum(w[s] * slots[s] for s in slots) / sum(w[s] for s in slots)
    (ref_grad,) = torch.autograd.grad(ref, ref_hidden)
    torch.testing.assert_close(loss.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-6, rtol=1e-4)
    decay, decay_metrics = dflash_loss(hidden.detach(), weight, labels, valid, 4.0, soft=soft,
                                       distill_weight=distill_weight, kl_temperature=T)  # fmt: skip
    assert abs(loss.item() - decay.item()) > 1e-3  # the weights really changed
    assert all(torch.equal(metrics[m], decay_metrics[m]) for m in metrics)


@pytest.mark.parametrize(("chunk_rows", "share"), [(3, 1.0), (4096, 1.0), (3, 0.5), (5, 0.2)])
def test_expected_length_gradient_equals_autograd_of_the_dense_objective(chunk_rows, share):
    """s x -E[tau - 1] per block + (1 - s) x decay cross-entropy, a_j = q(label_j) NOT detached:
    the kernel's mixed weights s c_j / A' + (1 - s) w_j must give exactly the gradient autograd
    finds through the prefix products and the decay-weighted log-probabilities."""
    hidden, weight, labels, valid, _ = random_blocks(5, V=12)  # a small vocabulary: a_j not tiny
    A, B, _ = hidden.shape
    gamma = 4.0
    loss, _ = dflash_loss(hidden, weight, labels, valid, gamma, chunk_rows=chunk_rows,
                          objective="expected_length", length_share=share)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, hidden)

    ref_hidden = hidden.detach().double().requires_grad_()
    z = ref_hidden @ weight.double().T  # (A, B, V): full logits, no chunks
    logp = z.log_softmax(-1).gather(2, labels[..., None])[..., 0]  # (A, B)
    a = logp.exp()
    total, blocks, ce, decay = 0.0, 0, 0.0, 0.0
    for i in range(A):
        blocks += bool(valid[i].any())
        prefix = 1.0
        for j in range(1, B):
            w = math.exp(-(j - 1) / gamma)  # cross-entropy takes every valid slot, decayed
            ce, decay = (ce - w * logp[i, j], decay + w) if valid[i, j] else (ce, decay)
        for j in range(1, B):
            if not valid[i, j]:
                break  # the chain ends at the first invalid slot
            prefix = prefix * a[i, j]
            total = total + prefix
    ref = share * -total / blocks + (1 - share) * ce / decay
    (ref_grad,) = torch.autograd.grad(ref, ref_hidden)
    assert blocks == 3
    if share == 1:  # past block 1's cut -E[tau] alone has no gradient
        assert ref_grad[1, 4:].abs().max() == 0
    torch.testing.assert_close(loss.double(), ref.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-7, rtol=1e-4)


def test_expected_length_alone_has_almost_no_gradient_from_random_weights():
    """Why -E[tau] takes a cross-entropy share: with the label's probability about 1/V (random
    weights), slot j's gradient is cross-entropy's times prod_{i<=k} a_i summed over k >= j, so
    -E[tau] alone moves the drafter about 1/V as much as cross-entropy does, and slot 2 and on
    1/V^2; the default share keeps (1 - s) of cross-entropy's pull on every slot."""
    torch.manual_seed(0)
    A, B, H, V = 16, 8, 32, 2048
    hidden = (0.01 * torch.randn(A, B, H)).requires_grad_()  # near-uniform drafter: a ~ 1/V
    weight = torch.randn(V, H)
    labels = torch.randint(0, V, (A, B))
    valid = torch.ones(A, B, dtype=torch.bool)

    def pull(**kw):  # each slot's gradient norm, (B-1,)
        loss, _ = dflash_loss(hidden, weight, labels, valid, 4.0, chunk_rows=64, **kw)
        (g,) = torch.autograd.grad(loss, hidden)
        return g[:, 1:].norm(dim=(0, 2))

    ce = pull()
    alone = pull(objective="expected_length", length_share=1.0)
    mixed = pull(objective="expected_length")  # the default share, 0.5
    assert (alone[0] / ce[0]) < 4 / V  # about 1/V of cross-entropy's on slot 1
    assert (alone[1:] / ce[1:]).max() < 1e-5  # and nothing on the later slots
    torch.testing.assert_close(mixed, 0.5 * ce, rtol=4 / V, atol=0)


@pytest.mark.parametrize("T", [0.5, 3.0])
def test_kl_temperature_equals_the_dense_reference(T):
    """(1 - d) CE + d T^2 KL(p_T || q_T) with the decay weights, against the dense float64 sum."""
    hidden, weight, labels, valid, soft = random_blocks(6)
    d, gamma = 0.6, 4.0
    loss, _ = dflash_loss(hidden, weight, labels, valid, gamma, chunk_rows=4, soft=soft,
                          distill_weight=d, kl_temperature=T)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, hidden)
    ref_hidden = hidden.detach().double().requires_grad_()
    slots, _ = dense_slots(ref_hidden, weight, labels, valid, soft, d, T)
    w = {(i, j): math.exp(-(j - 1) / gamma) for i, j in slots}
    ref = sum(w[s] * slots[s] for s in slots) / sum(w.values())
    (ref_grad,) = torch.autograd.grad(ref, ref_hidden)
    torch.testing.assert_close(loss.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-6, rtol=1e-4)
    plain, _ = dflash_loss(hidden.detach(), weight, labels, valid, gamma, soft=soft,
                           distill_weight=d)  # fmt: skip
    assert abs(loss.item() - plain.item()) > 1e-3  # the temperature is really in the loss


def test_greedy_labels_hand_made():
    from dflashpipe.loss import greedy_labels

    labels = torch.tensor([[0, 11, 12, 13, 14], [0, 21, 22, 0, 24]])
    valid = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 0, 1]], dtype=torch.bool)
    top = torch.tensor([[99, 11, 12, 50, 14], [98, 21, 22, 7, 60]])  # the target's argmax
    logprobs = torch.tensor([-0.1, -2.0, -3.5])  # (k,) most likely first, as extract sorts them
    assert (logprobs[:-1] >= logprobs[1:]).all()
    soft_ids = torch.stack([top, top + 100, top + 200], -1).int()  # (A=2, B=5, k=3)
    got, keep = greedy_labels(labels, valid, soft_ids)
    # block 0 parts from the answer at slot 3 (50, not 13): slot 3 keeps 50, slot 4 is dropped;
    # block 1's slot 3 is invalid (its label unknown), so only slot 4's 60 vs 24 parts, last
    assert keep.tolist() == [[False, True, True, True, False], [False, True, True, False, True]]
    assert got.tolist() == [[0, 11, 12, 50, 0], [0, 21, 22, 0, 60]]
    assert got.dtype == labels.dtype
    with pytest.raises(ValueError, match="soft_ids"):
        greedy_labels(labels, valid, soft_ids[:, :4])


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"weighting": "cumulative"}, "weighting 'cumulative'"),
        ({"objective": "cap"}, "objective 'cap'"),
        ({"kl_temperature": 0.0, "distill_weight": 0.5}, "kl_temperature 0.0"),
        ({"kl_temperature": -1.0, "distill_weight": 0.5}, "kl_temperature -1.0"),
        ({"kl_temperature": 2.0}, "kl_temperature 2.0 needs the KL"),
        ({"weighting": "dpace", "dpace_mix": 1.5}, "dpace_mix 1.5"),
        ({"weighting": "dpace", "dpace_mix": float("nan")}, "dpace_mix nan"),
        ({"dpace_mix": 0.3}, "dpace_mix 0.3 needs weighting 'dpace'"),
        ({"weighting": "dpace", "distill_weight": 0.5}, "distill_weight 0.5 needs the target's"),
        ({"objective": "expected_length", "weighting": "dpace"}, "weighting"),
        ({"objective": "expected_length", "distill_weight": 0.5}, "distill_weight"),
        ({"objective": "expected_length", "rank_weight": 0.5}, "rank_weight"),
        ({"objective": "expected_length", "length_share": 0.0}, "length_share 0.0 is not a share"),
        ({"objective": "expected_length", "length_share": 1.5}, "length_share 1.5 is not a share"),
        ({"objective": "expected_length", "length_share": float("nan")}, "length_share nan"),
        ({"length_share": 0.8}, "length_share 0.8 needs objective 'expected_length'"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs, named):
    hidden, weight = torch.randn(2, 4, 8), torch.randn(10, 8)
    labels, valid = torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=re.escape(named)):
        dflash_loss(hidden, weight, labels, valid, 4.0, **kwargs)


# The target's whole distribution from its final hidden states (extract.final_hidden): its logits
# made from the head inside the chunk kernel, never for the whole batch.


def dense_full_slots(hidden, weight, labels, valid, target_hidden, d, T, cap=None):
    """Per valid slot: (1 - d) CE + d T^2 KL(p_T || q_T), p the target's whole distribution from
    float64 logits of its final hidden state (tanh-capped at `cap`), and its acceptance
    sum_v min(p, q) at temperature 1 (detached)."""
    A, B, _ = hidden.shape
    loss, accept = {}, {}
    W = weight.double()
    for i in range(A):
        for j in range(1, B):
            if not valid[i, j]:
                continue
            z = hidden[i, j].double() @ W.T  # (V,)
            zt = target_hidden[i, j].double() @ W.T  # (V,) the target's logits
            if cap:
                zt = torch.tanh(zt / cap) * cap
            ce = -torch.log_softmax(z, -1)[labels[i, j]]
            log_p_t = torch.log_softmax(zt / T, -1)
            kl = (log_p_t.exp() * (log_p_t - torch.log_softmax(z / T, -1))).sum()
            loss[i, j] = (1 - d) * ce + d * T * T * kl
            accept[i, j] = float(torch.minimum(zt.softmax(-1), z.detach().softmax(-1)).sum())
    return loss, accept


@pytest.mark.parametrize(
    ("d", "T", "weighting", "cap", "chunk_rows"),
    [(1.0, 1.0, "decay", None, 5), (0.4, 2.0, "dpace", None, 4096), (1.0, 0.5, "decay", 3.0, 3)],
)
def test_full_distribution_kl_equals_the_dense_reference(d, T, weighting, cap, chunk_rows):
    """The KL against the target's whole distribution (its final hidden states through the
    frozen head, chunked with the drafter's rows): loss and gradient equal a float64 loop over
    every slot and the whole vocabulary; D-PACE's acceptance is sum min(p, q) over it."""
    hidden, weight, labels, valid, _ = random_blocks(7)
    A, B, H = hidden.shape
    target = torch.randn(A, B, H, generator=torch.Generator().manual_seed(70))
    loss, _ = dflash_loss(hidden, weight, labels, valid, 4.0, chunk_rows=chunk_rows,
                          distill_weight=d, kl_temperature=T, weighting=weighting,
                          target_hidden=target, target_softcap=cap)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, hidden)

    ref_hidden = hidden.detach().double().requires_grad_()
    slots, accept = dense_full_slots(ref_hidden, weight, labels, valid, target, d, T, cap)
    if weighting == "dpace":
        w = dpace_by_loops(accept, A, B, 0.5)
    else:
        w = {(i, j): math.exp(-(j - 1) / 4.0) for i, j in slots}
    ref = sum(w[s] * slots[s] for s in slots) / sum(w[s] for s in slots)
    (ref_grad,) = torch.autograd.grad(ref, ref_hidden)
    torch.testing.assert_close(loss.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-6, rtol=1e-4)
    hard, _ = dflash_loss(hidden.detach(), weight, labels, valid, 4.0)
    assert abs(loss.item() - hard.item()) > 1e-3  # the KL is really in the loss


def test_target_argmax_and_block_rows_come_from_the_predicting_position():
    """Slot j's label x_{a+j} was predicted at a+j-1: block_target_hidden takes that row of the
    stream's final hidden states, target_argmax the head's argmax over it (chunked), and greedy
    labels from it equal those from extract's top-1 of the same logits."""
    from dflashpipe.loss import block_target_hidden, greedy_labels, target_argmax

    g = torch.Generator().manual_seed(8)
    T, H, V, B = 12, 6, 20, 4
    final = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    anchors = torch.tensor([0, 3, 10])
    rows = block_target_hidden(final, anchors, B)  # (3, 4, H)
    assert torch.equal(rows[1, 2], final[4]) and torch.equal(rows[0, 0], final[0])  # clamped
    assert torch.equal(rows[2, 3], final[T - 1])  # past the stream: clamped (invalid slots)
    top = target_argmax(rows, weight, chunk_rows=5)
    assert torch.equal(top, (rows @ weight.T).argmax(-1))
    topk_ids = (final @ weight.T).topk(3, -1).indices.int()  # (T, 3) as extract stores them
    topk_lp = torch.zeros(T, 3, dtype=torch.float16)
    ids = torch.randint(0, V, (T,), generator=g)
    labels, valid = block_labels(ids, torch.zeros(T, dtype=torch.long), torch.ones(T), anchors,
                                 torch.ones(3, dtype=torch.bool), B)  # fmt: skip
    from_topk = greedy_labels(labels, valid, block_soft_targets(topk_ids, topk_lp, anchors, B)[0])
    from_final = greedy_labels(labels, valid, top[..., None])
    assert all(torch.equal(a, b) for a, b in zip(from_topk, from_final, strict=True))
    with pytest.raises(ValueError, match="pass one"):
        dflash_loss(torch.randn(3, B, H), weight, labels, valid, 4.0, distill_weight=1.0,
                    soft=(topk_ids[:3, None].expand(3, B, 3), topk_lp[:3, None].expand(3, B, 3)),
                    target_hidden=rows)  # fmt: skip


def test_the_kernels_defaults_are_the_schemas():
    """dflash_loss's keyword defaults and the values its refusals treat as unset are
    train.loss's schema defaults: one declaration, the other checked against it."""
    import inspect

    from dflashpipe.config import _schema
    from dflashpipe.loss import check_loss_arguments

    schema = _schema()["properties"]["train"]["properties"]["loss"]["properties"]
    for fn in (dflash_loss, check_loss_arguments):
        params = inspect.signature(fn).parameters
        for key in ("dpace_mix", "length_share", "kl_temperature", "weighting", "objective"):
            if key in params and params[key].default is not inspect.Parameter.empty:
                assert params[key].default == schema[key]["default"], (fn.__name__, key)
    hidden, weight = torch.randn(2, 4, 8), torch.randn(10, 8)
    labels, valid = torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool)
    unset = {k: schema[k]["default"] for k in ("dpace_mix", "length_share", "kl_temperature")}
    dflash_loss(hidden, weight, labels, valid, 4.0, **unset)  # the defaults pass the refusals
