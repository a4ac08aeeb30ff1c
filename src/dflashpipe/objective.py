"""One micro-batch's training objective, as the train stage and benchmarks/train.py run it:
the drafter's forward, the block labels (the answer's tokens, or the target's argmax for
train.loss.labels greedy), the target's distribution where the objective reads it (its final
hidden states through the frozen head, else its stored top-k), the chunked block loss
(loss.dflash_loss) and, on a DFlash2 drafter, the selector's term (selector_loss.py).
"""

from __future__ import annotations

import torch

from dflashpipe.config import LossConfig, SelectorConfig, TrainConfig
from dflashpipe.loss import (
    block_labels,
    block_soft_targets,
    block_target_hidden,
    default_gamma,
    dflash_loss,
    greedy_labels,
    target_argmax,
)
from dflashpipe.model import Drafter
from dflashpipe.selector_loss import block_previous, selector_loss


def compute_head(drafter: Drafter, device: torch.device) -> torch.Tensor:
    """The frozen LM head as the loss multiplies it: bf16 on GPU (a float32 head would run the
    biggest matmul of the step, rows x vocab, at a fraction of the tensor cores' rate; the
    logits still go to float32 before the softmax), float32 on CPU."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return drafter.lm_head.weight.detach().to(dtype)


def train_objective(tc: TrainConfig, block_size: int) -> dict:
    """forward_loss's keyword arguments that the train section sets (the selector's term aside:
    its alpha moves with the step): gamma (train.gamma, else loss.default_gamma of the block),
    distill_weight, the ranking term and train.loss."""
    return dict(gamma=tc.gamma or default_gamma(block_size), distill_weight=tc.distill_weight,
                rank=(tc.rank_weight, tc.rank_k), loss=tc.loss)  # fmt: skip


def selector_settings(tc: TrainConfig, dflash2: bool) -> SelectorConfig | None:
    """train.selector (its defaults where unset) for a DFlash2 drafter; None for a DFlash one."""
    return (tc.selector or SelectorConfig()) if dflash2 else None


def forward_loss(
    model: torch.nn.Module, head: torch.Tensor, b: dict, block_size: int, gamma: float,
    distill_weight: float = 0.0, rank: tuple[float, int] = (0.0, 8), *,
    loss: LossConfig | None = None, softcap: float | None = None,
    selector: tuple[torch.nn.Module, SelectorConfig, float] | None = None,
) -> tuple[torch.Tensor, dict]:  # fmt: skip
    """One micro-batch's DFlash loss and metrics (tensors, no host sync): drafter forward under
    bf16 autocast on GPU, labels, chunked loss against the frozen head: train.loss's objective
    and weights (None: its defaults, decay cross-entropy), cross-entropy mixed with the KL
    (distill_weight) and the ranking term (rank = (train.rank_weight, train.rank_k)).

    The target's distribution, where the KL (objective forward_kl: the share the ranking term
    leaves) or greedy labels need it: its whole one from b's `target_final` (its final hidden
    states, through the head, logits tanh-capped at `softcap` where the target caps them), else
    its top-k (`topk_ids`, `topk_logprobs`).

    selector (a dflash2 drafter): (its CandidateSelector, train.selector, alpha at this step):
    alpha x the selector's K-way cross-entropy over the unary top K is added (selector_loss.selector_loss;
    the top K found inside the loss's chunks), its counts in the metrics."""
    loss = loss or LossConfig()
    cuda = b["input_ids"].is_cuda
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
        out = model(b["input_ids"], b["target_hidden"], b["position_ids"], b["document_ids"],
                    b["anchors"], b["keep"])  # fmt: skip  # (A, B, H)
    labels, valid = block_labels(b["input_ids"], b["document_ids"], b["loss_mask"], b["anchors"],
                                 b["keep"], block_size)  # fmt: skip
    d = 1 - rank[0] if loss.objective == "forward_kl" else distill_weight
    greedy = loss.labels == "greedy"
    soft = target = None  # the target's distribution: its final states, else its top-k
    if (d or greedy) and "target_final" in b:
        target = block_target_hidden(b["target_final"], b["anchors"], block_size).to(head.dtype)
    if (greedy or (d and target is None)) and "topk_ids" in b:
        soft = block_soft_targets(b["topk_ids"], b["topk_logprobs"], b["anchors"], block_size)
    if greedy:  # the target's argmax: extract's top-1 where stored (exact), else from its head
        top = soft[0] if soft is not None else target_argmax(target, head)[..., None]
        labels, valid = greedy_labels(labels, valid, top)
    if target is not None:
        soft = None  # the KL reads the whole distribution
    objective = "expected_length" if loss.objective == "expected_length" else "cross_entropy"
    hidden = out.to(head.dtype)
    top_k = selector[0].top_k if selector else 0
    total, metrics = dflash_loss(hidden, head, labels, valid, gamma,
                                 soft=soft if d else None, target_hidden=target if d else None,
                                 distill_weight=d, rank_weight=rank[0], rank_k=rank[1],
                                 weighting=loss.weighting, dpace_mix=loss.dpace_mix,
                                 objective=objective, length_share=loss.length_share,
                                 kl_temperature=loss.kl_temperature,
                                 target_softcap=softcap, top_k=top_k)  # fmt: skip
    if selector is None:
        return total, metrics
    module, sc, alpha = selector
    previous = block_previous(b["input_ids"], b["anchors"], block_size)  # teacher forcing
    term, more = selector_loss(module, hidden, head, labels, valid, previous,
                               metrics.pop("top_k"), gamma, outside_top_k=sc.outside_top_k,
                               stop_gradient=sc.stop_gradient)  # fmt: skip
    return total + alpha * term, metrics | more | {"unary_loss": total.detach()}
