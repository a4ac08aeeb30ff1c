"""The decoding methods evaluate compares, on one engine per process and dtype.

    engine: auto ─► static_models.check_target(model) passes? ─ yes ─► static Engine (graphs)
                 │                                           └ no ──► eager loop, reason recorded
    engine: eager ───────────────────────────────────────────────────► eager loop

    method          static engine                       eager loop (eager.py)
    target          Engine.greedy                       greedy_decode
    dflash          Engine.dflash                       speculative_decode + DFlashProposer
    ddtree@N        Engine.ddtree(N, tree_top_k)        - (no eager tree loop: not run)
    prompt_lookup   Engine.lookup (host drafts,            speculative_decode +
                    one fixed-shape verify)             PromptLookupProposer

Every method decodes every prompt, interleaved per prompt so drift in machine speed hits all of
them alike, after one untimed warm-up response each (allocator, kernels, graph capture).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict

from torch import nn
from tqdm import tqdm

import dflashpipe.decoding.ddtree  # noqa: F401 (registers the engine's "ddtree" steps)
from dflashpipe.decoding.eager import DFlashProposer, Target, greedy_decode, speculative_decode
from dflashpipe.decoding.engine import Engine
from dflashpipe.decoding.families import check_target
from dflashpipe.decoding.lookup import LookupConfig, PromptLookupProposer
from dflashpipe.decoding.types import Decoded
from dflashpipe.model import Drafter

log = logging.getLogger(__name__)


def tree_method(budget: int) -> str:
    return f"ddtree@{budget}"


class Decoders:
    """One process's decoders of the `methods` (the schema's evaluate.methods; ddtree expands to one method per
    budget of `tree_nodes`) over `model` + `drafter`. `max_len` bounds prompt + new tokens +
    the largest step's slack (the static engine's buffers); `compile`: the engine's (default: on
    with graphs); `selector` False: a DFlash2 drafter decodes from its unary logits alone, its
    chain their argmax and its DDTree their log-probs (evaluate.selector; the drafter's
    candidate_selector is taken off it)."""

    def __init__(
        self, model: nn.Module, drafter: Drafter, methods: Sequence[str], engine: str,
        max_len: int, tree_nodes: Sequence[int] = (), tree_top_k: int = 8,
        lookup: LookupConfig | None = None, compile: bool | None = None,
        selector: bool = True,
    ):  # fmt: skip
        self.kind, self.reason = "eager", "evaluate.engine: eager"
        if not selector and getattr(drafter, "candidate_selector", None) is not None:
            drafter.candidate_selector = None  # before the engine captures the drafter's steps
        if engine == "auto":
            try:
                check_target(model)
                self.kind, self.reason = "static", None
            except ValueError as e:
                self.reason = str(e)
        self.engine = (
            Engine(model, max_len, drafter, compile=compile) if self.kind == "static" else None
        )
        self.graphs = bool(self.engine and self.engine.graphs)
        self.compiled = bool(self.engine and self.engine.compiled)
        self.top_k = tree_top_k
        self.dflash = DFlashProposer(drafter)
        self.lookup = PromptLookupProposer(**asdict(lookup or LookupConfig()))
        # The eager loop taps the drafter's layers only where it decodes DFlash.
        self.target = Target(model, [] if self.engine else drafter.config.target_layer_ids)
        self.methods = ["target", "dflash"]
        if "ddtree" in methods:
            if self.engine is None:
                log.warning("ddtree needs the static engine (%s); not run", self.reason)
            else:
                self.methods += [tree_method(n) for n in tree_nodes]
        if "prompt_lookup" in methods:
            self.methods.append("prompt_lookup")
        self.budgets = {tree_method(n): n for n in tree_nodes}

    def info(self) -> dict:
        """metrics.json's `engine` entry."""
        out = {"kind": self.kind, "graphs": self.graphs, "compiled": self.compiled}
        return out | ({"reason": self.reason} if self.reason else {})

    def decode(self, method: str, ids: list[int], n: int, stop_ids: set[int]) -> Decoded:
        e = self.engine
        if method == "target" and e is not None:
            return e.greedy(ids, n, stop_ids)
        if method == "target":
            return greedy_decode(self.target, ids, n, stop_ids)
        if method == "dflash" and e is not None:
            return e.dflash(ids, n, stop_ids)
        if method == "dflash":
            return speculative_decode(self.target, self.dflash, ids, n, stop_ids)
        if method == "prompt_lookup":
            return self._lookup(ids, n, stop_ids, self.lookup)
        return e.ddtree(ids, n, stop_ids, self.budgets[method], self.top_k)

    def _lookup(
        self, ids: list[int], n: int, stop_ids: set[int], proposer: PromptLookupProposer
    ) -> Decoded:
        if self.engine is not None:
            return self.engine.lookup(ids, n, stop_ids, proposer)
        return speculative_decode(self.target, proposer, ids, n, stop_ids)

    def lookup_all(
        self, prompts: list[tuple[dict, list[int]]], configs: Sequence[LookupConfig],
        max_new_tokens: int, stop_ids: set[int], desc: str,
    ) -> list[Decoded]:  # fmt: skip
        """Prompt lookup once more, prompt k with configs[k] (e.g. its source's best), each
        configuration warmed up first, as decode_all does."""
        proposers = {c: PromptLookupProposer(**asdict(c)) for c in dict.fromkeys(configs)}
        for proposer in proposers.values():
            self._lookup(prompts[0][1], min(max_new_tokens, 8), stop_ids, proposer)
        return [
            self._lookup(ids, max_new_tokens, stop_ids, proposers[c])
            for (_, ids), c in tqdm(
                list(zip(prompts, configs, strict=True)), desc=desc, unit=" prompt"
            )
        ]

    def decode_all(
        self, prompts: list[tuple[dict, list[int]]], max_new_tokens: int, stop_ids: set[int],
        desc: str,
    ) -> dict[str, list[Decoded]]:  # fmt: skip
        """Every method on every prompt (module docstring)."""
        for method in self.methods:
            self.decode(method, prompts[0][1], min(max_new_tokens, 8), stop_ids)
        results: dict[str, list[Decoded]] = {m: [] for m in self.methods}
        for _, ids in tqdm(prompts, desc=desc, unit=" prompt"):
            for method in self.methods:
                results[method].append(self.decode(method, ids, max_new_tokens, stop_ids))
        return results

    def close(self) -> None:
        self.target.close()
