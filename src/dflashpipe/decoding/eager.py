"""Greedy speculative decoding at batch size 1: a proposer drafts, the target verifies.

    prefill   target(prompt) -> first token x_P, tapped states of the prompt      cache: P
    each step the anchor is the last accepted token (its state is not known yet):
      drafts  proposer.propose(tokens)                          d_1..d_k  (k <= block - 1)
      verify  target([anchor, d_1..d_k]) on its KV cache        greedy g_0..g_k
      accept  d_1..d_n (longest prefix with d_i == g_{i-1}), then the bonus token g_n
      trim    cache -> [..., anchor, d_1..d_n]; the bonus becomes the next anchor
      context proposer.advance(tapped states of [anchor, d_1..d_n])   accepted tokens only

Every accepted token is the target's own argmax given the accepted prefix, so the output is the
target-only greedy output (`greedy_decode`, same harness) up to floating-point rounding: a block
verified in one forward and tokens decoded one at a time round differently, which flips near-tied
argmaxes in bf16 (check losslessness in float32). The prefix is never run through the target
again: its states come from the forwards that verified it.

Cache trimming: `DynamicCache.crop(n)` with n < 0 removes |n| positions on every transformers
release (4.x treats a negative length as "that many fewer", 5.17 takes it as "remove", 5.18+
refuses positive lengths). The forward's cache argument is `past_key_values` up to 5.17 and
`cache` in newer releases; `Target` picks the name from the model's signature.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from dflashpipe.decoding.layers import selected
from dflashpipe.decoding.types import Decoded, Proposer, clock, finish
from dflashpipe.masks import build_masks
from dflashpipe.model import Drafter
from dflashpipe.taps import LayerTaps


def trim_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions of every layer (see the module docstring), checked."""
    excess = cache.get_seq_length() - length
    if excess < 0:
        raise ValueError(f"cannot trim a cache of {cache.get_seq_length()} positions to {length}")
    if excess:
        cache.crop(-excess)
    lengths = {layer.get_seq_length() for layer in getattr(cache, "layers", [])}
    lengths.add(cache.get_seq_length())
    if lengths != {length}:
        raise RuntimeError(
            f"DynamicCache.crop({-excess}) left {sorted(lengths)} positions, expected {length}; "
            "this transformers release changed the crop convention"
        )


