"""DFlash2's selector term (selector_loss.py) against float64 loops over every slot: values,
gradients, the top K found in the loss's chunks, stop-gradient, refusals."""

import pytest
import torch

from dflashpipe.loss import dflash_loss, slot_weights


# Issue 63: the DFlash2 selector's K-way cross-entropy over the unary top K (found inside the
# loss's chunks), predecessor teacher-forced, against float64 loops over every slot.
def _selector_case(seed: int = 0):
    from dflashpipe.dflash2 import CandidateSelector
    from dflashpipe.selector_loss import block_previous

    torch.manual_seed(seed)
    A, B, H, V, K, R = 3, 5, 8, 20, 4, 6
    hidden = torch.randn(A, B, H, requires_grad=True)
    W = torch.randn(V, H)
    labels = torch.randint(0, V, (A, B))
    valid = torch.rand(A, B) > 0.2
    valid[:, 0] = False
    stream = torch.randint(0, V, (40,))
    previous = block_previous(stream, torch.tensor([0, 10, 20]), B)
    selector = CandidateSelector(V, H, R, K)
    torch.nn.init.normal_(selector.successor_codebook)  # a trained-looking edge, not zeros
    return hidden, W, labels, valid, previous, selector, stream


def _selector_reference(hidden, W, labels, valid, previous, selector, gamma, policy, stop):
    """float64 loop: per valid slot, the top K of z = W h, gold outside them skipped or put in
    the weakest place, score = z[c] + <pred[prev] * P h, succ[c]>, decay-weighted CE."""
    h = hidden.detach().double().requires_grad_()
    P = selector.predecessor_codebook.detach().double().requires_grad_()
    S = selector.successor_codebook.detach().double().requires_grad_()
    Hp = selector.hidden_projection.weight.detach().double().requires_grad_()
    w = slot_weights(hidden.shape[1], gamma).double()
    total, norm, outside = 0.0, 0.0, 0
    for a, k in valid.nonzero().tolist():
        x = h[a, k].detach() if stop else h[a, k]
        z = W.double() @ x  # (V,)
        top = z.topk(4).indices
        gold = int(labels[a, k])
        if gold not in top.tolist():
            outside += 1
            if policy == "skip":
                continue
            top = torch.cat([top[:-1], torch.tensor([gold])])
        scores = z[top] + S[top] @ (P[previous[a, k]] * (Hp @ x))  # (K,)
        at = top.tolist().index(gold)
        total = total + w[k] * (scores.logsumexp(0) - scores[at])
        norm += float(w[k])
    return total / norm, (h, Hp, P, S), outside


@pytest.mark.parametrize("policy", ["skip", "replace"])
def test_selector_loss_and_gradients_equal_a_float64_reference(policy):
    """Both outside-top-K policies: loss and the gradients in the drafter's states and in the
    selector's three factors equal autograd of a float64 loop (chunks of 4 rows: the top K is
    found chunk by chunk, the unary logits' gradient gathered chunk by chunk)."""
    from dflashpipe.selector_loss import selector_loss

    hidden, W, labels, valid, previous, selector, _ = _selector_case()
    _, m = dflash_loss(hidden, W, labels, valid, 2.0, chunk_rows=4, top_k=4)
    loss, metrics = selector_loss(selector, hidden, W, labels, valid, previous, m["top_k"], 2.0,
                                  outside_top_k=policy, chunk_rows=4)  # fmt: skip
    ref, leaves, outside = _selector_reference(hidden, W, labels, valid, previous, selector, 2.0,
                                               policy, stop=False)  # fmt: skip
    assert outside > 0  # the policies differ on this case
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    mine = torch.autograd.grad(loss, [hidden, selector.hidden_projection.weight,
                                      selector.predecessor_codebook, selector.successor_codebook])  # fmt: skip
    theirs = torch.autograd.grad(ref, leaves)
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)
    hits = metrics["top_k_hits"].sum().item()
    assert hits == int(valid.sum()) - outside and metrics["selector_loss"] == loss.detach()


