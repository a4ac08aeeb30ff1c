"""What every decoding method shares: the proposer it drafts with, the response it returns, and
the two helpers that make every method's responses comparable.

    Proposer   start(prompt, tapped states) ─► propose(tokens so far) -> drafts ─► advance(
               tapped states of the accepted tokens): what a decoding loop asks of a drafter
    Decoded    one response: output ids, finish reason, prefill and decode seconds, and per
               verify step the accepted count (drafts + bonus) and the drafts proposed
    clock      the time after the device's queued work is done (what a timed interval needs)
    finish     the output cut where every method cuts it (a stop id kept, or max_new_tokens)

The eager loop, the static engine, DDTree and prompt lookup's replay all return `Decoded` and
cut with `finish`, so their tau and speed are computed the same way (summary.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # torch at call time only: the report reads lookup's grid without it
    import torch
    from torch import Tensor


class Proposer(Protocol):
    """What the decoding loop needs from a drafter. `layer_ids`: target layers whose states it
    conditions on (empty: none are gathered); `num_drafts`: the most tokens one step proposes."""

    layer_ids: Sequence[int]
    num_drafts: int

    def start(self, prompt_ids: list[int], hidden: Tensor | None) -> None: ...

    def propose(self, tokens: list[int]) -> list[int]: ...

    def advance(self, hidden: Tensor | None) -> None: ...


@dataclass
class Decoded:
    """One response. accepted_lengths / drafted: per verify step (empty for target-only)."""

    output_ids: list[int]
    finish_reason: str  # "stop" (an end-of-turn id, kept in output_ids) or "length"
    prefill_s: float
    decode_s: float
    accepted_lengths: list[int] = field(default_factory=list)  # drafts accepted + 1 (bonus)
    drafted: list[int] = field(default_factory=list)  # drafts proposed

    def __post_init__(self) -> None:
        """The last verify step can accept tokens past the response's end (max_new_tokens, or
        after a stop id): verified but not delivered, they are not counted. Its count becomes the
        tokens it delivered, so tau is delivered tokens per step, the same from decoding as from
        lookup.replay on the output alone. `drafted` stays what was proposed (the work done)."""
        excess = sum(self.accepted_lengths) - self.decode_tokens
        if self.accepted_lengths and excess > 0:
            last = self.accepted_lengths[-1] - excess
            if last < 1:
                raise ValueError(
                    f"verify steps accepted {sum(self.accepted_lengths)} tokens for a response "
                    f"of {self.decode_tokens} after its first: a step before the last overran it"
                )
            self.accepted_lengths[-1] = last

    @property
    def wall_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        return len(self.output_ids) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tokens(self) -> int:
        """Tokens made after the prefill (whose first token every method gets the same way)."""
        return max(0, len(self.output_ids) - 1)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def acceptance_length(self) -> float | None:
        """tau: mean accepted tokens (drafts + bonus) per verify step; None without steps."""
        if not self.accepted_lengths:
            return None
        return sum(self.accepted_lengths) / len(self.accepted_lengths)

    def position_counts(self, num_positions: int) -> tuple[list[int], list[int]]:
        """(accepted, proposed) per draft position 1..num_positions, summed over steps."""
        accepted = [
            sum(a - 1 >= k for a in self.accepted_lengths) for k in range(1, num_positions + 1)
        ]
        proposed = [sum(d >= k for d in self.drafted) for k in range(1, num_positions + 1)]
        return accepted, proposed

    def per_position_acceptance(self, num_positions: int) -> list[float | None]:
        """Share of the steps proposing draft k whose draft k was accepted, k = 1..num_positions."""
        accepted, proposed = self.position_counts(num_positions)
        return [a / p if p else None for a, p in zip(accepted, proposed, strict=True)]


def clock(device: torch.device) -> float:
    """time.perf_counter() once the device has run the work queued so far: CUDA kernels run
    asynchronously, so an interval read without a sync times the launches, not the work."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
    return time.perf_counter()


def finish(out: list[int], max_new_tokens: int, stop_ids: set[int]) -> tuple[list[int], str]:
    """(the response, its finish reason): `out` cut after its first stop id (kept; "stop") or at
    max_new_tokens ("length"). A verify step can accept tokens past either end; they go."""
    stop = next((i for i, t in enumerate(out) if t in stop_ids), None)
    if stop is not None and stop < max_new_tokens:
        return out[: stop + 1], "stop"
    return out[:max_new_tokens], "length"
