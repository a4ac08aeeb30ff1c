"""DDTree draft trees (arXiv 2604.12989): many drafted continuations verified in one forward.

    drafter pass (one block) ─► per slot s = 1..S: top-k log-probs and ids, (S, k)
      ─► grow_tree    best-first over prefixes (one rank per depth), score = summed log-prob,
                      `budget` nodes in fixed shapes on the device; parents precede children
      ─► verify       target([anchor, node tokens]) at the nodes' depths under their ancestor
                      masks (`visible`), one forward: g_0..g_N, the target's token after the
                      root and each node
      ─► walk_static  root ─► child whose token == g at the current node ─► ... until none
                      matches; accepted = g at [root] + path (the last one is the bonus), and
                      the verify rows the cache keeps

Each node is a prefix (r_1..r_d) of ranks, one per depth; its token is slot d's rank-r_d
candidate and its parent is (r_1..r_{d-1}) (the root, i.e. the anchor, for d = 1). Every
accepted token is the target's own greedy choice after its ancestors, so decoding stays lossless
whatever the tree holds; the tree only decides how much is accepted.

What the search guarantees (log-probs <= 0, rows sorted, so a prefix never outscores the prefix
that pushed it: its parent or its previous sibling):
- nodes come out in the order (score descending, rank tuple ascending) over all prefixes, and
  the tree is exactly the first `budget` of them: the best-scoring prefixes, ties to low ranks;
- the DFlash chain (all ranks 0) is the best prefix of each depth, so it is in the tree down to
  the tree's deepest level, and a tree never accepts less than the chain cut to that depth.
  It is *not* always the first S nodes: a likely second candidate at slot 1 outranks a chain
  node deep behind an unsure slot. With k = 1 the tree is the chain cut at `budget`.

A DFlash2 drafter's tree (`selector`): a node's children are its slot's same k candidates, but
scored from the node's own token, p(child | node) = the slot's top-k unary mass x the selector's
softmax over the k of (unary log-prob + edge(node's token, child)) (`selector_steps`); the tree is
again the best `budget` paths, parents first. With every edge 0 (the selector at step 0) it is
the unary tree; otherwise the chain guarantees above hold for the selector's scores only in
part: its greedy walk need not be the best path of each depth.

tests/tree_reference.py holds the same search on the host (a heap over rank prefixes) and its
walk: the reference the device tree is tested against.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn


def draft_candidates(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Per-slot top-k (log-probs, ids), each (S, k), sorted descending, from drafter logits
    (S, V) of slots 1..S."""
    return torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)


class StaticTree(NamedTuple):
    """A draft tree in fixed shapes, for a step captured as a CUDA graph: always `budget` node
    rows, the unreachable ones (`valid` False): a pad sits like a child of the root that no
    real row sees."""

    tokens: Tensor  # (N,) long; a pad's is some candidate id (no real row sees a pad)
    parents: Tensor  # (N,) long; -1 = the root (and every pad)
    depth: Tensor  # (N,) long, 1..S; a pad's 1
    valid: Tensor  # (N,) bool
    visible: Tensor  # (N+1, N+1) bool over [root, nodes]: ancestor-or-self
    slots: int  # S, the deepest a node can be