def test_bf16_top_k_is_taken_before_the_float_copy_with_the_same_values():
    """In bf16 (the GPU's autocast) the chunk kernel takes the top K of the bf16 products: the
    float32 logits' top K exactly (a bf16 product is exact in float32), returned in float32."""
    hidden, W, labels, valid, *_ = _selector_case(2)
    hidden, W = hidden.detach().bfloat16(), W.bfloat16()
    _, m = dflash_loss(hidden, W, labels, valid, 2.0, chunk_rows=5, top_k=4)
    values, ids = (hidden[:, 1:] @ W.T).float().topk(4, -1)
    assert m["top_k"].logits.dtype == torch.float32
    assert torch.equal(m["top_k"].logits, values.flatten(0, 1))
    assert torch.equal(m["top_k"].ids, ids.flatten(0, 1))


def test_unary_top_k_found_in_chunks_and_the_path_is_the_selectors_walk():
    """The top K the chunk kernel keeps is torch.topk of the whole logits (padded last chunk
    too); path_correct counts the slots where CandidateSelector.walk over the whole logits,
    from the anchor on its own choices, gives the label; selector_correct is teacher-forced."""
    from dflashpipe.selector_loss import selector_loss

    hidden, W, labels, valid, previous, selector, _ = _selector_case(1)
    _, m = dflash_loss(hidden.detach(), W, labels, valid, 2.0, chunk_rows=5, top_k=4)
    logits = hidden.detach()[:, 1:] @ W.T  # (A, B-1, V)
    values, ids = logits.topk(4, -1)
    torch.testing.assert_close(m["top_k"].logits, values.flatten(0, 1))
    assert torch.equal(m["top_k"].ids, ids.flatten(0, 1))
    with torch.no_grad():
        _, metrics = selector_loss(selector, hidden, W, labels, valid, previous, m["top_k"], 2.0)
        path, cands, scores = selector.walk(hidden[:, 1:], logits, previous[:, 1])
    gold, ok = labels[:, 1:], valid[:, 1:]
    assert torch.equal(metrics["path_correct"], ((path == gold) & ok).sum(0))
    chains = [sum(all(path[a, j] == gold[a, j] and ok[a, j] for j in range(k + 1))
                  for a in range(path.shape[0])) for k in range(path.shape[1])]  # fmt: skip
    assert metrics["path_chain"].tolist() == chains
    assert torch.equal(metrics["top_k_hits"], ((cands == gold[..., None]).any(-1) & ok).sum(0))
    # teacher-forced: the previous token is the true one, not the walk's choice
    forced = logits.topk(4, -1).values + selector.edge_scores(hidden[:, 1:], previous[:, 1:], cands)
    picked = cands.gather(-1, forced.argmax(-1, keepdim=True))[..., 0]
    assert torch.equal(metrics["selector_correct"], ((picked == gold) & ok).sum(0))


def test_stop_gradient_keeps_the_selector_term_out_of_the_backbone():
    """stop_gradient: the drafter's states get exactly the unary loss's gradient, the selector
    its own; without it the selector term reaches the states too."""
    from dflashpipe.selector_loss import selector_loss

    hidden, W, labels, valid, previous, selector, _ = _selector_case(2)

    def grads(stop: bool | None):
        hidden.grad = None
        selector.zero_grad()
        unary, m = dflash_loss(hidden, W, labels, valid, 2.0, top_k=4)
        total = unary
        if stop is not None:
            term, _ = selector_loss(selector, hidden, W, labels, valid, previous, m["top_k"], 2.0,
                                    outside_top_k="replace", stop_gradient=stop)  # fmt: skip
            total = unary + 0.7 * term
        total.backward()
        return hidden.grad.clone(), selector.hidden_projection.weight.grad

    alone, none = grads(None)
    stopped, sel_stopped = grads(True)
    through, _ = grads(False)
    assert none is None and torch.equal(stopped, alone)
    assert sel_stopped is not None and sel_stopped.abs().sum() > 0
    assert not torch.allclose(through, alone)


def test_selector_loss_refuses_an_unknown_policy():
    from dflashpipe.selector_loss import selector_loss

    hidden, W, labels, valid, previous, selector, _ = _selector_case()
    _, m = dflash_loss(hidden.detach(), W, labels, valid, 2.0, top_k=4)
    with pytest.raises(ValueError, match="outside_top_k 'drop'"):
        selector_loss(selector, hidden, W, labels, valid, previous, m["top_k"], 2.0,
                      outside_top_k="drop")  # fmt: skip
