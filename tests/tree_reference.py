"""The host reference of DDTree's best-first search and walk (decoding/tree_search.py grows the
engine's trees on the device; tests/test_tree_search.py checks them against this): a heap over
rank prefixes in Python, one read-back of the candidates."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dflashpipe.decoding.tree_search import _ancestors


@dataclass(frozen=True, eq=False)
class DraftTree:
    """N drafted nodes below a root (the anchor). Verify row 0 is the root, row i + 1 node i."""

    tokens: Tensor  # (N,) long, candidate ids
    parents: Tensor  # (N,) long, index of the parent node; -1 = the root
    depth: Tensor  # (N,) long, 1..S (the drafter slot the token came from)
    scores: Tensor  # (N,) float64, summed log-prob along the prefix, non-increasing
    children: dict[tuple[int, int], int]  # (parent, token) -> node; parent -1 = the root
    max_depth: int  # deepest node's depth (0 for an empty tree)

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_valid(self) -> int:
        """Real verify rows: the root and the nodes (the rest of a padded form is filler)."""
        return self.num_nodes + 1

    def _size(self, size: int | None) -> int:
        if size is None:
            return self.num_nodes
        if size < self.num_nodes:
            raise ValueError(f"cannot pad a tree of {self.num_nodes} nodes to size {size}")
        return size

    def input_ids(self, anchor: int, size: int | None = None, pad_id: int | None = None) -> Tensor:
        """Verify input (size + 1,): the anchor, the node tokens, then `pad_id` (the anchor by
        default: any id does, nothing real attends to a pad)."""
        size = self._size(size)
        pad = anchor if pad_id is None else pad_id
        head = torch.tensor([anchor], dtype=torch.long, device=self.tokens.device)
        fill = self.tokens.new_full((size - self.num_nodes,), pad)
        return torch.cat([head, self.tokens, fill])  # (size+1,)

    def positions(self, size: int | None = None) -> Tensor:
        """Position offsets (size + 1,) after the cache: root 0, node i its depth, pads 1 (a pad
        sits like a child of the root that no real row sees)."""
        size = self._size(size)
        head = self.depth.new_zeros(1)
        fill = self.depth.new_ones(size - self.num_nodes)
        return torch.cat([head, self.depth, fill])  # (size+1,)

    def attention(self, size: int | None = None) -> Tensor:
        """(size + 1, size + 1) bool over [root, nodes, pads]: row i sees column j iff j is i or
        an ancestor of i (the root is everyone's). Pad rows see themselves and the root, so no
        row is fully masked (softmax over nothing is NaN); real rows never see a pad."""
        size = self._size(size)
        n = self.num_valid
        out = torch.eye(size + 1, dtype=torch.bool, device=self.parents.device)
        out[:, 0] = True
        out[:n, :n] = _ancestors(self.parents, self.max_depth)
        return out

    def path_rows(self, path: Sequence[int]) -> list[int]:
        """Verify rows whose keys/values the cache keeps after `walk`: the root, then the path."""
        return [0] + [node + 1 for node in path]


def _read_candidates(
    top_logprobs: Tensor, top_ids: Tensor
) -> tuple[list[list[float]], list[list[int]]]:
    """Sorted Python rows (one read-back), checked: the search's order guarantees need
    log-probs <= 0 sorted descending, and the child lookup needs distinct ids per slot."""
    if top_logprobs.dim() != 2 or top_logprobs.shape != top_ids.shape or top_ids.numel() == 0:
        raise ValueError(
            f"expected top_logprobs and top_ids of one shape (S, k) with S, k >= 1; got "
            f"{tuple(top_logprobs.shape)} and {tuple(top_ids.shape)}"
        )
    # stable: equal log-probs keep the caller's order, so ranks (and ties) are deterministic
    lp, order = top_logprobs.double().sort(dim=-1, descending=True, stable=True)
    ids = top_ids.gather(-1, order)
    lp_rows, id_rows = lp.tolist(), ids.tolist()
    for s, (lps, row) in enumerate(zip(lp_rows, id_rows, strict=True), start=1):
        if not lps[0] <= 0.0:  # also catches NaN
            raise ValueError(f"slot {s}: expected log-probabilities (<= 0), got {lps[0]}")
        if len(set(row)) != len(row):
            raise ValueError(f"slot {s}: candidate ids {row} repeat; expected distinct ids")
    return lp_rows, id_rows


def build_tree(
    top_logprobs: Tensor, top_ids: Tensor, budget: int, device: torch.device | None = None
) -> DraftTree:
    """Best-first draft tree of min(budget, sum_d k^d) nodes (module docstring) from slot
    candidates (S, k); row s-1 is slot s (depth s). Tensors go to `device` (the ids' device by
    default); the search runs in Python on one read-back.

    Measured (median, CPU, niced on a busy 2-core machine): S=15, budget 128 builds in 0.27 ms
    (k=8) / 0.29 ms (k=16), flat or peaked drafter alike; `attention(128)` adds 0.07-0.1 ms,
    `walk` 4 us. The engine grows its trees on the device (`grow_tree`)."""
    if budget < 1:
        raise ValueError(f"budget {budget} must be >= 1")
    lp, ids = _read_candidates(top_logprobs, top_ids)
    S, k = len(lp), len(lp[0])
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    children: dict[tuple[int, int], int] = {}
    # entry: (-score, ranks, parent node). The rank tuple breaks ties: it sorts after the
    # prefix that pushes it (its parent is a proper prefix, its previous sibling one rank less),
    # so pops follow (score desc, ranks asc) exactly and the brute-force order is reproducible.
    heap: list[tuple[float, tuple[int, ...], int]] = [(-lp[0][0], (0,), -1)]
    while heap and len(tokens) < budget:
        neg, ranks, parent = heapq.heappop(heap)
        node, d, r = len(tokens), len(ranks), ranks[-1]
        score = -neg
        token = ids[d - 1][r]
        tokens.append(token)
        parents.append(parent)
        depths.append(d)
        scores.append(score)
        children[(parent, token)] = node
        if d < S:  # first child: rank 0 one slot deeper
            heapq.heappush(heap, (-(score + lp[d][0]), ranks + (0,), node))
        if r + 1 < k:  # next sibling: same parent, next rank
            base = scores[parent] if parent >= 0 else 0.0
            heapq.heappush(heap, (-(base + lp[d - 1][r + 1]), ranks[:-1] + (r + 1,), parent))
    device = top_ids.device if device is None else device

    def as_tensor(values: list, dtype: torch.dtype) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return DraftTree(
        tokens=as_tensor(tokens, torch.long),
        parents=as_tensor(parents, torch.long),
        depth=as_tensor(depths, torch.long),
        scores=as_tensor(scores, torch.float64),
        children=children,
        max_depth=max(depths, default=0),
    )


def walk(tree: DraftTree, greedy: Sequence[int] | Tensor) -> tuple[list[int], int]:
    """Accept along the tree: greedy[i] is the target's argmax after verify row i (0 = root,
    i + 1 = node i; pad rows past num_valid are ignored). From the root, step to the child whose
    token is greedy at the current node, until none is. Returns (path: matched node indices,
    root to leaf; bonus: greedy at the last matched node, or the root's). The accepted tokens
    are greedy at `tree.path_rows(path)`, the bonus last: accepted length = len(path) + 1."""
    if isinstance(greedy, Tensor):
        greedy = greedy.tolist()  # the step's one small read-back
    if len(greedy) < tree.num_valid:
        raise ValueError(
            f"greedy has {len(greedy)} entries; expected >= {tree.num_valid} (root + nodes)"
        )
    path: list[int] = []
    node = -1
    while (child := tree.children.get((node, greedy[node + 1]))) is not None:
        path.append(child)
        node = child
    return path, greedy[node + 1]