def grow_tree(
    top_logprobs: Tensor, top_ids: Tensor, budget: int, selector: nn.Module | None = None,
    hidden: Tensor | None = None, anchor: Tensor | None = None,
) -> StaticTree:  # fmt: skip
    """The best-first tree (module docstring) on the device, without a host sync or a data-dependent shape: the same
    nodes, parents and order when no two prefixes score exactly alike (tests compare), and always
    a best-scoring, parent-closed set of min(budget, sum_d k^d) prefixes.

    A beam per depth: the best N prefixes of depth d are among the N best of depth d-1 extended
    by one rank each (a prefix never outscores its parent), so S sorts of N*k candidates hold
    every node the tree needs; one stable sort of the S*N, depth-major, picks the tree (a parent
    scores no less than its child and sits at the shallower depth, so it always comes first).
    Scores are float64 sums, as in the host reference; log-probs are clamped to -1e30 so that only an
    unreachable prefix scores -inf.

    `selector` (a DFlash2 drafter's CandidateSelector, with `hidden` (S, H) the drafter's final
    states of the slots and `anchor` (1,) the root's token): a node's step score depends on its
    parent's token, `selector_steps`; the beam argument holds as each step scores <= 0."""
    if budget < 1:
        raise ValueError(f"budget {budget} must be >= 1")
    S, k = top_logprobs.shape
    device = top_ids.device
    lp, order = top_logprobs.double().clamp_min(-1e30).sort(dim=-1, descending=True, stable=True)
    ids = top_ids.gather(-1, order)  # (S, k)
    # (N,): the root alone (no host scalar is written: a CUDA graph captures this)
    beam = torch.full((budget,), -math.inf, dtype=torch.float64, device=device)
    beam = torch.where(torch.arange(budget, device=device) == 0, 0.0, beam)
    scores, parent_pos, tokens = [], [], []
    if selector is not None:  # every step score a node can take, before the search
        steps = selector_steps(selector, hidden, anchor, ids, lp)  # (S, k, k)
        rank = torch.zeros(budget, dtype=torch.long, device=device)  # slot 0: any row (the anchor)
    for d in range(S):
        step = lp[d][None, :]  # (1, k): the unary log-probs, whatever the parent
        if selector is not None:
            step = steps[d][rank]  # (N, k): after each prefix's last token, its rank at d-1
        cand = (beam[:, None] + step).flatten()  # (N*k,): parent-major, then rank
        best = cand.sort(descending=True, stable=True).indices[:budget]  # (N,)
        beam = cand[best]
        scores.append(beam)
        parent_pos.append(best // k)  # the parent's position in the previous depth's beam
        rank = best % k
        tokens.append(ids[d][rank])
    flat = torch.cat(scores)  # (S*N,), depth-major
    chosen = flat.sort(descending=True, stable=True).indices[:budget]  # (N,) flat positions
    valid = flat[chosen] > -math.inf
    depth0 = chosen // budget  # (N,) depth - 1
    node_of = torch.full((S * budget,), -1, dtype=torch.long, device=device)
    node_of[chosen] = torch.arange(budget, device=device)
    up = torch.cat(parent_pos)[chosen] + (depth0 - 1) * budget  # the parent's flat position
    parents = torch.where(valid & (depth0 > 0), node_of[up.clamp_min(0)], -1)
    depth = torch.where(valid, depth0 + 1, 1)
    return StaticTree(
        tokens=torch.cat(tokens)[chosen],
        parents=parents,
        depth=depth,
        valid=valid,
        visible=_ancestors(parents, S),
        slots=S,
    )


def selector_steps(
    selector: nn.Module, hidden: Tensor, anchor: Tensor, ids: Tensor, logprobs: Tensor
) -> Tensor:
    """Every step score of a DFlash2 tree, (S, k, k): [d, r] scores slot d's k candidates `ids`
    (S, k) after a prefix ending in slot d-1's rank-r candidate (slot 0: after the anchor (1,),
    every r alike). A step score is the slot's top-k mass under the unary distribution
    (`logprobs` (S, k), float64) shared out by the selector's softmax over the k candidates of
    (unary log-prob + its edge from the previous token); `hidden` (S, H) the slots' final
    states. The tree's previous tokens are always a slot's candidates (`transitions`), so the
    search only picks rows: one projection and one product here, none per depth. With every
    edge 0 (a zero successor codebook, the selector at step 0) it is the unary log-prob, the
    unary tree."""
    edge = selector.transitions(hidden, anchor.reshape(()), ids)  # (S, k previous, k)
    step = (logprobs[:, None, :] + edge.double()).log_softmax(-1)
    return step + logprobs.logsumexp(-1)[:, None, None]


def _ancestors(parents: Tensor, max_depth: int) -> Tensor:
    """(n+1, n+1) bool over [root, nodes]: row i sees j iff j is i, an ancestor or the root.
    Pointer doubling (the root is its own parent), log2(max_depth) vectorized steps."""
    n = parents.shape[0] + 1
    up = torch.cat([parents.new_zeros(1), parents + 1])  # (n,)
    seen = torch.eye(n, dtype=torch.bool, device=parents.device)  # (n, n)
    hops = 1
    while hops <= max_depth:
        seen = seen | seen[up]
        up = up[up]
        hops *= 2
    seen[:, 0] = True
    return seen


def walk_static(tree: StaticTree, greedy: Tensor) -> Tensor:
    """The walk (module docstring) on the device: greedy (N+1,) is the target's argmax after each verify row. Returns
    rows (S+1,): rows[d] = the verify row of the matched node at depth d (rows[0] = the root),
    repeated past the deepest match. Accepted = greedy[rows[:L+1]] (the last is the bonus), L
    the matched depth; the cache keeps rows[:L+1]."""
    ok = tree.valid & (tree.tokens == greedy.index_select(0, tree.parents + 1))  # (N,)
    nodes = tree.visible[1:, 1:]  # (N, N): ancestor-or-self among the nodes
    matched = ~(nodes & ~ok[None, :]).any(-1)  # (N,): every node from the root down matches
    # The matched nodes are one chain (ids are distinct within a slot), at most one per depth.
    # Unmatched nodes all write 0 into rows[0], the root's row; along the chain rows increase
    # (parents precede children), so a running max fills the depths past the deepest match.
    n = matched.shape[0]
    rows = torch.zeros(tree.slots + 1, dtype=torch.long, device=greedy.device)  # (S+1,)
    row = torch.where(matched, torch.arange(1, n + 1, device=greedy.device), 0)  # (N,)
    rows.scatter_(0, torch.where(matched, tree.depth, 0), row)
    return rows.cummax(0).values
