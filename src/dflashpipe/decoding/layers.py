"""The decoding layers: the target's and the drafter's step over N rows x Q tokens against static
KV buffers, one implementation under every engine; the engines differ in N, Q and what they
attend over, not in how a layer computes.

    Engine (c = 1)         N = 1;  Q = 1 (greedy), B (DFlash verify), K+1 (lookup), a tree's nodes
    ConcurrentEngine       N = c;  Q = 1, B or K+1; a refill pack beside the rows (`mixed_layer`)
    BatchedEngine          N = R;  Q = 1, dense over a span or flex over each row's KV blocks
    refill packs           N = 1, Q = T: whole prompts, each attending to itself (`Pack`)

    target_inputs / rows_inputs ─► x (N, Q, H), RoPE rows (N, Q, 1, D), index = where the K/V
                                   go (rows (N, 1), slots (N, Q)), per distinct window its mask
    layer (every layer, target and drafter alike; a DFlash2 drafter's convolutions around the
    sublayers: drafter_layer)
                                   input norm, q/k/v one matmul, q/k norms ─► K/V written at
                                   index, `attend`: dense over each row's buffer (N, Hkv, C, D),
                                   flex over its blocks, or a pack among its own tokens ─►
                                   o_proj, residual, MLP (gate/up one matmul; a MoE as its module)
    target_outputs                 final norm, LM head, soft-capping; tapped layers' rows
    drafter_inputs, context_rows   the block [anchor, MASK x B-1] at T..T+B-1 and its masks; the
                                   target's tapped rows into every drafter layer's context K/V
    chain_drafts, tree_candidates  greedy drafts (a DFlash2 drafter's: its selector's walk) or
                                   per-slot top-k of the drafter's last rows and their states

Layout, chosen for the hot paths: rows, then tokens, then heads, as projections come out of the
matmuls (x (N, Q, H), K/V (N, Q, Hkv, D)); one index_put_ (buffer[rows, :, slots]) writes them,
which the compiler keeps in place (a scatter_ into a buffer view copied the whole buffer, 70% of
an H200 decode step: tests/test_batched.py checks the compiled code). The c = 1 engine is one
row of this (its buffers (1, Hkv, C, D)), a decode step one token per row (its folded mask then a
view, `families.fold_mask`). Masks are built once per step per distinct window and shared by
every layer, so sliding and full layers run one compiled function.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflashpipe.decoding.families import (
    Fused,
    fold_mask,
    fused_mlp,
    layer_attention,
    layer_out,
    layer_qkv,
    project_qkv,
    rotate,
    windowed,
)
from dflashpipe.decoding.tree_search import draft_candidates
from dflashpipe.model import Drafter, apply_rope

FLEX_BLOCK = 128  # KV block of attention "flex": a step reads each row's blocks up to its length


class Pack(NamedTuple):
    """A refill pack's folded mask (1, 1, g*T, T): its tokens attend among themselves (each
    prompt to its own earlier tokens), not over the buffers they are written to."""

    mask: Tensor


class FlexBlocks(NamedTuple):
    """The KV blocks each row's one query reads (`flex_blocks`), flex_attention's tables."""

    num: Tensor  # (R, 1, 1)
    indices: Tensor  # (R, 1, 1, blocks)
    window: int | None  # for the mask inside the blocks


def target_inputs(
    embed: nn.Module, tables: list[tuple[Tensor, Tensor]], cols: Tensor, ids: Tensor,
    positions: Tensor, slots: Tensor, cache_len: Tensor, visible: Tensor | None,
    windows: list[int | None], groups: int,
) -> tuple[Tensor, list[tuple[Tensor, Tensor]], tuple[Tensor, Tensor], list[Tensor]]:  # fmt: skip
    """The c = 1 engine's step inputs, in the layout of one row: embeddings (1, Q, H) of Q new
    tokens ids at `positions` and `slots` (Q,) each (the model's embedding module: Gemma's
    scales them), per RoPE table (L, D) the rows (1, Q, 1, D), where the K/V go (row 0, slots),
    and per entry of `windows` the folded mask (1, 1, g*Q, L): the committed prefix
    (< cache_len) plus, among the new slots, `visible` (Q, Q) (None: causal; a tree passes its
    ancestor matrix). A windowed mask measures positions, not slots: tree siblings share one."""
    Q = slots.shape[0]
    if visible is None:
        visible = torch.ones(Q, Q, dtype=torch.bool, device=cols.device).tril()
    full = (cols < cache_len).repeat(Q, 1).index_copy_(1, slots, visible)  # (Q, L)
    k_pos = cols.index_copy(0, slots, positions)  # (L,): each slot's position
    masks = [fold_mask(windowed(full, positions, k_pos, w), groups) for w in windows]
    ropes = [(cos[positions][None, :, None], sin[positions][None, :, None]) for cos, sin in tables]
    return embed(ids)[None], ropes, (slots.new_zeros(1, 1), slots[None]), masks


def rows_inputs(
    embed: nn.Module, tables: list[tuple[Tensor, Tensor]], cols: Tensor, ids: Tensor,
    slots: Tensor, windows: list[int | None], groups: int, flex: bool = False,
) -> tuple[Tensor, list[tuple[Tensor, Tensor]], tuple[Tensor, Tensor], list]:  # fmt: skip
    """A step's inputs over N rows for ids (N, Q) at slots = positions (N, Q) of each row's own
    buffer (cols (C,): the span read): embeddings (N, Q, H), per RoPE table its rows
    (N, Q, 1, D), where the K/V go (rows (N, 1), slots), and per entry of `windows` the folded
    mask (N, 1, g*Q, C): each query sees its row's slots up to its own (within the window).
    `flex` (one token per row): the KV blocks each row reads instead (`flex_blocks`). A slot
    past the span (an idle row of the batched engine resting past a short one) writes the
    span's last slot, refilled before it is read; a busy row's slots are always within."""
    slots = slots.clamp(max=cols.shape[0] - 1)
    if flex:
        masks = [flex_blocks(slots[:, 0], cols.shape[0], w) for w in windows]
    else:
        full = cols <= slots[..., None]  # (N, Q, C)
        masks = [fold_mask(windowed(full, slots, cols, w), groups) for w in windows]
    ropes = [(cos[slots][:, :, None], sin[slots][:, :, None]) for cos, sin in tables]
    rows = torch.arange(ids.shape[0], device=ids.device)[:, None]  # (N, 1)
    return embed(ids), ropes, (rows, slots), masks


def decoder_layer(
    module: nn.Module, x: Tensor, k_cache: Tensor, v_cache: Tensor, cos: Tensor, sin: Tensor,
    index: tuple[Tensor, Tensor], mask: Tensor | FlexBlocks | Pack, fused: Fused,
) -> Tensor:  # fmt: skip
    """One decoder layer, the target's of any family (families.py) or the drafter's, over Q new
    tokens per row, x (N, Q, H): q/k/v as one matmul (`fuse_layer`), their K/V written at
    `index` and attention under `mask` (`attend`), then the output projection, residual and MLP
    (gate/up as one matmul)."""
    q, k, v = layer_qkv(module, x, fused)  # (N, Q, Hq, D), (N, Q, Hkv, D)
    y = attend(module, q, k, v, k_cache, v_cache, cos, sin, index, mask)  # (N, Q, Hq*D)
    return layer_out(module, x, y, fused)


def drafter_layer(
    module: nn.Module, x: Tensor, k_cache: Tensor, v_cache: Tensor, cos: Tensor, sin: Tensor,
    index: tuple[Tensor, Tensor], mask: Tensor | FlexBlocks | Pack, fused: Fused,
) -> Tensor:  # fmt: skip
    """A drafter layer over one block per row, x (N, B, H): `decoder_layer`, or on a DFlash2
    drafter (dflash2.py) the same with its convolutions around attention and the MLP, each over
    the row's block (the slot and the ones before it: a row holds one block, so no tap crosses
    a block)."""
    conv = module.attention_conv
    if conv is None:
        return decoder_layer(module, x, k_cache, v_cache, cos, sin, index, mask, fused)
    attn = module.self_attn
    h, dyn = conv.before(module.input_layernorm(x))
    q, k, v = project_qkv(h, fused, attn.num_kv_heads, attn.head_dim)
    y = attend(module, attn.q_norm(q), attn.k_norm(k), v, k_cache, v_cache, cos, sin, index, mask)
    x = x + conv.after(attn.o_proj(y), dyn)
    h, dyn = module.mlp_conv.before(module.post_attention_layernorm(x))
    return x + module.mlp_conv.after(fused_mlp(module.mlp, h, fused), dyn)


def attend(
    module: nn.Module, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
    cos: Tensor, sin: Tensor, index: tuple[Tensor, Tensor], mask: Tensor | FlexBlocks | Pack,
) -> Tensor:  # fmt: skip
    """A layer's attention over its rows' projections q (N, Q, Hq, D), k / v (N, Q, Hkv, D) at
    RoPE rows cos/sin (N, Q, 1, D); returns (N, Q, Hq*D) for the output projection. The rotated
    K/V go to (rows, slots) = index of the buffers (rows, Hkv, C, D), then by `mask`:
    a tensor (N, 1, g*Q, C), the queries over each row's buffer (`families.attend_cache`, with
    the layer's scaling, sinks and soft-capping); FlexBlocks, flex_attention over the KV blocks
    each row's one query reaches (GQA in the kernel); Pack, a pack of T tokens (N = 1, index
    (T,) each) attending among its own tokens, SDPA's kernel where compiled too (its T x T
    scores in plain ops would be written and read again)."""
    rows, slots = index
    if isinstance(mask, Pack):
        q = rotate(q.transpose(1, 2), cos, sin)  # (1, Hq, T, D)
        k = rotate(k.transpose(1, 2), cos, sin)  # (1, Hkv, T, D)
        v = v.transpose(1, 2)  # (1, Hkv, T, D)
        k_cache[rows, :, slots] = k[0].transpose(0, 1)  # (T, Hkv, D)
        v_cache[rows, :, slots] = v[0].transpose(0, 1)
        y = layer_attention(module, q, k, v, mask.mask, kernel=True)  # (1, Hq, T, D)
        return y.transpose(1, 2).flatten(2)
    k_cache[rows, :, slots] = rotate(k, cos, sin)  # (N, Q, Hkv, D)
    v_cache[rows, :, slots] = v
    q = rotate(q, cos, sin).transpose(1, 2)  # (N, Hq, Q, D)
    if isinstance(mask, FlexBlocks):
        block_mask = flex_mask(mask, slots[:, 0], k_cache.shape[2])
        y = flex_attention(q, k_cache, v_cache, block_mask=block_mask,
                           scale=module.self_attn.scaling, enable_gqa=True)  # fmt: skip
    else:
        y = layer_attention(module, q, k_cache, v_cache, mask)  # (N, Hq, Q, D)
    return y.transpose(1, 2).flatten(2)


def mixed_layer(
    module: nn.Module, x: Tensor, k_cache: Tensor, v_cache: Tensor, cos: Tensor, sin: Tensor,
    pack_cos: Tensor, pack_sin: Tensor, index: tuple, mask: tuple, fused: Fused,
) -> Tensor:  # fmt: skip
    """`decoder_layer` over a step's rows and a refill pack through one pass of the layer's matmuls:
    x (N*Q + T, H) is the rows' Q tokens each, flattened, then the pack's T tokens (a step that
    refills, as a serving engine mixes prefill into its decode batch); index and mask: the rows'
    then the pack's. The rows write and read the first N rows of the buffers (rows + 1, Hkv, C,
    D), the pack writes at (row, position) and attends among its own tokens; it is written
    after the rows: a refilled row idles in this step's rows part, which writes its first
    slots."""
    (rows_index, pack_index), (rows_mask, pack_mask) = index, mask
    N, Q = rows_index[1].shape
    n = N * Q
    q, k, v = layer_qkv(module, x, fused)  # (M, Hq, D), (M, Hkv, D)
    qr, kr, vr = (t[:n].unflatten(0, (N, Q)) for t in (q, k, v))
    yr = attend(module, qr, kr, vr, k_cache[:N], v_cache[:N], cos, sin, rows_index, rows_mask)
    yp = attend(module, q[None, n:], k[None, n:], v[None, n:], k_cache, v_cache, pack_cos,
                pack_sin, pack_index, pack_mask)  # fmt: skip
    return layer_out(module, x, torch.cat([yr.flatten(0, 1), yp[0]]), fused)


def flex_blocks(length: Tensor, capacity: int, window: int | None) -> FlexBlocks:
    """The KV blocks of FLEX_BLOCK slots each row's query reads: from the block of its window's
    first slot (0 without a window) to the block of `length` (R,)."""
    blocks = capacity // FLEX_BLOCK
    last = length // FLEX_BLOCK
    first = torch.zeros_like(last) if window is None else (length - window + 1).clamp(min=0)
    first = first // FLEX_BLOCK
    indices = (first[:, None] + torch.arange(blocks, device=length.device)).clamp(max=blocks - 1)
    return FlexBlocks((last - first + 1).int()[:, None, None], indices.int()[:, None, None], window)


_KV_ONLY = (  # no query-block tables: decoding has no backward pass
    {"compute_q_blocks": False}
    if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters
    else {}
)


def flex_mask(blocks: FlexBlocks, slots: Tensor, capacity: int) -> BlockMask:
    """flex_attention's mask of one query per row from `flex_blocks`: inside those blocks a row
    keeps its committed slots and its new one (slots (R,): its input's slot), within the
    window. Built inside the compiled layer, from the step's block tables."""
    num, indices, window = blocks

    def keep(b, h, q_idx, kv_idx):
        ok = kv_idx <= slots[b]
        return ok if window is None else ok & (slots[b] - kv_idx < window)

    return BlockMask.from_kv_blocks(num, indices, BLOCK_SIZE=FLEX_BLOCK, mask_mod=keep,
                                    seq_lengths=(1, capacity), **_KV_ONLY)  # fmt: skip


def pack_masks(pack: Tensor, windows: list[int | None], groups: int) -> list[Pack]:
    """A pack's (4, T) folded masks (1, 1, g*T, T), one per entry of `windows`: each token sees
    its own prompt's tokens up to its position (within the window)."""
    _, _, pos, seg = pack
    block = (seg[:, None] == seg[None]) & (pos[:, None] >= pos[None])  # (T, T): own prompt
    return [Pack(fold_mask(windowed(block, pos, pos, w), groups)) for w in windows]


def target_outputs(
    norm: nn.Module, lm_head: nn.Module, x: Tensor, tapped: list[Tensor], softcap: float | None
) -> tuple[Tensor, Tensor | None]:
    """Logits (..., V) of the last layer's rows x (..., H) (soft-capped where the family does
    it), and the tapped layers' rows side by side (..., n_taps*H), or None without taps."""
    logits = lm_head(norm(x))
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits, torch.cat(tapped, -1) if tapped else None


def drafter_inputs(
    drafter: Drafter, anchor: Tensor, mask_ids: Tensor, cos: Tensor, sin: Tensor, cols: Tensor,
    offsets: Tensor, length: Tensor, windows: list[int | None], groups: int,
) -> tuple[Tensor, tuple[Tensor, Tensor], Tensor, Tensor, list[Tensor]]:  # fmt: skip
    """A draft's inputs to the drafter's layers per row: the blocks [anchor_r, MASK x B-1]
    (N, B) (anchor (N,), mask_ids (B-1,)) at positions T_r..T_r+B-1 (length (N,)): embeddings
    (N, B, H), where their K/V go (rows (N, 1), slots (N, B)), RoPE rows (N, B, 1, D), and per
    entry of `windows` the folded mask (N, 1, g*B, C), the SDPA form of masks.block_mask_mod:
    context j < T, every slot of the block; a window measures from the query's position T+k
    and is causal inside the block."""
    N, B = anchor.shape[0], offsets.shape[0]
    x = drafter.embed_blocks(torch.cat([anchor[:, None], mask_ids.expand(N, -1)], 1))
    slots = length[:, None] + offsets  # (N, B)
    slot, j, T = offsets[None, :, None], cols[None, None, :], length[:, None, None]
    kv_slot = j - T  # (N, 1, C): block slot of column j, negative for context
    context, in_block = j < T, (kv_slot >= 0) & (kv_slot < B)
    masks = []
    for w in windows:
        if w is None:
            mask = (context | in_block).expand(N, B, -1)
        else:
            near = T + slot - j < w  # (N, B, C)
            causal = (kv_slot <= slot) & (slot - kv_slot < w)
            mask = (context & near) | (in_block & causal)
        masks.append(fold_mask(mask, groups))
    rows = torch.arange(N, device=anchor.device)[:, None]
    return x, (rows, slots), cos[slots][:, :, None], sin[slots][:, :, None], masks


def context_rows(
    drafter: Drafter, states: Tensor, kv: Tensor, weight: Tensor, cos: Tensor, sin: Tensor,
    index: tuple[Tensor, Tensor],
) -> None:  # fmt: skip
    """Target states (N, Q, n_taps*H) projected once into every drafter layer's context K/V at
    the rows' slots = positions (index: rows (N, 1), slots (N, Q)) of `kv` (2n, rows, Hkv, C, D)
    (layer i's K at i, its V at n+i): k_proj and v_proj of all n layers as one matmul with
    `weight` (2n*Hkv*D, H) (`stacked_context_weights`), each layer's k_norm and RoPE (rows of
    the tables cos/sin (C, D)) on its keys, one write."""
    rows, slots = index
    ctx = drafter.context(states)  # (N, Q, H)
    n, D = len(drafter.layers), drafter.config.head_dim
    proj = (ctx @ weight.T).unflatten(-1, (2 * n, -1, D))  # (N, Q, 2n, Hkv, D)
    k = torch.stack([layer.self_attn.k_norm(proj[:, :, i]) for i, layer in enumerate(drafter.layers)], 2)  # fmt: skip
    k = apply_rope(k, cos[slots][:, :, None, None], sin[slots][:, :, None, None])
    kv[:, rows, :, slots] = torch.cat([k, proj[:, :, n:]], 2)  # (N, Q, 2n, Hkv, D)


def append_context(
    drafter: Drafter, states: Tensor, kv: Tensor, weight: Tensor, cos: Tensor, sin: Tensor,
    start: Tensor | int,
) -> None:  # fmt: skip
    """`context_rows` of one row: states (R, n_taps*H) at slots start..start+R-1 of row 0."""
    slots = start + torch.arange(states.shape[0], device=states.device)  # (R,)
    context_rows(drafter, states[None], kv, weight, cos, sin, (slots.new_zeros(1, 1), slots[None]))


def chain_drafts(drafter: Drafter, x: Tensor, anchor: Tensor) -> Tensor:
    """The drafts (N, B-1) of slots 1..B-1 from the last layer's block rows (N, B, H) after
    `anchor` (N,) (`selected`)."""
    return selected(drafter, drafter.norm(x[:, 1:]), anchor)


def selected(drafter: Drafter, h: Tensor, anchor: Tensor) -> Tensor:
    """The chain a drafter proposes from its final states h (N, S, H) of the drafted slots after
    `anchor` (N,): the unary argmax per slot, or on a DFlash2 drafter its selector's greedy
    walk over the unary top K from the anchor (dflash2.CandidateSelector)."""
    logits = drafter.lm_head(h)  # (N, S, V)
    selector = getattr(drafter, "candidate_selector", None)
    return logits.argmax(-1) if selector is None else selector.walk(h, logits, anchor)[0]


def tree_candidates(drafter: Drafter, x: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per slot 1..B-1 of one block's rows x (B, H) the k most likely tokens: float32
    log-probabilities and ids (B-1, k), and the slots' final states (B-1, H) (a DFlash2
    drafter's selector scores the tree's edges from them: tree_search.grow_tree)."""
    h = drafter.norm(x)[1:]
    return (*draft_candidates(drafter.lm_head(h), k), h)


def accept_chain(
    logits: Tensor, drafts: Tensor, count: Tensor | None, anchor: Tensor,
    packed: Tensor, length: Tensor,
) -> None:  # fmt: skip
    """Accept each row's verified chain, on the device (N = 1 row at c = 1, c rows in the
    concurrent engine): the target's greedy tokens g (N, Q) from its logits (N, Q, V) of
    [anchor_r, d_r1..d_r,Q-1] (g_ri is its token after slot i); n_r = row r's matched prefix of
    drafts (N, Q-1) (only its first count_r can match, None: all; a greedy step has none);
    anchor = g_{r, n_r}, packed = [n_r+1, g_r0..g_r,Q-1] (N, Q+1) (the step's read-back),
    length += n+1."""
    greedy = logits.argmax(-1)  # (N, Q)
    match = drafts == greedy[:, :-1]  # (N, Q-1)
    if count is not None:  # pads never match
        match &= torch.arange(drafts.shape[1], device=drafts.device) < count[:, None]
    n = match.long().cumprod(1).sum(1)  # (N,)
    anchor.copy_(greedy.gather(1, n[:, None])[:, 0])  # a gather: no host sync on n
    packed[:, :1].copy_(n[:, None] + 1)
    packed[:, 1:].copy_(greedy)
    length.add_(n + 1)
