"""DDTree decoding on the static engine: draft, tree, verify, walk and commit in one step.

    device state    T = committed length, anchor = last accepted token (engine.py)
    draft           drafter block [anchor, MASK x S] -> per slot 1..S top-k log-probs and ids
    tree            tree_search.grow_tree(..., budget): the best `budget` prefixes, fixed shape
                    (a DFlash2 drafter's: each node's children scored by its selector)
                    (unreachable ones padded), parents, depths, ancestor matrix
    verify          target([anchor, node tokens]) at positions T + depth, slots T..T+budget,
                    visible = ancestor-or-self (a windowed layer's mask also measures the
                    window from each node's position) -> greedy g_0..g_budget, tapped states
    walk            tree_search.walk_static(tree, g) -> rows (B,): root, then the matched node per
                    depth, repeated past the deepest; L = matched depth
    commit          target K/V of slots T + rows -> slots T..T+B-1 (StaticTarget.commit);
                    drafter.append(states[rows], T); anchor = g[rows[L]]; T += L+1
                    read back: [L+1, g[rows]] (B+1,), the step's one read-back

One step kind per (budget, top-k), captured once as a CUDA graph when the engine uses graphs;
on the CPU the same step function runs directly. Rows past the accepted count are written too
(fixed shapes) but lie past T: masked, and overwritten by the next step, as in the DFlash step.
Every accepted token is the target's own greedy choice after its ancestors, so the output equals
target-only greedy decoding (up to rounding). The tree is grown, verified, walked and committed in
one graph with no sync; the commit (a gather and a scatter) moves all layers at once through the one
K/V buffer: 1.46 target steps at 16 nodes on SmolLM2's shape, where one buffer per layer took 2.10
(benchmarks/RESULTS.md, 2026-12-04).

The engine does not know this module: importing it registers the "ddtree" step family
(`Engine.register_steps`), which `Engine.ddtree` and the runner use.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflashpipe.decoding.engine import Engine
from dflashpipe.decoding.static_models import compiled
from dflashpipe.decoding.tree_search import StaticTree, grow_tree, walk_static
from dflashpipe.decoding.types import Decoded


class TreeSteps:
    """The DDTree step functions and static buffers of one Engine (which has a drafter), its
    "ddtree" step family; each (budget, top-k) pair adds its step kind on first use."""

    def __init__(self, engine: Engine):
        if engine.drafter is None:
            raise ValueError("this Engine was built without a drafter; pass drafter= to decode")
        self.engine = engine
        self.block_size = engine.drafter.block_size
        # a DFlash2 drafter's tree: each node's children scored by the selector from its token
        self.selector = getattr(engine.drafter.drafter, "candidate_selector", None)
        self.device = engine.device
        self.packed: dict[tuple[int, int], torch.Tensor] = {}  # (budget, k) -> [L+1, g[rows]]
        # The search and the walk are dozens of small ops: compiled with the engine's layers,
        # one graph per (budget, k) shape.
        self.grow = compiled(grow_tree, engine.compiled)
        self.inputs = compiled(tree_inputs, engine.compiled)
        self.walk = compiled(walk_tree, engine.compiled)
        self.finish = compiled(finish_step, engine.compiled)

    def kind(self, budget: int, k: int) -> str:
        """The step kind of this pair, registered with its read-back buffer."""
        kind = f"tree@{budget}k{k}"
        if (budget, k) not in self.packed:
            self.packed[budget, k] = torch.zeros(
                self.block_size + 1, dtype=torch.long, device=self.device
            )
            self.engine.add_step(kind, lambda: self._step(budget, k))
        return kind

    def _step(self, budget: int, k: int) -> None:
        e = self.engine
        T = e.length
        logprobs, ids, hidden = e.drafter.top_k(e.anchor, T, k)  # (S, k), (S, k), (S, H)
        tree = self.grow(logprobs, ids, budget, self.selector, hidden, e.anchor)
        tokens, positions, slots = self.inputs(e.anchor, tree, T)  # (n,) each
        logits, states = e.target.forward(tokens, positions, slots, T, tree.visible, taps=True)
        rows, count, accepted = self.walk(tree, logits)
        e.target.commit(T + rows, T)
        e.drafter.append(states.index_select(0, rows), T)
        self.finish(accepted, count, e.anchor, self.packed[budget, k], e.length)

    def check_fit(self, prompt_length: int, max_new_tokens: int, budget: int, k: int) -> None:
        """Refuse, before decoding, what the static buffers cannot hold."""
        if budget < 1:
            raise ValueError(f"tree budget {budget} (evaluate.tree_nodes) must be >= 1")
        vocab = self.engine.drafter.drafter.config.vocab_size
        if not 1 <= k <= vocab:
            raise ValueError(f"top_k {k} (evaluate.tree_top_k) must be in 1..{vocab}")
        if prompt_length < 1 or max_new_tokens < 1:
            raise ValueError(
                f"prompt length {prompt_length} and max_new_tokens {max_new_tokens} must be >= 1"
            )
        # verify writes slots T..T+budget, the drafter's block T..T+B-1
        slack = max(budget + 1, self.block_size)
        need = prompt_length + max_new_tokens + slack
        if need > self.engine.max_len:
            raise ValueError(
                f"prompt length {prompt_length} + max_new_tokens {max_new_tokens} + "
                f"max(tree budget {budget} (evaluate.tree_nodes) + 1, block_size "
                f"{self.block_size}) = {need} does not fit the engine's max_len "
                f"{self.engine.max_len}"
            )

    def decode(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        stop_ids: set[int],
        budget: int,
        k: int,
    ) -> Decoded:
        """DDTree speculative decoding (module docstring); accepted_lengths = len(path) + 1,
        drafted = the tree's real nodes, per step."""
        e = self.engine
        self.check_fit(len(prompt_ids), max_new_tokens, budget, k)
        kind = self.kind(budget, k)
        e.capture([kind])
        S = self.block_size - 1
        real = min(budget, sum(k**d for d in range(1, S + 1)))  # nodes a tree holds

        def step(_: list[int]) -> tuple[list[int], int]:
            e.run(kind)
            count, *accepted = self.packed[budget, k].tolist()  # the step's one read-back
            return accepted[:count], real

        return e.speculate(prompt_ids, max_new_tokens, stop_ids, True, step)


