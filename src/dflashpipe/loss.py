"""The DFlash training objective: position-weighted cross-entropy over the block slots.

Slot k (1..B-1) of the block anchored at a predicts x_{a+k} (same position, no shift); slot 0 holds
the known token x_a and carries no loss. A label counts only where a+k is inside the anchor's
document and supervised (loss_mask = 1). Earlier slots matter more, because a draft is accepted
only up to its first miss: w_k = exp(-(k-1)/gamma), normalized by the weight of the valid labels.

With soft targets (train.distill_weight = d > 0) each slot's term is (1 - d) CE(x_{a+k}) +
d KL(p || q): p the target's distribution over x_{a+k} (its top-k from extract, renormalized over
those k ids; the target predicted x_{a+k} at position a+k-1), q the drafter's softmax over the
whole vocabulary. Same slot weights, same valid labels.

With a ranking term (train.rank_weight = r > 0; issue 24's tree-aware lever) a slot also pays
r softplus(z_c - z_label), z the drafter's logits and c the train.rank_k-th most likely token other
than the label: small once the label is among the rank_k tokens DDTree's tree search takes from
the slot (evaluate.tree_top_k), large while it is not; cross-entropy keeps the rest of the share.

The LM head is the target's (vocabularies of 150k+), so full float32 logits for a whole batch
would be gigabytes. The head and the cross-entropy run together over chunks of rows; each chunk
writes its loss and its gradient with respect to the hidden states at once (the head is frozen,
so that is the only gradient), and only (chunk, V) logits exist at any time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

# gamma by block size, as published (B=16: 7, B=10: 5, B=8: 4).
KNOWN_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
_CHUNK_KERNELS: dict[tuple[bool, bool], Callable] = {}
# Elements of one chunk's (rows, V) float32 logits (640 MiB): Qwen3's 151,936-token vocabulary
# keeps its 1,024-row chunks (those of the MFU calibration), Gemma 3's 262,144 gets 640 rows.
LOGITS_BUDGET = 160 * 2**20


def logit_rows(vocab: int, most: int) -> int:
    """Rows of (rows, vocab) float32 logits one chunk may hold: at most `most`, within
    LOGITS_BUDGET (the LM head of train's loss and of extract's soft targets)."""
    return max(1, min(most, LOGITS_BUDGET // vocab))


def default_gamma(block_size: int) -> float:
    if block_size not in KNOWN_GAMMA:
        raise ValueError(
            f"no published loss decay gamma for block_size {block_size} (known: "
            f"{sorted(KNOWN_GAMMA)}); set gamma explicitly"
        )
    return KNOWN_GAMMA[block_size]


def slot_weights(block_size: int, gamma: float, device: torch.device | None = None) -> Tensor:
    """(B,) weights: 0 for slot 0, exp(-(k-1)/gamma) for slot k >= 1."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    return torch.where(k > 0, torch.exp(-(k - 1) / gamma), torch.zeros_like(k))


def block_labels(
    input_ids: Tensor,
    document_ids: Tensor,
    loss_mask: Tensor,
    anchors: Tensor,
    keep: Tensor,
    block_size: int,
) -> tuple[Tensor, Tensor]:
    """Labels (A, B) = x_{a+k} and valid (A, B) bool: in-document, supervised, kept, k >= 1."""
    T = input_ids.shape[0]
    pos = anchors[:, None] + torch.arange(block_size, device=anchors.device)  # (A, B)
    at = pos.clamp(max=T - 1)  # a block may run past the stream; those slots are invalid below
    valid = (
        (pos < T)
        & (document_ids[at] == document_ids[anchors][:, None])
        & loss_mask[at].bool()
        & keep[:, None].bool()
    )
    valid[:, 0] = False
    return torch.where(valid, input_ids[at], 0), valid


def block_soft_targets(
    topk_ids: Tensor, topk_logprobs: Tensor, anchors: Tensor, block_size: int
) -> tuple[Tensor, Tensor]:
    """The target's top-k over each slot's label: (A, B, k) ids and log-probs.

    topk_ids, topk_logprobs (T, k): row t is the target's distribution over x_{t+1} (extract
    stores the LM head's output at t). Slot j's label is x_{a+j}, so its soft target is row
    a+j-1 (row a-1 for slot 0, clamped: slot 0 carries no loss). Rows past the stream are
    clamped too; block_labels marks those slots invalid."""
    T = topk_ids.shape[0]
    at = anchors[:, None] - 1 + torch.arange(block_size, device=anchors.device)  # (A, B)
    at = at.clamp(0, T - 1)
    return topk_ids[at], topk_logprobs[at]


