"""The DFlash training objective: a loss per block slot, weighted once every slot is seen.

Slot k (1..B-1) of the block anchored at a predicts x_{a+k} (same position, no shift); slot 0 holds
the known token x_a and carries no loss. A label counts only where a+k is inside the anchor's
document and supervised (loss_mask = 1).

  hidden (A, B, H) -> rows (N = A*(B-1), H) -> chunks of c rows: z = rows @ W^T (c, V)
      per row: loss l_i, acceptance a_i, correct_i, unweighted gradient g_i = dl_i/drow_i (c, H)
  after the last chunk: weights w (A, B-1) from a and valid (decay | dpace | expected length)
      loss = sum_i w_i l_i; saved gradient w_i g_i (scaling rows commutes with the matmul)

Per-slot loss (objective="cross_entropy", the default): (1 - d - r) CE(x_{a+k}) + d T^2
KL(p_T || q_T) + r softplus(z_c - z_label).
- KL (train.distill_weight = d > 0, or train.loss.objective forward_kl: d = 1 - r): the target's
  distribution for x_{a+k} (it predicted x_{a+k} at position a+k-1), either its whole one,
  p_T = softmax(zt / T) with zt = h_t @ W^T from its stored final hidden state h_t
  (extract.final_hidden: the head the drafter holds applied in the same chunk as the drafter's,
  so no (N, V) target logits exist for the batch), or its top-k, p_T = softmax(log p / T) over
  extract's k ids, renormalized; q_T = softmax(z / T) over the whole vocabulary: forward KL with
  temperature T (kl_temperature, 1 by default). The T^2 is Hinton et al.'s distillation scale: the KL's gradient in the logits,
  (q_T - p_T) / T, shrinks like 1/T^2 as T grows, so without it d would mean less at every T > 1;
  with it d keeps its meaning as the soft term's share, and T = 1 is the plain KL.
- Ranking (train.rank_weight = r > 0; issue 24's tree-aware lever): c is the rank_k-th most
  likely token other than the label: small once the label is among the rank_k tokens DDTree's
  tree search takes from the slot (evaluate.tree_top_k), large while it is not.

Acceptance a_k of slot k: the drafter's probability of its label, exp(z_label - lse); with the KL
in the loss (d > 0) and D-PACE weights, sum_v min(p_v, q_v) over the target's distribution
(the top-k renormalized, or the whole vocabulary; both at temperature 1: speculative sampling's
acceptance). A block's expected accepted length is
1 + sum_k prod_{j<=k} a_j (DFLASH2.md, "Acceptance-aware objectives").

Slot weights (weighting=):
- "decay" (default): w_k = exp(-(k-1)/gamma) on valid labels, normalized by their sum: a draft is
  accepted only up to its first miss, so earlier slots matter more.
- "dpace" (D-PACE): with b_j = m + (1 - m) a_j, a_j detached and m = dpace_mix in [0, 1] (0.5 by
  default: each slot's acceptance blended halfway toward 1), slot j weighs
  sum_{k >= j} prod_{i <= k} b_i, a block's chain cut at its first invalid slot (b = 0 there and
  after); normalized by the sum over valid rows, as the decay weights are. This is the project's
  reading of DFLASH2.md's wording ("a detached estimate of how much expected length depends on
  it, the sum over later slots of the prefix products of per-slot acceptance, each blended toward
  1 by a mixing factor"): no reference code was available here.

objective="expected_length" (one peer's accept loss): -(1/A') sum_blocks sum_k prod_{j<=k} a_j,
a_j the label's probability, the chain cut at a block's first invalid slot, A' the blocks with a
valid slot (E[tau]'s constant 1 dropped). Not detached: its exact gradient in slot j's logits is
c_j / A' times cross-entropy's, c_j = sum_{k >= j} prod_{i <= k} a_i (expected_length_weights).
It takes length_share s of the loss, decay cross-entropy 1 - s: from random weights a_j is about
1/V, and so is the term's gradient; alone it trained SmolLM2's drafter to one constant token.

greedy_labels: the target's argmax as each slot's label (extract's top-1, or target_argmax of its
final hidden states), a block's slots dropped after its first argmax that leaves the sampled
answer (greedy verification accepts only the argmax chain).

The LM head is the target's (vocabularies of 150k+), so full float32 logits for a whole batch
would be gigabytes. The head and the loss run together over chunks of rows; each chunk writes its
losses and their gradient with respect to the hidden states at once (the head is frozen, so that
is the only gradient), and only (chunk, V) logits exist at any time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

# gamma by block size, as published (B=16: 7, B=10: 5, B=8: 4).
KNOWN_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
_CHUNK_KERNELS: dict[tuple[bool, bool, tuple], Callable] = {}
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


def predicting_rows(anchors: Tensor, block_size: int, length: int) -> Tensor:
    """(A, B) stream positions whose target output predicts each slot's label: slot j's label is
    x_{a+j}, which the target predicted at a+j-1 (a-1 for slot 0, clamped: slot 0 carries no
    loss). Positions past the stream are clamped too; block_labels marks those slots invalid."""
    at = anchors[:, None] - 1 + torch.arange(block_size, device=anchors.device)  # (A, B)
    return at.clamp(0, length - 1)


def block_soft_targets(
    topk_ids: Tensor, topk_logprobs: Tensor, anchors: Tensor, block_size: int
) -> tuple[Tensor, Tensor]:
    """The target's top-k over each slot's label: (A, B, k) ids and log-probs. topk_ids,
    topk_logprobs (T, k): row t is the target's distribution over x_{t+1} (extract stores the LM
    head's output at t)."""
    at = predicting_rows(anchors, block_size, topk_ids.shape[0])
    return topk_ids[at], topk_logprobs[at]


