"""Refill packs, host side: whole prompts one after another in one sequence (4, T) of ids, cache
rows, positions and prompt numbers, each prompt at slots 0..P-1 of its row and attending to
itself only (layers.pack_masks), padded to one of a few lengths so a run captures a few prefill
graphs; the padding writes a scratch row. Both row engines refill through them (BatchedEngine,
ConcurrentEngine), and StaticTarget.pack runs one."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch import nn

from dflashpipe.decoding.families import head_shape

MIN_PACK = 64  # the shortest prefill pack
PACK_MASK_BYTES = 1 << 28  # a pack's folded bool mask (groups x T x T) at most


def fill_pack(
    jobs: Sequence[tuple[int, Sequence[int]]], lengths: Sequence[int], scratch: int
) -> tuple[np.ndarray, list[int]]:
    """Each (row, tokens) job at slots 0..len-1 of its row, in one pack (4, T) of the shortest
    of `lengths` that holds them all (the rest padding: ids 0, row `scratch`, position 0,
    prompt -1); and each prompt's last token's place in it."""
    T = next(n for n in lengths if n >= sum(len(ids) for _, ids in jobs))
    pack = np.zeros((4, T), dtype=np.int64)  # ids, rows, positions, prompt in the pack
    pack[1], pack[3] = scratch, -1
    ends, at = [], 0
    for k, (row, ids) in enumerate(jobs):
        m = len(ids)
        pack[:, at : at + m] = [ids, [row] * m, range(m), [k] * m]
        at += m
        ends.append(at - 1)
    return pack, ends


def default_pack(model: nn.Module) -> int:
    """The default prefill pack length: the largest power of two at which the pack's dense
    attention (4 x T x Hq x D flops per token and layer) costs at most what its linear layers do
    (2 x the decoder layers' weights per token), within PACK_MASK_BYTES of mask (the engines
    raise it to their capacity: every prompt fits one pack). SmolLM2-135M: 2,048; Qwen3-8B:
    8,192 (the mask's bound)."""
    heads, kv_heads, head_dim = head_shape(model.config)
    layers = model.get_decoder().layers
    weights = sum(p.numel() for p in layers.parameters())
    even = weights // (2 * heads * head_dim * len(layers))  # attention flops = linear flops
    fits = int((PACK_MASK_BYTES / (heads // kv_heads)) ** 0.5)
    return max(MIN_PACK, 1 << (min(even, fits).bit_length() - 1))


def pack_lengths(tokens: int) -> list[int]:
    """The pack lengths a run may use, shortest first: `tokens` over powers of 4, >= MIN_PACK."""
    lengths = [tokens]
    while lengths[-1] // 4 >= MIN_PACK:
        lengths.append(lengths[-1] // 4)
    return lengths[::-1]
