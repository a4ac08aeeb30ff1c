"""Sampling settings and the draw of the batched engine (batched.py): one uniform per answer token
from the request's own seeded generator, read at the token's index, so a sampled answer does not
depend on the slot, the step or the rows beside it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
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


SEARCH_WAYS = 16  # thresholds tried per pass of `nucleus_floor`'s search (15 masked sums)
# passes until one bit pattern is left: non-negative float32 values span fewer than 2**31 patterns,
# and each pass keeps 1/SEARCH_WAYS of them (a power of two), rounded up
SEARCH_PASSES = -(-31 // (SEARCH_WAYS.bit_length() - 1))


def nucleus_floor(probs: Tensor, top_p: float) -> Tensor:
    """(R, 1) int32: the float32 bits of the least probability in each row's top-p nucleus, the
    probability t at which the mass of the tokens at least as likely as t first reaches top_p
    (tokens tied at t are all in). Found without sorting: non-negative float32 values order as
    their bits, so an M-way search over the bits narrows [0, max] M-fold a pass, each pass
    one read of probs (R, V) with M - 1 masked sums. `draw`'s full sort added 23 ms to a decode
    step of 1,024 rows at Gemma 3's vocabulary on an H100 (benchmarks/RESULTS.md, twenty-second
    session)."""
    bits = probs.view(torch.int32)  # (R, V)
    lo = torch.zeros_like(bits[:, :1], dtype=torch.long)  # mass(probs >= lo) >= top_p
    hi = bits.max(-1, keepdim=True).values.long() + 1  # mass(probs >= hi) = 0 < top_p
    steps = torch.arange(1, SEARCH_WAYS, device=probs.device)  # (M - 1,)
    for _ in range(SEARCH_PASSES):
        cand = lo + (hi - lo) * steps // SEARCH_WAYS  # (R, M - 1), ascending
        mass = torch.stack(
            [probs.masked_fill(bits < cand[:, m : m + 1], 0).sum(-1) for m in range(len(steps))],
            -1,
        )  # (R, M - 1): sums of one input, which Inductor may fuse into one read (draw.py times it)
        k = (mass >= top_p).sum(-1, keepdim=True)  # the first k candidates hold
        lo = torch.where(k > 0, cand.gather(-1, (k - 1).clamp(min=0)), lo)
        hi = torch.where(k < len(steps), cand.gather(-1, k.clamp(max=len(steps) - 1)), hi)
    return lo.int()


def draw(logits: Tensor, u: Tensor, sampling: Sampling) -> Tensor:
    """Tokens (R,) at the inverse CDF u (R,) in [0, 1) of logits (R, V) under temperature, then
    top-k, then top-p (transformers' order): one uniform per token, no generator state. Each row
    is sorted, likeliest first (top-p alone sorts the whole vocabulary)."""
    scores, ids = logits / sampling.temperature, None
    if sampling.top_k:
        scores, ids = scores.topk(min(sampling.top_k, scores.shape[-1]))  # (R, k), likeliest first
    elif sampling.top_p < 1:
        scores, ids = scores.sort(-1, descending=True)  # (R, V)
    probs = scores.softmax(-1)
    if sampling.top_p < 1:
        likelier = probs.cumsum(-1) - probs  # mass of the tokens before each one
        probs = probs.masked_fill(likelier >= sampling.top_p, 0)  # the likeliest always stays
    pick = inverse_cdf(probs, u)
    return pick if ids is None else ids.gather(-1, pick[:, None])[:, 0]


def draw_searched(logits: Tensor, u: Tensor, sampling: Sampling) -> Tensor:
    """`draw` without its sort where top-p alone filters: the nucleus `nucleus_floor` finds, its
    CDF read in vocabulary order. The same distribution (ties at the nucleus' edge all kept), not
    the same token for a given u. Not the engine's yet: `benchmarks/draw.py` times it against
    `draw` on the card first (compiled, about 12 reads of the logits against a sort's passes;
    eager on a CPU it is 10x slower than the sort)."""
    if sampling.top_k or sampling.top_p == 1:
        return draw(logits, u, sampling)
    probs = (logits / sampling.temperature).softmax(-1)  # (R, V)
    floor = nucleus_floor(probs, sampling.top_p)  # (R, 1)
    return inverse_cdf(probs.masked_fill(probs.view(torch.int32) < floor, 0), u)


def inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """Indices (R,) where u (R,) in [0, 1) falls in the cumulated probs (R, n), which need not
    sum to 1 (the total scales u): the first index whose cumulated mass exceeds u x total."""
    cdf = probs.cumsum(-1)  # (R, n)
    target = (u * cdf[:, -1])[:, None]  # (R, 1)
    return (cdf <= target).sum(-1).clamp(max=cdf.shape[-1] - 1)  # (R,)