def dflash_loss(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    valid: Tensor,
    gamma: float,
    chunk_rows: int = 1024,
    compile: bool | None = None,
    soft: tuple[Tensor, Tensor] | None = None,
    distill_weight: float = 0.0,
    rank_weight: float = 0.0,
    rank_k: int = 8,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Weighted CE (mixed with the soft-target KL) of the drafter's block outputs, and metrics as
    tensors (no host sync).

    hidden (A, B, H) from the drafter; lm_head_weight (V, H) frozen; labels, valid (A, B);
    soft: (A, B, k) top-k ids and log-probs from block_soft_targets, needed when distill_weight
    (the KL's share, in [0, 1]) is > 0. rank_weight: the share of the ranking term (the label
    among the drafter's rank_k most likely tokens: softplus(the rank_k-th largest other logit -
    the label's)); cross-entropy takes 1 - distill_weight - rank_weight. Returns the scalar
    float32 loss and {"slot_accuracy": (B-1,), "acceptance_length": (), "slot_labels": (B-1,)
    valid-label counts}. compile: default on CUDA.
    """
    if lm_head_weight.requires_grad:
        raise ValueError("lm_head_weight requires grad; the target's LM head must stay frozen")
    if not 0 <= distill_weight <= 1:
        raise ValueError(f"distill_weight {distill_weight} is not a share in [0, 1]")
    if not 0 <= rank_weight <= 1 - distill_weight:
        raise ValueError(
            f"rank_weight {rank_weight} with distill_weight {distill_weight}: the shares must "
            "be >= 0 and sum to at most 1"
        )
    if rank_weight and not 1 <= rank_k < lm_head_weight.shape[0]:
        raise ValueError(f"rank_k {rank_k} is not in [1, vocabulary {lm_head_weight.shape[0]})")
    if distill_weight and soft is None:
        raise ValueError(f"distill_weight {distill_weight} needs the soft targets (soft=)")
    A, B, H = hidden.shape
    w = slot_weights(B, gamma, hidden.device)[1:] * valid[:, 1:]  # (A, B-1)
    row_weights = (w / w.sum().clamp_min(1e-12)).flatten()  # (A*(B-1),)
    rows = hidden[:, 1:].reshape(-1, H)  # (A*(B-1), H)
    soft_ids = soft_logprobs = None
    if distill_weight:
        soft_ids = soft[0][:, 1:].flatten(0, 1).long()  # (A*(B-1), k)
        soft_logprobs = soft[1][:, 1:].flatten(0, 1).float()  # (A*(B-1), k)
    compile = hidden.is_cuda if compile is None else compile
    mix = (float(distill_weight), float(rank_weight), int(rank_k))
    loss, correct = _LinearCrossEntropy.apply(
        rows, lm_head_weight, labels[:, 1:].flatten(), row_weights, chunk_rows, compile,
        soft_ids, soft_logprobs, mix,
    )  # fmt: skip
    return loss, slot_metrics(correct.view(A, B - 1), valid[:, 1:])


def slot_metrics(correct: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """Per-slot accuracy over valid labels and the acceptance length it implies.

    correct, valid (A, B-1) bool. Expected acceptance = 1 + sum_k prod_{j<=k} acc_j: a draft
    runs until its first miss, and the verify step always yields one token of its own.
    """
    count = valid.sum(0)  # (B-1,)
    accuracy = (correct & valid).sum(0) / count.clamp_min(1)  # (B-1,)
    return {
        "slot_accuracy": accuracy,
        "acceptance_length": 1 + accuracy.cumprod(0).sum(),
        "slot_labels": count,
    }


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i row_weight_i * [(1 - d - r) CE(z_i, label_i) + d KL(p_i || softmax(z_i)) + r
    softplus(z_i[c_i] - z_i[label_i])], z_i = rows_i @ W^T, chunked; grad only for the rows.
    mix = (d, r, k): distill and rank weights, rank k; p_i = softmax(soft_logprobs_i) on
    soft_ids_i (nothing elsewhere); c_i the k-th most likely token other than the label."""

    @staticmethod
    def forward(ctx, rows, weight, labels, row_weights, chunk_rows, compile, soft_ids,
                soft_logprobs, mix):  # fmt: skip
        need_grad = ctx.needs_input_grad[0]
        N = rows.shape[0]
        # Equal chunks: one compiled shape for every chunk. Rows come in a fixed count per step,
        # so fewer rows than a chunk make one chunk of their own size, not one padded to
        # chunk_rows (112 rows padded to 1,024 made a CPU step 9x the work).
        chunk_rows = max(1, min(logit_rows(weight.shape[0], chunk_rows), N))
        pad = -N % chunk_rows
        rows_p = F.pad(rows, (0, 0, 0, pad))
        labels_p = F.pad(labels, (0, pad))
        weights_p = F.pad(row_weights, (0, pad))
        soft = () if soft_ids is None else (
            F.pad(soft_ids, (0, 0, 0, pad)), F.pad(soft_logprobs, (0, 0, 0, pad))
        )  # fmt: skip
        kernel = _chunk_kernel(need_grad, compile, mix)
        loss = torch.zeros((), device=rows.device, dtype=torch.float32)
        correct = torch.empty(N + pad, device=rows.device, dtype=torch.bool)
        grad = torch.empty_like(rows_p) if need_grad else None
        for s in range(0, N + pad, chunk_rows):
            e = s + chunk_rows
            chunk_loss, correct[s:e], chunk_grad = kernel(
                rows_p[s:e], weight, labels_p[s:e], weights_p[s:e], *(t[s:e] for t in soft)
            )
            loss += chunk_loss
            if need_grad:
                grad[s:e] = chunk_grad
        ctx.save_for_backward(grad[:N] if need_grad else None)
        ctx.mark_non_differentiable(correct)
        return loss, correct[:N]

    @staticmethod
    def backward(ctx, grad_loss, grad_correct):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), *[None] * 8


def _chunk_loss(
    rows: Tensor, weight: Tensor, labels: Tensor, row_weights: Tensor, need_grad: bool,
    mix: tuple[float, float, int] = (0.0, 0.0, 8), soft_ids: Tensor | None = None,
    soft_logprobs: Tensor | None = None,
):  # fmt: skip
    distill_weight, rank_weight, rank_k = mix
    hard = 1 - distill_weight - rank_weight
    logits = (rows @ weight.T).float()  # (c, V)
    lse = logits.logsumexp(-1)  # (c,)
    picked = logits.gather(1, labels[:, None])[:, 0]  # (c,)
    per_row = hard * (lse - picked)  # (c,) CE
    if distill_weight:
        log_p = soft_logprobs.log_softmax(-1)  # (c, k) the target's top-k, renormalized
        p = log_p.exp()
        log_q = logits.gather(1, soft_ids) - lse[:, None]  # (c, k) the drafter's, same ids
        per_row = per_row + distill_weight * (p * (log_p - log_q)).sum(-1)  # KL
    if rank_weight:
        # The label ranks among the k most likely iff it beats the k-th most likely other token.
        others = logits.scatter(1, labels[:, None], float("-inf"))
        kth, kth_ids = others.topk(rank_k, -1)  # (c, k)
        margin = kth[:, -1] - picked  # (c,)
        per_row = per_row + rank_weight * F.softplus(margin)
    loss = (per_row * row_weights).sum()
    correct = logits.argmax(-1) == labels
    if not need_grad:
        return loss, correct, None
    # d CE / d logits = softmax - onehot(label); d KL / d logits = softmax - p on the k ids
    # (p sums to 1); d rank / d logits = sigmoid(margin) (onehot(c) - onehot(label)). Mixed:
    # (1 - r) softmax - (1 - d - r) onehot - d p + r sigmoid (onehot(c) - onehot(label)).
    dlogits = torch.exp(logits - lse[:, None]) * (1 - rank_weight)  # (c, V)
    dlogits.scatter_add_(1, labels[:, None], torch.full_like(picked, -hard)[:, None])
    if distill_weight:
        dlogits.scatter_add_(1, soft_ids, -distill_weight * p)
    if rank_weight:
        push = rank_weight * torch.sigmoid(margin)[:, None]  # (c, 1)
        dlogits.scatter_add_(1, kth_ids[:, -1:], push)
        dlogits.scatter_add_(1, labels[:, None], -push)
    dlogits = dlogits * row_weights[:, None]
    return loss, correct, dlogits.to(rows.dtype) @ weight  # (c, H)


def _chunk_kernel(need_grad: bool, compile: bool, mix: tuple[float, float, int]) -> Callable:
    key = (need_grad, compile, mix)
    if key not in _CHUNK_KERNELS:

        def kernel(rows, weight, labels, row_weights, *soft):
            return _chunk_loss(rows, weight, labels, row_weights, need_grad, mix, *soft)

        # Compiled, softmax, the one-hot subtraction and the weighting fuse into the logits'
        # epilogue instead of each writing a (chunk, V) float32 tensor.
        _CHUNK_KERNELS[key] = torch.compile(kernel, dynamic=False) if compile else kernel
    return _CHUNK_KERNELS[key]
