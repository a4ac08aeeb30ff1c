"""What DFlash2 adds to the DFlash drafter: a block-local dynamic convolution around every
sublayer, and a candidate selector after the logits (../shared/DFLASH2.md has the sources).

    per layer, around attention and around the MLP (one `DynamicConv` each):
        h   = norm(x)                                          (N, L, H): N blocks of L slots
        dyn = kernel_projection(h)                             (N, L, 2, K, G): G = H / group
        h'  = conv_0(h)  -> sublayer -> conv_1(.)  -> x + it
        conv_i(y)[t] = sum_o (base_kernel[i, o] + dyn[t, i, o, group]) * y[t - o],  o < K
    taps read only slots t - o >= 0 of the same block: a block is all the drafter sees in
    inference, so in training's packed blocks a tap across a boundary would read another block.

    selector, per drafted slot p = 1..L-1, from the anchor: candidates = top K of the unary
    logits; score(c) = logit(c) + <pred[prev] * hidden_projection(h_p), succ[c]>; prev = the
    token chosen at p-1 (the anchor at p = 1); greedy picks the argmax.

Initialised so step 0 is the DFlash drafter: base tap 0 = 1, other taps and the projection 0
(each convolution is the identity, exactly), successor codebook 0 (scores = unary logits).
State dict names are the official checkpoint's: `base_kernel` (2, K, H), `kernel_projection.
weight` (2*K*G, H); the codebooks (V, R) are bare tensors, `hidden_projection.weight` (R, H).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class DynamicConv(nn.Module):
    """The pair of grouped dynamic causal convolutions around one sublayer: index 0 of
    `base_kernel` is the one before it, index 1 the one after; both take their dynamic part from
    the sublayer's (normed) input, so `before` returns the dynamic kernel that `after` needs."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        with torch.random.fork_rng(devices=[]):  # built without a draw from the caller's seed
            self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
            self.kernel_projection = nn.Linear(
                hidden_size, 2 * kernel_size * self.groups, bias=False
            )
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: tap 0 of the base kernel 1, everything else 0."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def before(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """h (N, L, H) -> (the convolution before the sublayer, the dynamic kernel (N, L, K, G)
        of the one after it)."""
        dyn = self.kernel_projection(h).unflatten(-1, (2, self.kernel_size, self.groups))
        return self.convolve(h, dyn[..., 0, :, :], 0), dyn[..., 1, :, :]

    def after(self, y: Tensor, dyn: Tensor) -> Tensor:
        """The convolution after the sublayer of its output y (N, L, H)."""
        return self.convolve(y, dyn, 1)

    def convolve(self, y: Tensor, dyn: Tensor, which: int) -> Tensor:
        """y (N, L, H), dyn (N, L, K, G) -> (N, L, H); tap o reads slot t-o of the same block."""
        L = y.shape[-2]
        blocks = y.unflatten(-1, (self.groups, self.group_size))  # (N, L, G, S)
        base = self.base_kernel[which].to(y.dtype).unflatten(-1, (self.groups, self.group_size))
        out = torch.zeros_like(blocks)
        for o in range(min(self.kernel_size, L)):
            # shifted by o inside each block: slots t < o read zeros, never the previous block
            shifted = nn.functional.pad(blocks[..., : L - o, :, :], (0, 0, 0, 0, o, 0))
            out = out + (base[o] + dyn[..., o, :, None]) * shifted  # (N, L, G, S)
        return out.flatten(-2)


class CandidateSelector(nn.Module):
    """Transition scores between consecutive drafted tokens, over the unary top K."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        with torch.random.fork_rng(devices=[]):  # built without a draw from the caller's seed
            self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
            self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
            self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
            self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """normal(0, std) predecessor codebook and projection; a zero successor codebook, so the
        scores start as the unary logits while every factor still gets a gradient."""
        nn.init.normal_(self.predecessor_codebook, std=std)
        nn.init.normal_(self.hidden_projection.weight, std=std)
        nn.init.zeros_(self.successor_codebook)

    def edge_scores(self, hidden: Tensor, previous: Tensor, candidates: Tensor) -> Tensor:
        """hidden (..., H) final states of drafted slots, previous (...) the token before each,
        candidates (..., K) -> (..., K) the pairwise term of each candidate's score (teacher
        forcing passes the true previous tokens)."""
        query = F.embedding(previous, self.predecessor_codebook) * self.hidden_projection(hidden)
        successors = F.embedding(candidates, self.successor_codebook).to(query.dtype)  # (..., K, R)
        return (successors @ query[..., :, None])[..., 0]  # (..., K)

    def transitions(self, hidden: Tensor, anchor: Tensor, candidates: Tensor) -> Tensor:
        """Every edge a path over the slots' candidates can take, (..., S, K, K): [p, r, j] the
        edge into slot p's candidate j from slot p-1's candidate r (slot 0: from the anchor,
        every r alike); hidden (..., S, H) the slots' final states, anchor (...), candidates
        (..., S, K). A path's previous token is always the slot before's candidate or the
        anchor, so the walk and the DDTree search only pick rows of it (one projection and one
        product for all slots)."""
        K = candidates.shape[-1]
        first = anchor[..., None, None].expand(*anchor.shape, 1, K)  # (..., 1, K)
        previous = torch.cat([first, candidates[..., :-1, :]], -2)  # (..., S, K)
        query = F.embedding(previous, self.predecessor_codebook)  # (..., S, K, R)
        query = query * self.hidden_projection(hidden)[..., None, :]
        successors = F.embedding(candidates, self.successor_codebook)  # (..., S, K, R)
        return query @ successors.to(query.dtype).transpose(-1, -2)

    def walk(self, hidden: Tensor, logits: Tensor, anchor: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The greedy path from the anchor: hidden (N, S, H) and logits (N, S, V) of the S drafted
        slots, anchor (N,) -> path (N, S) ids, candidates (N, S, K) ids, scores (N, S, K)."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1)  # (N, S, K)
        return self.walk_top_k(hidden, unary, candidates, anchor)

    def walk_top_k(
        self, hidden: Tensor, unary: Tensor, candidates: Tensor, anchor: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """`walk` given each slot's unary top K, logits and ids (N, S, K) (training's loss finds
        them chunk by chunk, never holding (N, S, V) logits)."""
        # every edge the walk can take, before it starts: what is left per slot is a row pick,
        # an add and an argmax (one fused kernel under compile, where a slot's own projection,
        # gather and product took several)
        table = self.transitions(hidden, anchor, candidates)  # (N, S, K, K)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        pick = torch.zeros_like(anchor)  # slot 0's rows are all the anchor's
        picks, scores = [], []
        for p in range(hidden.shape[-2]):
            s = unary[:, p] + table[rows, p, pick]  # (N, K)
            pick = s.argmax(-1)  # (N,): the index of the chosen candidate
            picks.append(pick)
            scores.append(s)
        path = candidates.gather(-1, torch.stack(picks, 1)[..., None])[..., 0]  # (N, S)
        return path, candidates, torch.stack(scores, 1)