def tree_inputs(anchor: Tensor, tree: StaticTree, length: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The verify's rows [anchor, nodes] (n,): their tokens, positions T + depth (the anchor at
    depth 0) and slots T..T+n-1."""
    tokens = torch.cat([anchor, tree.tokens])
    positions = length + torch.cat([tree.depth.new_zeros(1), tree.depth])
    slots = length + torch.arange(tokens.shape[0], device=tokens.device)
    return tokens, positions, slots


def walk_tree(tree: StaticTree, logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """From the verify's logits (n, V): rows (B,) (tree_search.walk_static on the target's greedy
    tokens), count (1,) = L+1 accepted, and the greedy tokens of those rows (B,)."""
    greedy = logits.argmax(-1)  # (n,)
    rows = walk_static(tree, greedy)  # (B,)
    count = (rows != rows[-1:]).sum(0, keepdim=True) + 1  # (1,): L+1
    return rows, count, greedy.index_select(0, rows)  # the first L+1 are accepted


def finish_step(
    accepted: Tensor, count: Tensor, anchor: Tensor, packed: Tensor, length: Tensor
) -> None:
    """anchor = the last accepted token, packed = [L+1, accepted] (the read-back), T += L+1."""
    anchor.copy_(accepted[-1:])
    packed[:1].copy_(count)
    packed[1:].copy_(accepted)
    length.add_(count)


Engine.register_steps("ddtree", TreeSteps)
