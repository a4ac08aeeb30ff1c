"""The DFlash training objective: position-weighted cross-entropy over the block slots.

Slot k (1..B-1) of the block anchored at a predicts x_{a+k} (same position, no shift); slot 0 holds
the known token x_a and carries no loss. A label counts only where a+k is inside the anchor's
document and supervised (loss_mask = 1). Earlier slots matter more, because a draft is accepted
only up to its first miss: w_k = exp(-(k-1)/gamma), normalized by the weight of the valid labels.

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


def dflash_loss(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    valid: Tensor,
    gamma: float,
    chunk_rows: int = 1024,
    compile: bool | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Weighted CE of the drafter's block outputs, and metrics as tensors (no host sync).

    hidden (A, B, H) from the drafter; lm_head_weight (V, H) frozen; labels, valid (A, B).
    Returns the scalar float32 loss and {"slot_accuracy": (B-1,), "acceptance_length": (),
    "slot_labels": (B-1,) valid-label counts}. compile: default on CUDA.
    """
    if lm_head_weight.requires_grad:
        raise ValueError("lm_head_weight requires grad; the target's LM head must stay frozen")
    A, B, H = hidden.shape
    w = slot_weights(B, gamma, hidden.device)[1:] * valid[:, 1:]  # (A, B-1)
    row_weights = (w / w.sum().clamp_min(1e-12)).flatten()  # (A*(B-1),)
    rows = hidden[:, 1:].reshape(-1, H)  # (A*(B-1), H)
    compile = hidden.is_cuda if compile is None else compile
    loss, correct = _LinearCrossEntropy.apply(
        rows, lm_head_weight, labels[:, 1:].flatten(), row_weights, chunk_rows, compile
    )
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
    """sum_i row_weight_i * CE(rows_i @ W^T, label_i), chunked; grad only for the rows."""

    @staticmethod
    def forward(ctx, rows, weight, labels, row_weights, chunk_rows, compile):
        need_grad = ctx.needs_input_grad[0]
        N = rows.shape[0]
        # Equal chunks: one compiled shape for every chunk. Rows come in a fixed count per step,
        # so fewer rows than a chunk make one chunk of their own size, not one padded to
        # chunk_rows (112 rows padded to 1,024 made a CPU step 9x the work).
        chunk_rows = max(1, min(chunk_rows, N))
        pad = -N % chunk_rows
        rows_p = F.pad(rows, (0, 0, 0, pad))
        labels_p = F.pad(labels, (0, pad))
        weights_p = F.pad(row_weights, (0, pad))
        kernel = _chunk_kernel(need_grad, compile)
        loss = torch.zeros((), device=rows.device, dtype=torch.float32)
        correct = torch.empty(N + pad, device=rows.device, dtype=torch.bool)
        grad = torch.empty_like(rows_p) if need_grad else None
        for s in range(0, N + pad, chunk_rows):
            e = s + chunk_rows
            chunk_loss, correct[s:e], chunk_grad = kernel(
                rows_p[s:e], weight, labels_p[s:e], weights_p[s:e]
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
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None


def _chunk_loss(rows: Tensor, weight: Tensor, labels: Tensor, row_weights: Tensor, need_grad: bool):
    logits = (rows @ weight.T).float()  # (c, V)
    lse = logits.logsumexp(-1)  # (c,)
    picked = logits.gather(1, labels[:, None])[:, 0]  # (c,)
    loss = ((lse - picked) * row_weights).sum()
    correct = logits.argmax(-1) == labels
    if not need_grad:
        return loss, correct, None
    # d CE / d logits = softmax - onehot(label), scaled by the row's weight.
    dlogits = torch.exp(logits - lse[:, None])  # (c, V)
    dlogits.scatter_add_(1, labels[:, None], -torch.ones_like(picked)[:, None])
    dlogits = dlogits * row_weights[:, None]
    return loss, correct, dlogits.to(rows.dtype) @ weight  # (c, H)


def _chunk_kernel(need_grad: bool, compile: bool) -> Callable:
    key = (need_grad, compile)
    if key not in _CHUNK_KERNELS:

        def kernel(rows, weight, labels, row_weights):
            return _chunk_loss(rows, weight, labels, row_weights, need_grad)

        # Compiled, softmax, the one-hot subtraction and the weighting fuse into the logits'
        # epilogue instead of each writing a (chunk, V) float32 tensor.
        _CHUNK_KERNELS[key] = torch.compile(kernel, dynamic=False) if compile else kernel
    return _CHUNK_KERNELS[key]