def block_target_hidden(final_hidden: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """(A, B, H) the target's final hidden state (after its last norm) that predicts each slot's
    label, from the stream's (T, H) (extract.final_hidden); its LM head gives the target's whole
    distribution over the label."""
    return final_hidden[predicting_rows(anchors, block_size, final_hidden.shape[0])]


@torch.no_grad()
def target_argmax(target_hidden: Tensor, lm_head_weight: Tensor, chunk_rows: int = 1024) -> Tensor:
    """(A, B) the target's most likely token at each slot, from its final hidden states (A, B, H)
    through its LM head, chunked so only (chunk, V) logits exist (softcapping is monotone, so
    the argmax is the capped logits' too)."""
    flat = target_hidden.flatten(0, 1).to(lm_head_weight.dtype)  # (N, H)
    step = logit_rows(lm_head_weight.shape[0], chunk_rows)
    ids = [(flat[s : s + step] @ lm_head_weight.T).argmax(-1) for s in range(0, len(flat), step)]
    return torch.cat(ids).view(target_hidden.shape[:2])


WEIGHTINGS = ("decay", "dpace")
OBJECTIVES = ("cross_entropy", "expected_length")


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
    *,
    weighting: str = "decay",
    dpace_mix: float = 0.5,
    objective: str = "cross_entropy",
    length_share: float = 0.5,
    kl_temperature: float = 1.0,
    target_hidden: Tensor | None = None,
    target_softcap: float | None = None,
    top_k: int = 0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The weighted block loss of the drafter's outputs (module docstring), and metrics as
    tensors (no host sync).

    hidden (A, B, H) from the drafter; lm_head_weight (V, H) frozen; labels, valid (A, B);
    the target's distribution, one of them needed when distill_weight (the KL's share, in [0, 1])
    is > 0: soft, (A, B, k) top-k ids and log-probs from block_soft_targets, or target_hidden,
    (A, B, H) its final hidden states from block_target_hidden (its whole distribution through
    lm_head_weight, tanh-capped at target_softcap where the target caps its logits). rank_weight: the ranking term's share (rank_k: see the
    module docstring); cross-entropy takes 1 - distill_weight - rank_weight. weighting "decay"
    (gamma) or "dpace" (dpace_mix); objective "cross_entropy" or "expected_length" (its share
    length_share, decay cross-entropy's the rest);
    kl_temperature: the KL's T. Returns the scalar float32 loss and {"slot_accuracy": (B-1,),
    "acceptance_length": (), "slot_labels": (B-1,) valid-label counts}, and with top_k > 0
    "top_k": UnaryTopK, each row's top_k unary logits found inside the chunks (what
    selector_loss ranks; no (N, V) logits exist). compile: default on CUDA.
    """
    check_loss_arguments(lm_head_weight, soft, distill_weight, rank_weight, rank_k, weighting,
                         dpace_mix, objective, kl_temperature, target_hidden,
                         length_share)  # fmt: skip
    A, B, H = hidden.shape
    valid = valid[:, 1:]  # (A, B-1)
    rows = hidden[:, 1:].reshape(-1, H)  # (A*(B-1), H)
    target: tuple[Tensor, ...] = ()  # what the chunk kernel reads of the target, per row
    if distill_weight and target_hidden is not None:
        target = (target_hidden[:, 1:].reshape(-1, H).to(lm_head_weight.dtype),)  # (N, H)
    elif distill_weight:
        target = (soft[0][:, 1:].flatten(0, 1).long(),  # (N, k)
                  soft[1][:, 1:].flatten(0, 1).float())  # fmt: skip
    # (d, r, rank_k, T, overlap, softcap): fixed per run, so one compiled kernel per run
    terms = (float(distill_weight), float(rank_weight), int(rank_k), float(kl_temperature),
             weighting == "dpace" and distill_weight > 0,
             float(target_softcap) if target_softcap else None, int(top_k))  # fmt: skip
    decay = slot_weights(B, gamma, hidden.device)[1:] * valid  # (A, B-1)

    def weigh(losses: Tensor, acceptance: Tensor) -> tuple[Tensor, Tensor]:
        """(N,) each -> the loss and (N,) row weights, once every chunk has run."""
        a = acceptance.view(A, B - 1)
        w = dpace_weights(a, valid, dpace_mix) if weighting == "dpace" else decay
        w = (w / w.sum().clamp_min(1e-12)).flatten()
        if objective != "expected_length":
            return (w * losses).sum(), w
        # both gradients are row weights times cross-entropy's: the mix mixes the weights
        length, c = expected_length_weights(a, valid)
        s = length_share
        return s * length + (1 - s) * (w * losses).sum(), s * c.flatten() + (1 - s) * w

    compile = hidden.is_cuda if compile is None else compile
    loss, correct, *top = _LinearCrossEntropy.apply(
        rows, lm_head_weight, labels[:, 1:].flatten(), chunk_rows, compile, target, terms, weigh
    )
    metrics: dict = slot_metrics(correct.view(A, B - 1), valid)
    if top_k:
        metrics["top_k"] = UnaryTopK(*top)
    return loss, metrics


def check_loss_arguments(
    lm_head_weight: Tensor, soft: tuple[Tensor, Tensor] | None, distill_weight: float,
    rank_weight: float, rank_k: int, weighting: str, dpace_mix: float, objective: str,
    kl_temperature: float, target_hidden: Tensor | None = None, length_share: float = 0.5,
) -> None:  # fmt: skip
    """Refuse what dflash_loss cannot honour, naming the argument."""
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
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting {weighting!r} is not one of {WEIGHTINGS}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r} is not one of {OBJECTIVES}")
    if not 0 <= dpace_mix <= 1:
        raise ValueError(f"dpace_mix {dpace_mix} is not a mixing factor in [0, 1]")
    if not 0 < length_share <= 1:
        raise ValueError(f"length_share {length_share} is not a share in (0, 1]")
    if not 0 < kl_temperature < math.inf:
        raise ValueError(f"kl_temperature {kl_temperature} is not a temperature > 0")
    if soft is not None and target_hidden is not None:
        raise ValueError("soft= and target_hidden= both give the target's distribution; pass one")
    if distill_weight and soft is None and target_hidden is None:
        raise ValueError(
            f"distill_weight {distill_weight} needs the target's distribution (soft= or "
            "target_hidden=)"
        )
    # Settings that would silently do nothing are refused too: they are someone's mistake.
    if kl_temperature != 1 and not distill_weight:
        raise ValueError(f"kl_temperature {kl_temperature} needs the KL (distill_weight > 0)")
    if dpace_mix != 0.5 and weighting != "dpace":
        raise ValueError(f"dpace_mix {dpace_mix} needs weighting 'dpace', not {weighting!r}")
    if length_share != 0.5 and objective != "expected_length":
        raise ValueError(
            f"length_share {length_share} needs objective 'expected_length', not {objective!r}"
        )
    if objective == "expected_length" and (distill_weight or rank_weight or weighting != "decay"):
        raise ValueError(
            "objective 'expected_length' has its own slot weights and mixes with decay "
            f"cross-entropy only (length_share): it takes no distill_weight ({distill_weight}), "
            f"rank_weight ({rank_weight}) or weighting ({weighting!r} given; leave it 'decay')"
        )


def suffix_sums(x: Tensor) -> Tensor:
    """(A, S) -> (A, S): out[:, j] = sum_{k >= j} x[:, k]."""
    return x.flip(1).cumsum(1).flip(1)


def dpace_weights(acceptance: Tensor, valid: Tensor, mix: float) -> Tensor:
    """(A, S) unnormalized D-PACE weights: sum_{k >= j} prod_{i <= k} (mix + (1 - mix) a_i),
    the chain cut at each block's first invalid slot. acceptance is detached by the caller's
    autograd Function (it runs under no_grad)."""
    blended = torch.where(valid, mix + (1 - mix) * acceptance, 0.0)  # (A, S); 0 cuts the chain
    return suffix_sums(blended.cumprod(1))


def expected_length_weights(acceptance: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """-E[tau - 1] per block with a valid slot, and its row weights c_j / A' (A, S).

    P_k = prod_{j<=k} a_j (the chain cut at the first invalid slot); loss = -(1/A') sum P_k. With
    a_j = softmax(z_j)[label_j], d a_j / d z_j = a_j (onehot - softmax), and for k >= j
    d P_k / d a_j = P_k / a_j, so d P_k / d z_j = P_k (onehot - softmax) (no division: exact at
    a_j = 0 too). Summed: d loss / d z_j = (1/A') sum_{k >= j} P_k (softmax - onehot) = (c_j / A')
    times cross-entropy's gradient g_j: the true gradient, not a stop-gradient choice."""
    chain = torch.where(valid, acceptance, 0.0).cumprod(1)  # (A, S) P_k
    blocks = valid.any(1).sum().clamp_min(1)  # A'
    return -chain.sum() / blocks, suffix_sums(chain) / blocks


def greedy_labels(labels: Tensor, valid: Tensor, soft_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy-consistent labels (A, B) and valid (A, B): each valid slot labelled with the target's
    argmax (soft_ids[..., 0]: extract's topk is sorted, most likely first), and a block's slots
    after its first valid slot whose argmax is not the sampled label dropped. That slot keeps the
    argmax: the verifier's chain would produce it, and part from the answer there.

    labels, valid (A, B) from block_labels; soft_ids (A, B, k) from block_soft_targets. Only valid
    slots are compared: block_labels zeroes the others' labels."""
    if soft_ids.dim() != 3 or soft_ids.shape[:2] != labels.shape:
        raise ValueError(
            f"soft_ids {tuple(soft_ids.shape)} is not (A, B, k) for labels {tuple(labels.shape)}"
        )
    top = soft_ids[..., 0].to(labels.dtype)  # (A, B)
    parted = valid & (top != labels)  # (A, B)
    after = parted.cumsum(1) - parted.long() > 0  # strictly after a block's first parting
    keep = valid & ~after
    return torch.where(keep, top, 0), keep


def slot_metrics(correct: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """Per-slot accuracy over valid labels and the acceptance length it implies.

    correct, valid (A, B-1) bool. Expected acceptance = 1 + sum_k prod_{j<=k} acc_j: a draft
    runs until its first miss, and the verify step always yields one token of its own.
    "slot_chain" (B-1,): the blocks whose slots 1..k are all right (metrics.chain_acceptance:
    the acceptance length without assuming slots miss independently).
    """
    count = valid.sum(0)  # (B-1,)
    right = correct & valid
    accuracy = right.sum(0) / count.clamp_min(1)  # (B-1,)
    return {
        "slot_accuracy": accuracy,
        "acceptance_length": 1 + accuracy.cumprod(0).sum(),
        "slot_labels": count,
        "slot_chain": chain_counts(right),
    }


def chain_counts(right: Tensor) -> Tensor:
    """right (A, S) bool, slot k of block a right -> (S,) the blocks whose slots 1..k are all
    right: the chain a greedy verifier accepts runs to each block's first miss."""
    return right.int().cumprod(1).sum(0)


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i w_i l_i, z_i = rows_i @ W^T, chunked; grad only for the rows. Per row l_i = (1 - d - r)
    CE(z_i, label_i) + d T^2 KL(p_i,T || softmax(z_i / T)) + r softplus(z_i[c_i] - z_i[label_i]);
    terms = (d, r, k, T, overlap, softcap); target: () without the KL, (soft_ids, soft_logprobs)
    (N, k): p_i = softmax(soft_logprobs_i / T) on soft_ids_i (nothing elsewhere), or
    (target_rows,) (N, H): p_i = softmax(cap(target_rows_i @ W^T) / T) over the vocabulary;
    c_i the k-th most likely token other than the label; overlap: acceptance as sum min(p, q)
    rather than q(label). weigh(losses, acceptance) -> (loss, w) runs once all rows are seen."""

    @staticmethod
    def forward(ctx, rows, weight, labels, chunk_rows, compile, target, terms, weigh):
        need_grad = ctx.needs_input_grad[0]
        N = rows.shape[0]
        # Equal chunks: one compiled shape for every chunk. Rows come in a fixed count per step,
        # so fewer rows than a chunk make one chunk of their own size, not one padded to
        # chunk_rows (112 rows padded to 1,024 made a CPU step 9x the work). The target's whole
        # distribution holds a second set of (chunk, V) float32 tensors: half the rows.
        budget = logit_rows(weight.shape[0], chunk_rows) // (2 if len(target) == 1 else 1)
        chunk_rows = max(1, min(budget, N))
        pad = -N % chunk_rows
        rows_p = F.pad(rows, (0, 0, 0, pad))
        labels_p = F.pad(labels, (0, pad))
        soft = tuple(F.pad(t, (0, 0, 0, pad)) for t in target)
        kernel = _chunk_kernel(need_grad, compile, terms, len(target))
        losses = torch.empty(N + pad, device=rows.device, dtype=torch.float32)
        acceptance = torch.empty_like(losses)
        correct = torch.empty(N + pad, device=rows.device, dtype=torch.bool)
        grad = torch.empty_like(rows_p) if need_grad else None  # the one (N, H) buffer
        K = terms[-1]  # the unary top K a DFlash2 selector ranks: (N, K) logits, ids; (N,) label's
        top = (torch.empty(N + pad, K, device=rows.device), torch.empty(N + pad, K, device=rows.device,
               dtype=torch.long), torch.empty_like(losses)) if K else ()  # fmt: skip
        for s in range(0, N + pad, chunk_rows):
            e = s + chunk_rows
            losses[s:e], acceptance[s:e], correct[s:e], chunk_grad, *chunk_top = kernel(
                rows_p[s:e], weight, labels_p[s:e], *(t[s:e] for t in soft)
            )
            if need_grad:
                grad[s:e] = chunk_grad
            for buffer, part in zip(top, chunk_top, strict=True):
                buffer[s:e] = part
        loss, row_weights = weigh(losses[:N], acceptance[:N])  # (), (N,): on device, no sync
        if need_grad:
            grad = grad[:N].mul_(row_weights[:, None])  # in place: no second (N, H) buffer
        ctx.save_for_backward(grad)
        top = tuple(t[:N] for t in top)
        ctx.mark_non_differentiable(correct, *top)
        return loss, correct[:N], *top

    @staticmethod
    def backward(ctx, grad_loss, *_):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), *[None] * 7


def _chunk_loss(
    rows: Tensor, weight: Tensor, labels: Tensor, need_grad: bool,
    terms: tuple = (0.0, 0.0, 8, 1.0, False, None, 0), *target: Tensor,
):  # fmt: skip
    """One chunk's (c,) losses, (c,) acceptances, (c,) correct and (c, H) unweighted gradient;
    target: _LinearCrossEntropy's, this chunk's rows of it. With top_k (terms' last) > 0, also
    the chunk's unary top-K logits (c, K) and ids (c, K) and the label's logit (c,)."""
    distill_weight, rank_weight, rank_k, T, overlap, softcap, top_k = terms
    hard = 1 - distill_weight - rank_weight
    products = rows @ weight.T  # (c, V) in the rows' dtype
    # the top K before the float copy: the same values (a bf16 product is exact in float32), and
    # a radix select over 16-bit keys takes half the passes of 32-bit's
    unary = products.topk(top_k, -1) if top_k else None  # (c, K) values and ids
    logits = products.float()
    del products  # eager, the float copy alone stays alive
    lse = logits.logsumexp(-1)  # (c,)
    picked = logits.gather(1, labels[:, None])[:, 0]  # (c,)
    per_row = hard * (lse - picked)  # (c,) CE
    acceptance = torch.exp(picked - lse)  # (c,) q(label)
    full = len(target) == 1  # the target's whole distribution, from its final hidden states
    if distill_weight:
        lse_t = lse if T == 1 else (logits / T).logsumexp(-1)  # (c,)
    if distill_weight and full:
        zt = (target[0] @ weight.T).float()  # (c, V) the target's logits
        if softcap:
            zt = torch.tanh(zt / softcap) * softcap
        log_p = (zt / T).log_softmax(-1)  # (c, V)
        p = log_p.exp()
        log_q = logits / T - lse_t[:, None]  # (c, V)
        per_row = per_row + distill_weight * T * T * (p * (log_p - log_q)).sum(-1)  # T^2 KL
        if overlap:  # speculative sampling's acceptance, at temperature 1 whatever T
            p1 = p if T == 1 else zt.softmax(-1)
            acceptance = torch.minimum(p1, torch.exp(logits - lse[:, None])).sum(-1)
    elif distill_weight:
        soft_ids, soft_logprobs = target
        log_p = (soft_logprobs / T).log_softmax(-1)  # (c, k) the target's top-k, renormalized
        p = log_p.exp()
        log_q = logits.gather(1, soft_ids) / T - lse_t[:, None]  # (c, k) the drafter's, same ids
        per_row = per_row + distill_weight * T * T * (p * (log_p - log_q)).sum(-1)  # T^2 KL
        if overlap:  # speculative sampling's acceptance, at temperature 1 whatever T
            q = torch.exp(logits.gather(1, soft_ids) - lse[:, None])  # (c, k)
            acceptance = torch.minimum(soft_logprobs.softmax(-1), q).sum(-1)
    if rank_weight:
        # The label ranks among the k most likely iff it beats the k-th most likely other token.
        others = logits.scatter(1, labels[:, None], float("-inf"))
        kth, kth_ids = others.topk(rank_k, -1)  # (c, k)
        margin = kth[:, -1] - picked  # (c,)
        per_row = per_row + rank_weight * F.softplus(margin)
    correct = logits.argmax(-1) == labels
    top = (unary.values.float(), unary.indices, picked) if top_k else ()  # (c, K), (c, K), (c,)
    if not need_grad:
        return per_row, acceptance, correct, None, *top
    # d CE / d logits = softmax - onehot(label); d T^2 KL / d logits = T (softmax(z / T) - p) on
    # the k ids, or every id for the whole distribution (p sums to 1); d rank / d logits = sigmoid(margin) (onehot(c) - onehot(label)).
    # At T = 1, mixed: (1 - r) softmax - (1 - d - r) onehot - d p + r sigmoid (onehot(c) - ...).
    if distill_weight and T != 1:
        dlogits = torch.exp(logits - lse[:, None]) * hard  # (c, V)
        dlogits += torch.exp(logits / T - lse_t[:, None]) * (distill_weight * T)
    else:
        dlogits = torch.exp(logits - lse[:, None]) * (1 - rank_weight)  # (c, V)
    dlogits.scatter_add_(1, labels[:, None], torch.full_like(picked, -hard)[:, None])
    if distill_weight and full:
        dlogits -= (distill_weight * T) * p
    elif distill_weight:
        dlogits.scatter_add_(1, soft_ids, -distill_weight * T * p)
    if rank_weight:
        push = rank_weight * torch.sigmoid(margin)[:, None]  # (c, 1)
        dlogits.scatter_add_(1, kth_ids[:, -1:], push)
        dlogits.scatter_add_(1, labels[:, None], -push)
    return per_row, acceptance, correct, dlogits.to(rows.dtype) @ weight, *top  # (c, H)


def _chunk_kernel(need_grad: bool, compile: bool, terms: tuple, target: int) -> Callable:
    key = (need_grad, compile, terms, target)
    if key not in _CHUNK_KERNELS:

        def kernel(rows, weight, labels, *target):
            return _chunk_loss(rows, weight, labels, need_grad, terms, *target)

        # Compiled, softmax and the one-hot subtraction fuse into the logits' epilogue instead
        # of each writing a (chunk, V) float32 tensor.
        _CHUNK_KERNELS[key] = torch.compile(kernel, dynamic=False) if compile else kernel
    return _CHUNK_KERNELS[key]


class UnaryTopK(NamedTuple):
    """Per loss row (N = A*(B-1)): the unary top K logits (N, K) float32 and ids (N, K), most
    likely first, and the label's logit (N,) (what "replace" puts in the weakest place)."""

    logits: Tensor
    ids: Tensor
    label_logit: Tensor