class Target:
    """An HF causal LM run on one sequence with a DynamicCache, gathering tapped layer outputs
    (HF hidden_states[i+1], the same taps.LayerTaps as extract) when `layer_ids` is non-empty."""

    def __init__(self, model: nn.Module, layer_ids: Sequence[int] = ()):
        self.model = model
        self.device = next(model.parameters()).device
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._logits_to_keep = "logits_to_keep" in params
        self.layer_ids = list(layer_ids)
        self.taps = LayerTaps(model.get_decoder(), self.layer_ids) if self.layer_ids else None

    def new_cache(self) -> DynamicCache:
        # No config: every layer keeps its whole history (sliding-window layers built from the
        # config drop old states, which crop cannot bring back); masks still apply the window.
        return DynamicCache()

    @torch.inference_mode()
    def forward(
        self, ids: list[int], cache: DynamicCache, hidden: bool = False, last_only: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Logits (k, V) of `ids` appended to the cache (last row only with last_only) and, with
        hidden, the tapped states (k, n_taps*H)."""
        kwargs = {self._cache_arg: cache, "use_cache": True}
        if last_only and self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        x = torch.tensor([ids], device=self.device)  # (1, k)
        logits = self.model(input_ids=x, **kwargs).logits[0]  # (k, V)
        if self.taps is None:
            return logits, None
        if not hidden:
            self.taps.outputs.clear()
            return logits, None
        return logits, self.taps.gather()[0]  # (k, n_taps*H)

    def close(self) -> None:
        if self.taps is not None:
            self.taps.remove()


@torch.inference_mode()
def greedy_decode(
    target: Target, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int]
) -> Decoded:
    """Target-only greedy decoding, one token per forward on the same cache and harness."""
    cache = target.new_cache()
    t0 = clock(target.device)
    logits, _ = target.forward(prompt_ids, cache, last_only=True)
    out = [int(logits[-1].argmax())]
    t1 = clock(target.device)
    while len(out) < max_new_tokens and out[-1] not in stop_ids:
        logits, _ = target.forward(out[-1:], cache)
        out.append(int(logits[-1].argmax()))
    t2 = clock(target.device)
    out, reason = finish(out, max_new_tokens, stop_ids)
    return Decoded(out, reason, t1 - t0, t2 - t1)


@torch.inference_mode()
def speculative_decode(
    target: Target,
    proposer: Proposer,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_ids: set[int],
) -> Decoded:
    """Greedy speculative decoding (module docstring); lossless w.r.t. `greedy_decode`."""
    want_hidden = bool(proposer.layer_ids)
    if want_hidden and list(proposer.layer_ids) != target.layer_ids:
        raise ValueError(
            f"the proposer conditions on layers {list(proposer.layer_ids)}, but the target taps "
            f"{target.layer_ids}"
        )
    cache = target.new_cache()
    t0 = clock(target.device)
    logits, hidden = target.forward(prompt_ids, cache, hidden=want_hidden, last_only=True)
    tokens = list(prompt_ids) + [int(logits[-1].argmax())]
    proposer.start(list(prompt_ids), hidden)
    t1 = clock(target.device)
    accepted_lengths, drafted = [], []
    P, stopped = len(prompt_ids), tokens[-1] in stop_ids
    while len(tokens) - P < max_new_tokens and not stopped:
        drafts = proposer.propose(tokens)[: proposer.num_drafts]
        logits, hidden = target.forward(tokens[-1:] + drafts, cache, hidden=want_hidden)
        greedy = logits.argmax(-1).tolist()  # (k+1,): g_i is the target's token after slot i
        n = 0
        while n < len(drafts) and drafts[n] == greedy[n]:
            n += 1
        trim_cache(cache, len(tokens) + n)  # cached: the prefix, the anchor, d_1..d_n
        proposer.advance(hidden[: n + 1] if hidden is not None else None)
        new = drafts[:n] + [greedy[n]]
        tokens += new
        stopped = any(t in stop_ids for t in new)
        accepted_lengths.append(n + 1)
        drafted.append(len(drafts))
    t2 = clock(target.device)
    out, reason = finish(tokens[P:], max_new_tokens, stop_ids)
    return Decoded(out, reason, t1 - t0, t2 - t1, accepted_lengths, drafted)


class DFlashProposer:
    """Drafts one block with a DFlash drafter: slot 0 holds the anchor (the last accepted token),
    slots 1..B-1 predict the next tokens from the target's tapped states of the accepted prefix.

    The layers, norms, RoPE and mask are the drafter's own (`Drafter.forward` on a one-document
    stream with one anchor at its end; a test checks the two agree). What differs is the
    bookkeeping: the context `hidden_norm(fc(states))` grows by the accepted tokens' rows only
    and is never recomputed, and the mask comes from `block_mask_mod` evaluated on broadcast
    indices: `build_masks` materializes it through vmap, which costs ~35 ms of Python per step,
    more than a target forward. The layers' context keys/values are still projected over the
    whole context every step: O(context) per step, small next to the target's verify forward.
    """

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self.layer_ids = list(drafter.config.target_layer_ids)
        self.num_drafts = drafter.config.block_size - 1
        self._ctx: Tensor | None = None  # (T+1, H): the prefix's rows, then the anchor's zeros

    @property
    def context(self) -> Tensor:
        """hidden_norm(fc(tapped states)) of the accepted prefix, (T, H)."""
        return self._ctx[:-1]

    @torch.inference_mode()
    def start(self, prompt_ids: list[int], hidden: Tensor | None) -> None:
        if hidden is None:
            raise ValueError("the DFlash drafter needs the target's tapped hidden states")
        # The anchor's own state is unknown: its row is zeros (what Drafter.forward makes of a
        # zero state) and the mask hides it (context j < anchor).
        rows = self._rows(hidden)
        self._ctx = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])

    @torch.inference_mode()
    def advance(self, hidden: Tensor | None) -> None:
        self._ctx = torch.cat([self._ctx[:-1], self._rows(hidden), self._ctx[-1:]])

    def _rows(self, hidden: Tensor) -> Tensor:
        return self.drafter.context(hidden)  # (n, H)

    @torch.inference_mode()
    def block_states(self, anchor: int) -> Tensor:
        """Final hidden states (B, H) of the block opened by `anchor` after the context."""
        d, B = self.drafter, self.drafter.config.block_size
        ctx = self._ctx
        T, device = ctx.shape[0] - 1, ctx.device
        block = torch.full((1, B), d.config.mask_token_id, device=device)
        block[0, 0] = anchor
        x = d.embed_blocks(block)[0]  # (B, H)
        positions = torch.arange(T + B, device=device)
        # context (and the anchor's row) at 0..T, block slots at T..T+B-1, as Drafter.forward
        rope = d.rotary_emb(torch.cat([positions[: T + 1], positions[T:]]))  # (T+1+B, D)
        masks = block_masks(T + 1, B, d.config.sliding_windows, device)
        return d.decode(x, ctx, rope, masks)  # (B, H)

    def propose(self, tokens: list[int]) -> list[int]:
        if len(tokens) != self._ctx.shape[0]:
            raise ValueError(
                f"{len(tokens)} tokens for a context of {self._ctx.shape[0] - 1} states; "
                f"expected {self._ctx.shape[0]}"
            )
        with torch.inference_mode():
            out = self.block_states(tokens[-1])
            anchor = out.new_tensor([tokens[-1]], dtype=torch.long)
            return selected(self.drafter, out[None, 1:], anchor)[0].tolist()  # slots 1..B-1


def block_masks(
    stream: int, block_size: int, sliding_windows: Sequence[int | None], device: torch.device
) -> dict[int | None, Tensor]:
    """The drafter's masks (1, 1, B, stream + B) for one block anchored at the last index of a
    one-document stream (the same `build_masks` as training, SDPA form)."""
    docs = torch.zeros(stream, dtype=torch.long, device=device)
    anchors = torch.tensor([stream - 1], device=device)
    keep = torch.ones(1, dtype=torch.bool, device=device)
    return build_masks(docs, anchors, keep, block_size, sliding_windows, backend="sdpa")
