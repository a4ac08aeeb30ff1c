"""Prompt lookup: the n-gram proposer, its replay on a greedy output, and the sweep that finds
its best configuration on the eval prompts (evaluate's baseline).

    proposer   the last n tokens (n = max_ngram_size down to 1) are looked up among the n-grams
               that end before the last token (search "all"), or that end inside the prompt
               ("prompt"); the earliest or the latest such occurrence (`occurrence`) gives the
               drafts: the num_drafts tokens that followed it. "earliest", n <= 2, 10 drafts,
               "all" is transformers' `generate(prompt_lookup_num_tokens=10)`.
    replay     greedy decoding is lossless, so a proposer's acceptance lengths follow from the
               target-only greedy output alone: each step's drafts are matched against the
               output's next tokens, with no target forward. Decoding's last step may accept
               tokens past the response's end (max_new_tokens, or after a stop id); neither
               counts them (Decoded), so replay and decoding give the same counts (a test).
    sweep      GRID (occurrence x max n-gram 1-4 x 5, 10, 16 drafts x search) replayed on every
               prompt's target-only output: 48 configurations for the price of none on the GPU.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflashpipe.decoding.types import Decoded, finish

if TYPE_CHECKING:
    from torch import Tensor

OCCURRENCES = ("earliest", "latest")
SEARCHES = ("all", "prompt")


@dataclass(frozen=True)
class LookupConfig:
    """One prompt-lookup configuration (the proposer's arguments)."""

    num_drafts: int = 10
    max_ngram_size: int = 2
    occurrence: str = "earliest"
    search: str = "all"

    def __post_init__(self) -> None:
        if self.num_drafts < 1 or self.max_ngram_size < 1:
            raise ValueError(
                f"num_drafts {self.num_drafts} and max_ngram_size {self.max_ngram_size} must be "
                ">= 1"
            )
        if self.occurrence not in OCCURRENCES:
            raise ValueError(f"occurrence must be one of {OCCURRENCES}, got {self.occurrence!r}")
        if self.search not in SEARCHES:
            raise ValueError(f"search must be one of {SEARCHES}, got {self.search!r}")

    @property
    def name(self) -> str:
        return f"{self.occurrence} n<={self.max_ngram_size} k={self.num_drafts} {self.search}"


GRID = tuple(
    LookupConfig(k, n, occurrence, search)
    for occurrence, n, k, search in itertools.product(OCCURRENCES, (1, 2, 3, 4), (5, 10, 16), SEARCHES)
)  # fmt: skip


class PromptLookupProposer:
    """The n-gram proposer (module docstring) for speculative_decode and Engine.lookup. An
    incremental index (n-gram -> the end of its earliest or latest occurrence) keeps each step
    O(new tokens)."""

    layer_ids: Sequence[int] = ()

    def __init__(
        self, num_drafts: int = 10, max_ngram_size: int = 2, occurrence: str = "earliest",
        search: str = "all",
    ):  # fmt: skip
        self.config = LookupConfig(num_drafts, max_ngram_size, occurrence, search)
        self.num_drafts, self.max_ngram_size = num_drafts, max_ngram_size
        self._latest = occurrence == "latest"
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending at 1.._indexed are in _ends
        self._prompt_len: int | None = None

    def start(self, prompt_ids: list[int], hidden: Tensor | None) -> None:
        self._ends, self._indexed = {}, 0
        self._prompt_len = len(prompt_ids) if self.config.search == "prompt" else None

    def advance(self, hidden: Tensor | None) -> None:
        pass

    def propose(self, tokens: list[int]) -> list[int]:
        limit = len(tokens) - 1  # an occurrence ends before the last token: it has a follower
        if self._prompt_len is not None:
            limit = min(limit, self._prompt_len)
        for end in range(self._indexed + 1, limit + 1):
            for n in range(1, min(self.max_ngram_size, end) + 1):
                key = tuple(tokens[end - n : end])
                if self._latest:
                    self._ends[key] = end
                else:
                    self._ends.setdefault(key, end)
        self._indexed = max(self._indexed, limit)
        for n in range(min(self.max_ngram_size, len(tokens)), 0, -1):
            end = self._ends.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end : end + self.num_drafts]
        return []


def replay(
    proposer: PromptLookupProposer, prompt_ids: list[int], output_ids: list[int],
    max_new_tokens: int, stop_ids: set[int],
) -> Decoded:  # fmt: skip
    """The response speculative decoding with `proposer` gives, from the target-only greedy
    `output_ids` of the prompt (module docstring): same tokens, the acceptances and draft counts
    per verify step, no timing."""
    known = list(prompt_ids) + list(output_ids)
    P, tokens = len(prompt_ids), known[: len(prompt_ids) + 1]
    proposer.start(list(prompt_ids), None)
    accepted, drafted = [], []
    stopped = not output_ids or output_ids[0] in stop_ids
    while len(tokens) - P < max_new_tokens and len(tokens) < len(known) and not stopped:
        drafts = proposer.propose(tokens)[: proposer.num_drafts]
        at = len(tokens)
        n = 0
        while n < len(drafts) and at + n < len(known) and drafts[n] == known[at + n]:
            n += 1
        new = known[at : at + n + 1]  # n drafts and the bonus (unknown past the output's end)
        tokens += new
        stopped = any(t in stop_ids for t in new)
        accepted.append(n + 1)
        drafted.append(len(drafts))
    out, reason = finish(tokens[P:], max_new_tokens, stop_ids)
    return Decoded(out, reason, 0.0, 0.0, accepted, drafted)


def sweep(
    prompts: list[list[int]], outputs: list[list[int]], max_new_tokens: int, stop_ids: set[int],
    grid: Sequence[LookupConfig] = GRID,
) -> dict[str, list[Decoded]]:  # fmt: skip
    """Every configuration of `grid` replayed on every prompt's target-only output, by name."""
    out = {}
    for cfg in grid:
        proposer = PromptLookupProposer(
            cfg.num_drafts, cfg.max_ngram_size, cfg.occurrence, cfg.search
        )
        out[cfg.name] = [
            replay(proposer, ids, output, max_new_tokens, stop_ids)
            for ids, output in zip(prompts, outputs, strict=True)
        ]
    return out
