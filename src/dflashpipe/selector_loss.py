"""DFlash2's selector term (issue 63; DFLASH2.md, "How peers train it"): the candidate
selector's K-way cross-entropy over the unary top K that loss.dflash_loss found in its chunks.

At drafted slot k the selector scores each of the unary top K as its unary logit plus the
selector's edge from the previous token (teacher-forced: the true x_{a+k-1}, the anchor at
k = 1); the loss is the K-way cross-entropy of the gold token, slots weighted as the decay
cross-entropy's. A gold token outside the top K is skipped or takes the weakest place
(OUTSIDE_TOP_K); the unary logits' gradient flows back through the frozen head chunk by chunk
(_CandidateLogits), so no (N, V) logits exist.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dflashpipe.loss import UnaryTopK, chain_counts, slot_weights

OUTSIDE_TOP_K = ("skip", "replace")


def block_previous(input_ids: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """(A, B) the token before each slot's: x_{a+k-1} (slot 1: the anchor x_a; slot 0 and
    positions past the stream clamped, their slots are invalid)."""
    at = anchors[:, None] - 1 + torch.arange(block_size, device=anchors.device)  # (A, B)
    return input_ids[at.clamp(0, input_ids.shape[0] - 1)]


def selector_loss(
    selector: torch.nn.Module, hidden: Tensor, lm_head_weight: Tensor, labels: Tensor,
    valid: Tensor, previous: Tensor, top: UnaryTopK, gamma: float, *,
    outside_top_k: str = "skip", stop_gradient: bool = False, chunk_rows: int = 1024,
) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """The selector's K-way cross-entropy (float32 scalar) and its metrics (tensors, no sync).

    hidden (A, B, H) the drafter's final states, as dflash_loss took them; labels, valid,
    previous (A, B) (block_labels, block_previous); top: dflash_loss's UnaryTopK of the same
    rows. outside_top_k: a gold token outside the top K "skip"s its slot (no loss) or
    "replace"s the weakest candidate (its unary logit too). stop_gradient: the term trains the
    selector only (hidden and the unary logits detached). Metrics (B-1,) per slot, over valid
    labels: "top_k_hits" (gold in the unary top K), "selector_correct" (teacher-forced argmax is
    gold), "path_correct" (the greedy walk from the anchor on its own choices is gold),
    "path_chain" (its slots 1..k all gold: the chain verification accepts), and
    "selector_loss" ()."""
    if outside_top_k not in OUTSIDE_TOP_K:
        raise ValueError(f"outside_top_k {outside_top_k!r} is not one of {OUTSIDE_TOP_K}")
    A, B, H = hidden.shape
    K = top.ids.shape[-1]
    rows = hidden[:, 1:].reshape(-1, H)  # (N, H)
    gold, ok = labels[:, 1:].flatten(), valid[:, 1:].flatten()  # (N,)
    hits = top.ids == gold[:, None]  # (N, K)
    inside = hits.any(-1)  # (N,)
    ids, unary, where = top.ids, top.logits, hits.int().argmax(-1)  # where: gold's place
    if outside_top_k == "replace":
        weakest = torch.arange(K, device=ids.device) == K - 1  # (K,)
        swap = ~inside[:, None] & weakest  # (N, K)
        ids = torch.where(swap, gold[:, None], ids)
        unary = torch.where(swap, top.label_logit[:, None], unary)
        where = torch.where(inside, where, K - 1)
        used = ok
    else:
        used = ok & inside
    if stop_gradient:
        rows = rows.detach()
    elif torch.is_grad_enabled() and rows.requires_grad:  # the unary logits' gradient, chunked
        unary = _CandidateLogits.apply(rows, lm_head_weight, ids, unary, chunk_rows)
    scores = unary + selector.edge_scores(rows.float(), previous[:, 1:].flatten(), ids).float()
    ce = F.cross_entropy(scores, where, reduction="none")  # (N,)
    w = (slot_weights(B, gamma, hidden.device)[1:] * valid[:, 1:]).flatten() * used  # (N,)
    loss = (w * ce).sum() / w.sum().clamp_min(1e-12)
    with torch.no_grad():
        chosen = scores.argmax(-1) == where  # (N,)
        path = _walk(selector, rows, top, previous[:, 1], A, B)  # (A, B-1)
        on_path = ((path.flatten() == gold) & ok).view(A, B - 1)
        metrics = {
            "selector_loss": loss.detach(),
            "top_k_hits": (inside & ok).view(A, B - 1).sum(0),
            "selector_correct": (chosen & inside & ok).view(A, B - 1).sum(0),
            "path_correct": on_path.sum(0),
            "path_chain": chain_counts(on_path),
        }
    return loss, metrics


def _walk(selector, rows: Tensor, top: UnaryTopK, anchor: Tensor, A: int, B: int):
    """The selector's greedy path over the B-1 drafted slots of each block (its own previous
    choices, from the anchor), from the rows' unary top K: (A, B-1) path ids."""
    h, K = rows.detach().float().view(A, B - 1, -1), top.ids.shape[-1]
    unary, ids = top.logits.view(A, B - 1, K), top.ids.view(A, B - 1, K)
    return selector.walk_top_k(h, unary, ids, anchor)[0]


class _CandidateLogits(torch.autograd.Function):
    """The unary logits of each row's candidates, z_ik = rows_i . W[ids_ik] (N, K), given as
    `values` (found by the chunk kernel); backward gathers W's rows chunk by chunk, so at most
    (chunk, K, H) of them exist."""

    @staticmethod
    def forward(ctx, rows, weight, ids, values, chunk_rows):
        ctx.save_for_backward(weight, ids)
        ctx.chunk_rows, ctx.dtype = chunk_rows, rows.dtype
        return values.clone()

    @staticmethod
    def backward(ctx, grad):
        weight, ids = ctx.saved_tensors
        out = torch.empty(ids.shape[0], weight.shape[1], device=grad.device, dtype=ctx.dtype)
        for s in range(0, ids.shape[0], ctx.chunk_rows):
            e = s + ctx.chunk_rows  # (c, K) x (c, K, H) -> (c, H)
            out[s:e] = torch.einsum("ck,ckh->ch", grad[s:e].to(weight.dtype), weight[ids[s:e]])
        return out, None, None, None, None
