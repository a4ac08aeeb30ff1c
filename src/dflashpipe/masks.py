"""Attention masks of the DFlash drafter: one `mask_mod`, two backends.

One training step attends over one packed token stream of length T holding several documents.
Anchors a_0..a_{A-1} (stream indices) each open a block of B slots; slot k sits at position a+k.

    queries: the A*B block slots, flattened          row q   = block q // B, slot q % B
    keys:    [context (T) ; the A*B block slots]     col kv  < T: context position kv
                                                     col kv >= T: slot (kv-T) % B of block (kv-T) // B

A slot sees context position j iff j is in the anchor's document and j < a (the target state at a
itself already encodes x_{a+1}, so `j <= a` leaks), and every slot of its own block (bidirectional),
nothing of other blocks. Sliding-window layers measure the window from the query's own position
a+k, as the published inference code does, and are causal inside the block.

`block_mask_mod` is the single source of truth. On CUDA it becomes a flex-attention BlockMask
(built once per step, compiled, no host syncs); on CPU, where flex attention has no backward, the
same function is materialized as a dense boolean mask for SDPA.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import (
    BlockMask,
    create_block_mask,
    flex_attention,
)

Mask = BlockMask | Tensor
BACKENDS = ("flex", "sdpa")

# Compiled flex kernels per (device, sliding window): the window is a constant baked into the
# mask_mod, so each layer kind gets its own compiled entry instead of recompiling on every switch.
_FLEX_KERNELS: dict[tuple[torch.device, int | None], Callable] = {}
_COMPILED_CREATE_BLOCK_MASK: Callable | None = None


def block_mask_mod(
    document_ids: Tensor,
    anchors: Tensor,
    keep: Tensor,
    block_size: int,
    sliding_window: int | None = None,
) -> Callable:
    """The drafter's mask as a flex-attention `mask_mod(b, h, q_idx, kv_idx) -> bool`.

    document_ids (T,) int, anchors (A,) stream indices, keep (A,) bool. Dropped anchors (keep=0)
    see only their own block, so no query row is ever empty (an empty row is NaN under SDPA).
    """
    T = document_ids.shape[0]
    B = block_size
    q_anchor = anchors.repeat_interleave(B)  # (A*B,)
    q_doc = document_ids[anchors].repeat_interleave(B)  # (A*B,)
    q_keep = keep.repeat_interleave(B)  # (A*B,)
    # Block columns get document -1 so the same lookup serves every kv index without a branch;
    # `kv < anchor` is false for them anyway, since anchors < T.
    kv_doc = F.pad(document_ids, (0, anchors.shape[0] * B), value=-1)  # (T + A*B,)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        a = q_anchor[q_idx]
        slot = q_idx % B
        context = q_keep[q_idx] & (kv_doc[kv_idx] == q_doc[q_idx]) & (kv_idx < a)
        kv_slot = (kv_idx - T) % B
        own_block = (kv_idx >= T) & ((kv_idx - T) // B == q_idx // B)
        if sliding_window is not None:
            context = context & (a + slot - kv_idx < sliding_window)
            own_block = own_block & (kv_slot <= slot) & (slot - kv_slot < sliding_window)
        return context | own_block

    return mask_mod


def build_masks(
    document_ids: Tensor,
    anchors: Tensor,
    keep: Tensor,
    block_size: int,
    sliding_windows: Iterable[int | None],
    backend: str | None = None,
) -> dict[int | None, Mask]:
    """One mask per distinct sliding window (None = full attention), built once per step.

    backend: "flex" (BlockMask) or "sdpa" (dense bool (1, 1, A*B, T+A*B)); default flex on CUDA.
    """
    backend = backend or ("flex" if document_ids.is_cuda else "sdpa")
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {BACKENDS}")
    q_len = anchors.shape[0] * block_size
    kv_len = document_ids.shape[0] + q_len
    masks: dict[int | None, Mask] = {}
    for window in dict.fromkeys(sliding_windows):
        mask_mod = block_mask_mod(document_ids, anchors, keep, block_size, window)
        if backend == "sdpa":
            masks[window] = dense_mask(mask_mod, q_len, kv_len, document_ids.device)
        else:
            masks[window] = _create_block_mask(document_ids.device)(
                mask_mod, None, None, q_len, kv_len, device=document_ids.device
            )
    return masks


def dense_mask(mask_mod: Callable, q_len: int, kv_len: int, device: torch.device) -> Tensor:
    """The mask_mod evaluated on broadcast (Q, 1) x (1, KV) indices: the same bool mask that
    `create_mask` builds through vmap, without its per-call Python overhead (tens of ms per
    step on the CPU). (1, 1, Q, KV)."""
    q = torch.arange(q_len, device=device)[:, None]
    kv = torch.arange(kv_len, device=device)[None, :]
    return mask_mod(None, None, q, kv).expand(q_len, kv_len)[None, None]


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Mask, sliding_window: int | None) -> Tensor:
    """Masked attention; q (1, Hq, Q, D), k and v (1, Hkv, KV, D) -> (1, Hq, Q, D)."""
    if isinstance(mask, BlockMask):
        kernel = _flex_kernel(q.device, sliding_window)
        return kernel(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
    )


def _flex_kernel(device: torch.device, sliding_window: int | None) -> Callable:
    key = (device, sliding_window)
    if key not in _FLEX_KERNELS:
        # Uncompiled flex attention materializes the scores; that is only acceptable off-GPU,
        # where it serves as a forward-only cross-check of the SDPA path.
        kernel = flex_attention
        if device.type == "cuda":
            kernel = torch.compile(flex_attention, dynamic=False)
        _FLEX_KERNELS[key] = kernel
    return _FLEX_KERNELS[key]


def _create_block_mask(device: torch.device) -> Callable:
    global _COMPILED_CREATE_BLOCK_MASK
    if device.type != "cuda":
        return create_block_mask
    if _COMPILED_CREATE_BLOCK_MASK is None:
        # Compiled, the mask is evaluated tile by tile instead of as a dense (Q, KV) tensor.
        _COMPILED_CREATE_BLOCK_MASK = torch.compile(create_block_mask, dynamic=False)
    return _COMPILED_CREATE_BLOCK_MASK
