"""DDTree draft trees: best-first = top-budget prefixes, ancestor masks, padding, the walk; the
host reference (tree_reference.py) against brute force, the device tree against the reference."""

import itertools
import math

import pytest
import torch
from tree_reference import DraftTree, build_tree, walk

from dflashpipe.decoding.tree_search import draft_candidates, grow_tree, walk_static


def candidates(S: int, k: int, seed: int, vocab: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    """Real-looking slot candidates: top-k of random logits, (S, k) each."""
    g = torch.Generator().manual_seed(seed)
    return draft_candidates(torch.randn(S, vocab, generator=g) * 2, k)


def brute_force(lp: torch.Tensor, budget: int) -> list[tuple[int, ...]]:
    """Every rank prefix of every depth, summed left to right as the builder does, sorted by
    (score desc, ranks asc); the first `budget`."""
    rows = lp.double().tolist()
    S, k = lp.shape
    prefixes = []
    for d in range(1, S + 1):
        for ranks in itertools.product(range(k), repeat=d):
            score = 0.0
            for depth, r in enumerate(ranks):
                score = score + rows[depth][r]
            prefixes.append((-score, ranks))
    return [ranks for _, ranks in sorted(prefixes)[:budget]]


def node_ranks(tree: DraftTree, ids: torch.Tensor) -> list[tuple[int, ...]]:
    """Each node's rank prefix, from its ancestors' tokens (ids are distinct within a slot)."""
    tokens, parents, depth = tree.tokens.tolist(), tree.parents.tolist(), tree.depth.tolist()
    out: list[tuple[int, ...]] = []
    for i in range(tree.num_nodes):
        rank = ids[depth[i] - 1].tolist().index(tokens[i])
        out.append((out[parents[i]] if parents[i] >= 0 else ()) + (rank,))
    return out


def ancestors(tree: DraftTree, row: int) -> set[int]:
    """Verify rows seen by `row` (0 = root), by walking parents in Python."""
    seen, node = {0, row}, row - 1
    while node >= 0:
        seen.add(node + 1)
        node = tree.parents[node].item()
    return seen


@pytest.mark.parametrize(("S", "k", "budget"), [(3, 3, 10), (4, 2, 30), (3, 4, 84), (2, 3, 5)])
def test_nodes_are_the_top_budget_prefixes_in_order(S, k, budget):
    for seed in range(3):
        lp, ids = candidates(S, k, seed)
        tree = build_tree(lp, ids, budget)
        reachable = sum(k**d for d in range(1, S + 1))
        assert tree.num_nodes == min(budget, reachable)
        assert node_ranks(tree, ids) == brute_force(lp, budget)
        scores = tree.scores.tolist()
        assert scores == sorted(scores, reverse=True)


def test_ties_follow_rank_order():
    # Quantized log-probs: many prefixes score exactly alike; the ranks decide, as documented.
    lp = torch.tensor([[0.0, -1.0, -1.0], [-1.0, -1.0, -2.0], [0.0, 0.0, -1.0]])
    ids = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    for budget in range(1, 40):
        tree = build_tree(lp, ids, budget)
        assert node_ranks(tree, ids) == brute_force(lp, budget)


def test_parents_precede_children_and_depths_step_by_one():
    lp, ids = candidates(15, 8, seed=0, vocab=200)
    tree = build_tree(lp, ids, 128)
    parents, depth = tree.parents.tolist(), tree.depth.tolist()
    for i, p in enumerate(parents):
        assert p < i
        assert depth[i] == (depth[p] + 1 if p >= 0 else 1)
    assert tree.max_depth == max(depth)
    assert len(tree.children) == tree.num_nodes  # no (parent, token) collides


def test_chain_is_in_the_tree_down_to_its_deepest_level():
    lp, ids = candidates(15, 8, seed=4, vocab=200)
    for budget in (1, 5, 15, 40, 128):
        tree = build_tree(lp, ids, budget)
        node = -1
        for d in range(tree.max_depth):
            node = tree.children[(node, ids[d, 0].item())]
        assert tree.depth[node].item() == tree.max_depth


def test_chain_is_not_always_first():
    # Slot 2 is unsure, slot 1's runner-up likely: it outranks the chain's depth-2 node.
    lp = torch.tensor([[math.log(0.55), math.log(0.45)], [math.log(0.3), math.log(0.2)]])
    tree = build_tree(lp, torch.tensor([[1, 2], [3, 4]]), budget=2)
    assert tree.tokens.tolist() == [1, 2]
    assert tree.parents.tolist() == [-1, -1]


def test_budget_S_with_k_1_is_the_chain():
    lp, ids = candidates(15, 1, seed=2)
    tree = build_tree(lp, ids, budget=15)
    assert tree.tokens.tolist() == ids[:, 0].tolist()
    assert tree.parents.tolist() == list(range(-1, 14))
    assert tree.depth.tolist() == list(range(1, 16))
    assert build_tree(lp, ids, budget=128).num_nodes == 15  # nothing else is reachable


def test_unsorted_rows_are_sorted_first():
    lp, ids = candidates(4, 3, seed=5)
    flip = torch.arange(2, -1, -1)
    a, b = build_tree(lp, ids, 20), build_tree(lp[:, flip], ids[:, flip], 20)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


def test_bad_candidates_are_refused():
    ids = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match="log-probabilities"):
        build_tree(torch.tensor([[0.5, -1.0]]), ids, 4)
    with pytest.raises(ValueError, match="log-probabilities"):
        build_tree(torch.tensor([[float("nan"), -1.0]]), ids, 4)
    with pytest.raises(ValueError, match="repeat"):
        build_tree(torch.tensor([[0.0, -1.0]]), torch.tensor([[3, 3]]), 4)
    with pytest.raises(ValueError, match="shape"):
        build_tree(torch.zeros(2, 3), torch.zeros(2, 2, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="budget"):
        build_tree(torch.tensor([[0.0, -1.0]]), ids, 0)


def test_attention_is_the_ancestor_sets():
    for S, k, budget in [(15, 8, 128), (6, 3, 50), (1, 4, 3), (15, 1, 15)]:
        lp, ids = candidates(S, k, seed=S + k, vocab=100)
        tree = build_tree(lp, ids, budget)
        mask = tree.attention()
        assert mask.shape == (tree.num_valid, tree.num_valid) and mask.dtype == torch.bool
        for row in range(tree.num_valid):
            assert set(mask[row].nonzero().flatten().tolist()) == ancestors(tree, row)
        assert tree.positions().tolist() == [0] + tree.depth.tolist()


def test_padding_keeps_real_rows_and_isolates_pads():
    lp, ids = candidates(5, 3, seed=7)
    tree = build_tree(lp, ids, 20)
    n, size = tree.num_valid, 32
    real, padded = tree.attention(), tree.attention(size)
    assert padded.shape == (size + 1, size + 1)
    assert torch.equal(padded[:n, :n], real)
    assert not padded[:n, n:].any()  # no real row sees a pad
    pads = padded[n:]
    assert pads[:, 0].all() and torch.equal(
        pads[:, 1:], torch.eye(size + 1, dtype=torch.bool)[n:, 1:]
    )
    positions = tree.positions(size)
    assert positions.tolist() == [0] + tree.depth.tolist() + [1] * (size + 1 - n)
    inputs = tree.input_ids(anchor=99, size=size, pad_id=7)
    assert inputs.tolist() == [99] + tree.tokens.tolist() + [7] * (size + 1 - n)
    assert tree.input_ids(anchor=99).tolist() == [99] + tree.tokens.tolist()
    with pytest.raises(ValueError, match="pad"):
        tree.attention(tree.num_nodes - 1)


def hand_tree() -> DraftTree:
    """root ─┬─ 10 (node 0) ── 11 (node 1) ── 12 (node 2)
    └─ 20 (node 3) ── 11 (node 4)     token 11 under two parents: the lookup keys both"""
    lp = torch.tensor([[-0.1, -0.3, -9.0], [-0.05, -9.0, -9.5], [-0.05, -9.0, -9.5]])
    ids = torch.tensor([[10, 20, 30], [11, 21, 31], [12, 22, 32]])
    tree = build_tree(lp, ids, budget=5)
    assert tree.tokens.tolist() == [10, 11, 12, 20, 11]
    assert tree.parents.tolist() == [-1, 0, 1, -1, 3]
    return tree


def test_walk_full_match_takes_the_bonus_after_the_leaf():
    tree = hand_tree()
    greedy = [10, 11, 12, 77, 0, 0]  # row i + 1 is node i; 77 follows node 2 (the leaf 12)
    path, bonus = walk(tree, torch.tensor(greedy))
    assert (path, bonus) == ([0, 1, 2], 77)
    assert tree.path_rows(path) == [0, 1, 2, 3]
    assert [greedy[r] for r in tree.path_rows(path)] == [10, 11, 12, 77]  # accepted, bonus last


def test_walk_mismatch_at_root_accepts_only_the_bonus():
    assert walk(hand_tree(), [5, 11, 12, 0, 11, 0]) == ([], 5)


def test_walk_follows_a_branch_other_than_rank_0():
    # the target picks slot 1's runner-up (20), then 11 below it; node 4 is a leaf
    path, bonus = walk(hand_tree(), [20, 11, 12, 0, 11, 42])
    assert (path, bonus) == ([3, 4], 42)


def test_walk_stops_mid_path_and_ignores_pad_rows():
    tree = hand_tree()
    greedy = [10, 13, 0, 0, 0, 0] + [12] * 4  # pads past row 5 never count
    assert walk(tree, greedy) == ([0], 13)
    with pytest.raises(ValueError, match="expected >= 6"):
        walk(tree, [10, 11])


def test_walk_is_lossless_against_a_greedy_oracle():
    # The target is a fixed next-token function of the path; the walk accepts its own rollout.
    lp, ids = candidates(6, 4, seed=9, vocab=8)
    tree = build_tree(lp, ids, 60)
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()

    def oracle(prefix: tuple[int, ...]) -> int:
        return hash(prefix) % 8

    def prefix(node: int) -> tuple[int, ...]:
        return () if node < 0 else prefix(parents[node]) + (tokens[node],)

    greedy = [oracle(())] + [oracle(prefix(i)) for i in range(tree.num_nodes)]
    path, bonus = walk(tree, greedy)
    accepted = [greedy[r] for r in tree.path_rows(path)]
    rollout: list[int] = []
    for _ in accepted:
        rollout.append(oracle(tuple(rollout)))
    assert accepted == rollout and accepted[-1] == bonus


@pytest.mark.parametrize(
    ("S", "k", "budget"), [(3, 3, 10), (4, 2, 30), (3, 4, 84), (2, 3, 5), (7, 8, 64), (7, 1, 16)]
)
def test_device_tree_is_the_reference_tree_in_fixed_shape(S, k, budget):
    """grow_tree (graph-safe, no host sync) gives build_tree's nodes in its order, then pads."""
    for seed in range(3):
        lp, ids = candidates(S, k, seed)
        want, got = build_tree(lp, ids, budget), grow_tree(lp, ids, budget)
        n = want.num_nodes
        assert got.tokens.shape == (budget,) and got.valid.tolist() == [True] * n + [False] * (
            budget - n
        )
        assert got.tokens[:n].tolist() == want.tokens.tolist()
        assert got.parents.tolist() == want.parents.tolist() + [-1] * (budget - n)
        assert got.depth.tolist() == want.depth.tolist() + [1] * (budget - n)
        assert torch.equal(got.visible, want.attention(budget))


def test_device_tree_with_ties_is_a_best_parent_closed_set():
    # Exact ties may order differently from build_tree's rank rule; the set stays one of the
    # best-scoring prefix sets, every node's parent in it and before it.
    lp = torch.tensor([[0.0, -1.0, -1.0], [-1.0, -1.0, -2.0], [0.0, 0.0, -1.0]])
    ids = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    rows = lp.double().tolist()
    for budget in range(1, 40):
        tree = grow_tree(lp, ids, budget)
        valid = tree.valid.tolist()
        assert sum(valid) == budget  # 39 prefixes exist
        ranks: list[tuple[int, ...]] = []
        for i, (token, parent, depth) in enumerate(
            zip(tree.tokens.tolist(), tree.parents.tolist(), tree.depth.tolist(), strict=True)
        ):
            assert parent < i and depth == (tree.depth[parent].item() + 1 if parent >= 0 else 1)
            ranks.append(
                (ranks[parent] if parent >= 0 else ()) + (ids[depth - 1].tolist().index(token),)
            )
        assert len(set(ranks)) == budget
        scores = sorted(sum(rows[d][r] for d, r in enumerate(p)) for p in ranks)
        best = sorted(sum(rows[d][r] for d, r in enumerate(p)) for p in brute_force(lp, budget))
        assert scores == best


def test_device_walk_keeps_the_reference_path():
    """walk_static's rows and bonus equal walk's on planted paths through a real tree, at every
    depth from a root mismatch to a full-depth match."""
    g = torch.Generator().manual_seed(4)
    S, budget = 5, 24
    lp, ids = candidates(S, 3, seed=2)
    ref, tree = build_tree(lp, ids, budget), grow_tree(lp, ids, budget)
    parents = ref.parents.tolist()
    depths_seen = set()
    for _ in range(60):
        greedy = torch.randint(50, 100, (budget + 1,), generator=g)  # matches no candidate id
        node, stop = -1, torch.randint(0, S + 1, (1,), generator=g).item()
        for _ in range(stop):
            kids = [i for i in range(ref.num_nodes) if parents[i] == node]
            if not kids:
                break
            pick = torch.randint(len(kids), (1,), generator=g).item()
            child = kids[0] if torch.rand(1, generator=g).item() < 0.7 else kids[pick]
            greedy[node + 1] = ref.tokens[child]
            node = child
        path, bonus = walk(ref, greedy)
        rows = walk_static(tree, greedy)
        L = len(path)
        depths_seen.add(L)
        assert rows[: L + 1].tolist() == ref.path_rows(path)
        assert rows[L:].tolist() == [rows[L].item()] * (S + 1 - L)  # repeated: fixed shape
        assert greedy[rows[L]].item() == bonus
    assert {0, ref.max_depth} <= depths_seen


def selector_case(S: int, k: int, seed: int, zero: bool = False):
    """A DFlash2 selector (random codebooks, or its step-0 zero successor codebook), slot states
    (S, H), an anchor and the slots' candidates, over a 50-token vocabulary."""
    from dflashpipe.dflash2 import CandidateSelector

    torch.manual_seed(seed)
    selector = CandidateSelector(vocab_size=50, hidden_size=12, rank=6, top_k=k)
    if not zero:
        torch.nn.init.normal_(selector.successor_codebook, std=2.0)
        torch.nn.init.normal_(selector.hidden_projection.weight, std=1.0)
        torch.nn.init.normal_(selector.predecessor_codebook, std=1.0)
    lp, ids = candidates(S, k, seed)
    return selector, torch.randn(S, 12), torch.tensor([7]), lp, ids


def tree_paths(tree) -> list[tuple[int, ...]]:
    """Each valid node's token path from the root, in the tree's order."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    out = []
    for i in range(len(tokens)):
        if not tree.valid[i]:
            continue
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        out.append(tuple(reversed(path)))
    return out


def selector_brute_force(selector, hidden, anchor, lp, ids, budget):
    """Every token path of every depth scored in float64 as p(path) = prod over slots of the
    slot's top-k unary mass x the selector's softmax over its k candidates of (unary log-prob +
    edge from the previous token), computed here one path at a time; the best `budget` paths."""
    S, k = lp.shape
    scored = []
    with torch.no_grad():
        for d in range(1, S + 1):
            for ranks in itertools.product(range(k), repeat=d):
                prev, score, path = int(anchor), 0.0, []
                for depth, r in enumerate(ranks):
                    cand = ids[depth]
                    edge = selector.edge_scores(
                        hidden[depth][None], torch.tensor([prev]), cand[None]
                    )[0]
                    s = lp[depth].double() + edge.double()
                    mass = lp[depth].double().exp().sum()
                    score += (s[r].exp() / s.exp().sum() * mass).log().item()
                    prev = int(cand[r])
                    path.append(prev)
                scored.append((-score, tuple(path)))
    return [p for _, p in sorted(scored)[:budget]]


@pytest.mark.parametrize("S, k, budget", [(3, 3, 10), (4, 2, 9), (2, 4, 12)])
def test_selector_tree_is_the_best_budget_paths_under_the_selectors_scores(S, k, budget):
    """A DFlash2 drafter's tree: every node's children scored by the selector from the node's own
    token; the device tree holds exactly the best `budget` paths of a one-path-at-a-time
    enumeration, parents first, and differs from the unary tree on the same candidates."""
    selector, hidden, anchor, lp, ids = selector_case(S, k, seed=S * 10 + k)
    with torch.no_grad():
        tree = grow_tree(lp, ids, budget, selector, hidden, anchor)
    paths = tree_paths(tree)
    want = selector_brute_force(selector, hidden, anchor, lp, ids, budget)
    assert sorted(paths) == sorted(want) and len(paths) == budget
    assert all(p[:-1] in paths[:i] for i, p in enumerate(paths) if len(p) > 1)  # parents first
    assert sorted(tree_paths(grow_tree(lp, ids, budget))) != sorted(paths)


def test_selector_tree_at_step_0_is_the_unary_tree():
    """A zero successor codebook (the selector as initialised) adds no edge: the same tree."""
    selector, hidden, anchor, lp, ids = selector_case(4, 3, seed=3, zero=True)
    with torch.no_grad():
        got = grow_tree(lp, ids, 12, selector, hidden, anchor)
    want = grow_tree(lp, ids, 12)
    for name in ("tokens", "parents", "depth", "valid"):
        assert getattr(got, name).tolist() == getattr(want, name).tolist(), name
