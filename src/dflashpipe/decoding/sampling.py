"""Sampling settings and the draw of the batched engine (batched.py): one uniform per answer token
from the request's own seeded generator, read at the token's index, so a sampled answer does not
depend on the slot, the step or the rows beside it."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class Sampling:
    """How sampled requests draw (greedy ones take the argmax): temperature > 0, top_k (0: off),
    top_p in (0, 1] (1: off)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p is {self.top_p}; expected a value in (0, 1]")
        if self.temperature <= 0 or self.top_k < 0:
            raise ValueError(
                f"temperature {self.temperature} and top_k {self.top_k}: expected a "
                "temperature > 0 and top_k >= 0 (0: off) for sampled requests"
            )


def draw(logits: Tensor, u: Tensor, sampling: Sampling) -> Tensor:
    """Tokens (R,) at the inverse CDF u (R,) in [0, 1) of logits (R, V) under temperature, then
    top-k, then top-p (transformers' order): one uniform per token, no generator state."""
    scores, ids = logits / sampling.temperature, None
    if sampling.top_k:
        scores, ids = scores.topk(min(sampling.top_k, scores.shape[-1]))  # (R, k), likeliest first
    elif sampling.top_p < 1:
        scores, ids = scores.sort(-1, descending=True)  # (R, V)
    probs = scores.softmax(-1)
    if sampling.top_p < 1:
        likelier = probs.cumsum(-1) - probs  # mass of the tokens before each one
        probs = probs.masked_fill(likelier >= sampling.top_p, 0)  # the likeliest always stays
    cdf = probs.cumsum(-1)  # (R, n)
    target = (u * cdf[:, -1])[:, None]  # (R, 1): the total is 1 up to rounding
    pick = (cdf <= target).sum(-1, keepdim=True).clamp(max=cdf.shape[-1] - 1)  # (R, 1)
    return (pick if ids is None else ids.gather(-1, pick))[:, 0]
