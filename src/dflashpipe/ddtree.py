"""DDTree decoding on the static engine: one drafter pass, a tree of `budget` nodes, one verify.

    device state    T = committed length, anchor = last accepted token (engine.py)
    draft           drafter block [anchor, MASK x S] -> per slot 1..S top-k log-probs and ids
                    packed (S, 2k) float64                       read back: the one draft read
    host            tree.build_tree(..., budget) -> nodes; padded to `budget` (fixed shape):
                    plan = [anchor, tokens, pads | depth offsets | ancestor matrix]  -> device
    verify          target(plan ids) at positions T + depth, slots T..T+budget,
                    visible = ancestor-or-self -> greedy g_0..g_budget, tapped states
                                                                  read back: g (budget+1,)
    host            tree.walk(g) -> path, bonus; rows = path_rows(path) (root first), padded
                    to B with the last row             -> device: [len(path)+1, bonus, rows]
    commit          target K/V of slots T + rows -> slots T..T+B-1 (StaticTarget.commit);
                    drafter.append(states[rows], T); anchor = bonus; T += len(path)+1

Rows past the accepted count are written too (fixed shapes) but lie past T: masked, and
overwritten by the next step, as in the DFlash step. Each kind (draft per k, verify and commit
per budget) is captured once as a CUDA graph when the engine uses graphs; on the CPU the same
step functions run directly. Every accepted token is the target's own greedy choice after its
ancestors, so the output equals target-only greedy decoding (up to rounding).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dflashpipe.speculative import Decoded
from dflashpipe.tree import build_tree, walk

if TYPE_CHECKING:
    from dflashpipe.engine import Engine


def empty_plan(budget: int, device: torch.device) -> Tensor:
    """The verify input of a tree of pads only: ids 0, offsets [0, 1, ..], each row seeing itself
    and the root. Warm-up and capture run on it: no row is fully masked (NaN K/V would poison
    later steps through masked-out columns)."""
    n = budget + 1
    visible = torch.eye(n, dtype=torch.long, device=device)  # (n, n)
    visible[:, 0] = 1
    offsets = torch.ones(n, dtype=torch.long, device=device)
    offsets[0] = 0
    return torch.cat([torch.zeros(n, dtype=torch.long, device=device), offsets, visible.flatten()])


class TreeSteps:
    """The DDTree step functions and static buffers of one Engine (which has a drafter); each
    (top-k, budget) pair registers its step kinds in `engine.steps` on first use."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.block_size = engine.drafter.block_size
        self.device = engine.device
        self.candidates: dict[int, Tensor] = {}  # k -> (S, 2k) float64: [log-probs | ids]
        self.plans: dict[int, Tensor] = {}  # budget -> ((N+1)(N+3),): ids, offsets, visible
        self.greedy: dict[int, Tensor] = {}  # budget -> (N+1,)
        self.states: dict[int, Tensor] = {}  # budget -> (N+1, n_taps*H)
        # [accepted count, bonus, verify rows to keep (B,)]
        self.commits = torch.zeros(self.block_size + 2, dtype=torch.long, device=self.device)

    def kinds(self, budget: int, k: int) -> tuple[str, str, str]:
        """Step kinds (draft, verify, commit) of this pair, registered with their buffers."""
        e = self.engine
        draft, verify, commit = f"tree_draft@k{k}", f"tree_verify@{budget}", f"tree_commit@{budget}"
        if k not in self.candidates:
            S = self.block_size - 1
            self.candidates[k] = torch.zeros(S, 2 * k, dtype=torch.float64, device=self.device)
            e.steps[draft] = lambda: self._draft(k)
        if budget not in self.plans:
            self.plans[budget] = empty_plan(budget, self.device)
            self.greedy[budget] = torch.zeros(budget + 1, dtype=torch.long, device=self.device)
            width = len(e.target.layer_ids) * e.target.model.config.get_text_config().hidden_size
            self.states[budget] = torch.zeros(
                budget + 1, width, dtype=e.target.dtype, device=self.device
            )
            e.steps[verify] = lambda: self._verify(budget)
            e.steps[commit] = lambda: self._commit(budget)
        return draft, verify, commit

    def _draft(self, k: int) -> None:
        e = self.engine
        logprobs, ids = e.drafter.top_k(e.anchor, e.length, k)  # (S, k) each
        self.candidates[k].copy_(torch.cat([logprobs.double(), ids.double()], -1))  # ids exact

    def _verify(self, budget: int) -> None:
        e, n = self.engine, budget + 1
        plan = self.plans[budget]
        T = e.length
        ids, offsets = plan[:n], plan[n : 2 * n]  # (n,) each
        visible = plan[2 * n :].view(n, n) != 0  # (n, n)
        slots = T + torch.arange(n, device=self.device)  # (n,)
        logits, states = e.target.forward(ids, T + offsets, slots, T, visible, taps=True)
        self.greedy[budget].copy_(logits.argmax(-1))  # (n,)
        self.states[budget].copy_(states)  # (n, n_taps*H)

    def _commit(self, budget: int) -> None:
        e, c = self.engine, self.commits
        T = e.length
        rows = c[2:]  # (B,)
        e.target.commit(T + rows, T)
        e.drafter.append(self.states[budget].index_select(0, rows), T)
        e.anchor.copy_(c[1:2])
        e.length.add_(c[:1])

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
        draft, verify, commit = self.kinds(budget, k)
        # Capture runs the commit on what `commits` holds: rows of an earlier, larger budget
        # would index past this budget's states; [1, 0, 0..] keeps the root only.
        self.commits.copy_(torch.tensor([1] + [0] * (self.block_size + 1)))
        e._capture([draft, verify, commit])
        B = self.block_size

        def step(out: list[int]) -> tuple[list[int], int]:
            e._run(draft)
            candidates = self.candidates[k].cpu()  # (S, 2k): the draft's one read-back
            tree = build_tree(candidates[:, :k], candidates[:, k:].long(), budget)
            plan = torch.cat(
                [
                    tree.input_ids(out[-1], budget),
                    tree.positions(budget),
                    tree.attention(budget).flatten().long(),
                ]
            )
            self.plans[budget].copy_(plan)
            e._run(verify)
            path, bonus = walk(tree, self.greedy[budget].tolist())  # the verify's read-back
            rows = tree.path_rows(path)
            rows += rows[-1:] * (B - len(rows))  # fixed shape; the extra rows lie past T
            self.commits.copy_(torch.tensor([len(path) + 1, bonus, *rows]))
            e._run(commit)
            tokens = tree.tokens.tolist()
            return [tokens[i] for i in path] + [bonus], tree.num_nodes

        return e.speculate(prompt_ids, max_new_tokens, stop_ids, True, step)
