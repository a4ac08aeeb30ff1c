"""The batched engine's device work and its shapes (decoding/batched.py runs them): a decode
step's inputs and layers over R rows (dense over a span of the cache, or flex over each row's
own KV blocks), a prefill pack's layers, the step's token choice and state update (`advance`),
and the sizes they come in: prefill packs (`default_pack`, `pack_lengths`) and cache spans
(`span_lengths`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflashpipe.decoding.families import (
    fold_mask,
    head_shape,
    layer_attention,
    layer_out,
    layer_qkv,
    rotate,
    windowed,
)
from dflashpipe.decoding.sampling import Sampling, draw
from dflashpipe.decoding.static_models import CAPACITY_ALIGN

MIN_PACK = 64  # the shortest prefill pack
PACK_MASK_BYTES = 1 << 28  # a pack's folded bool mask (groups x T x T) at most
FLEX_BLOCK = 128  # KV block of attention "flex": a step reads each row's blocks up to its length


def decode_inputs(
    embed: nn.Module, tables: list[tuple[Tensor, Tensor]], cols: Tensor, token: Tensor,
    length: Tensor, windows: list[int | None], groups: int, flex: bool = False,
) -> tuple[Tensor, list[tuple[Tensor, Tensor]], tuple[Tensor, Tensor], list]:  # fmt: skip
    """A decode step's inputs to its layers: embeddings (R, H) of each row's input token at
    position = slot = length (R,), per RoPE table (C, D) its rows (R, 1, 1, D), where its K/V go
    (rows 0..R-1, slots `length`), and per entry of `windows` the folded mask (R, 1, g, C) the
    layers of that window share: the row's committed slots and its new one (within the window).
    `flex`: per window the KV blocks each row reads instead (`flex_blocks`)."""
    R = token.shape[0]
    # an idle row may rest past a short span: it writes the span's last slot (its slots are
    # refilled before they are read); a busy row's length is always within the span
    index = (torch.arange(R, device=token.device), length.clamp(max=cols.shape[0] - 1))
    if flex:
        masks = [flex_blocks(index[1], cols.shape[0], w) for w in windows]
    else:
        full = (cols[None] <= length[:, None])[:, None]  # (R, 1, C): one query per row
        masks = [windowed(full, length[:, None], cols[None], w)[:, None].expand(R, 1, groups, -1)
                 for w in windows]  # (R, 1, g, C) each  # fmt: skip
    ropes = [(cos[length][:, None, None], sin[length][:, None, None]) for cos, sin in tables]
    return embed(token), ropes, index, masks


def new_token_qkv(
    layer: nn.Module, x: Tensor, k_cache: Tensor, v_cache: Tensor, cos: Tensor, sin: Tensor,
    index: tuple[Tensor, Tensor], fused: tuple,
) -> Tensor:  # fmt: skip
    """A decoder layer's query (R, Hq, 1, D) of one new token per row, x (R, H), whose K/V it
    writes at the row's own slot (index: rows, slots) of the buffers (R, Hkv, C, D). The write
    is an index_put_ of R x Hkv vectors, which the compiler keeps in place; a scatter_ into the
    buffer view made it copy the whole buffer, twice per layer and step (H200 profile: 70% of
    the step, benchmarks/RESULTS.md; tests/test_batched.py checks the compiled code)."""
    rows, slots = index
    q, k, v = layer_qkv(layer, x, fused)  # (R, Hq, D), (R, Hkv, D)
    k_cache[rows, :, slots] = rotate(k[:, :, None], cos, sin)[:, :, 0]  # (R, Hkv, D)
    v_cache[rows, :, slots] = v
    return rotate(q[:, :, None], cos, sin)  # (R, Hq, 1, D)


def decode_layer(
    layer: nn.Module, x: Tensor, k_cache: Tensor, v_cache: Tensor, cos: Tensor, sin: Tensor,
    index: tuple[Tensor, Tensor], mask: Tensor, fused: tuple,
) -> Tensor:  # fmt: skip
    """One decoder layer over one new token per row, x (R, H): its K/V written
    (`new_token_qkv`), attention over the row's own span of the cache under `mask`."""
    q = new_token_qkv(layer, x, k_cache, v_cache, cos, sin, index, fused)
    y = layer_attention(layer, q, k_cache, v_cache, mask)  # (R, Hq, 1, D)
    return layer_out(layer, x, y.flatten(1), fused)


def flex_blocks(length: Tensor, capacity: int, window: int | None) -> tuple:
    """The KV blocks of FLEX_BLOCK slots each row's query reads: from the block of its window's
    first slot (0 without a window) to the block of `length` (R,), as flex_attention's
    (num (R, 1, 1), indices (R, 1, 1, blocks)); and the window, for the mask inside blocks."""
    blocks = capacity // FLEX_BLOCK
    last = length // FLEX_BLOCK
    first = torch.zeros_like(last) if window is None else (length - window + 1).clamp(min=0)
    first = first // FLEX_BLOCK
    indices = (first[:, None] + torch.arange(blocks, device=length.device)).clamp(max=blocks - 1)
    return (last - first + 1).int()[:, None, None], indices.int()[:, None, None], window


_KV_ONLY = (  # no query-block tables: decoding has no backward pass
    {"compute_q_blocks": False}
    if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters
    else {}
)


def flex_mask(blocks: tuple, slots: Tensor, capacity: int) -> BlockMask:
    """flex_attention's mask of one query per row from `flex_blocks`' (num, indices, window):
    inside those blocks a row keeps its committed slots and its new one (slots (R,): its
    input's slot), within the window."""
    num, indices, window = blocks

    def keep(b, h, q_idx, kv_idx):
        ok = kv_idx <= slots[b]
        return ok if window is None else ok & (slots[b] - kv_idx < window)

    return BlockMask.from_kv_blocks(num, indices, BLOCK_SIZE=FLEX_BLOCK, mask_mod=keep,
                                    seq_lengths=(1, capacity), **_KV_ONLY)  # fmt: skip


def decode_layer_flex(
    layer: nn.Module, x: Tensor, k_cache: Tensor, v_cache: Tensor, cos: Tensor, sin: Tensor,
    index: tuple[Tensor, Tensor], blocks: tuple, fused: tuple,
) -> Tensor:  # fmt: skip
    """`decode_layer` with flex_attention over each row's own blocks (`flex_blocks`): a row reads
    the KV its length (and window) reaches, not the whole span; GQA in the kernel."""
    q = new_token_qkv(layer, x, k_cache, v_cache, cos, sin, index, fused)
    mask = flex_mask(blocks, index[1], k_cache.shape[2])
    y = flex_attention(q, k_cache, v_cache, block_mask=mask, scale=layer.self_attn.scaling,
                       enable_gqa=True)  # fmt: skip
    return layer_out(layer, x, y.flatten(1), fused)


def prefill_layer(
    layer: nn.Module, x: Tensor, k_cache: Tensor, v_cache: Tensor, cos: Tensor, sin: Tensor,
    index: tuple[Tensor, Tensor], mask: Tensor, fused: tuple,
) -> Tensor:  # fmt: skip
    """One decoder layer over a pack x (1, T, H) of whole prompts at RoPE rows cos/sin (T, D) of
    their positions: token t's K/V written at (row, slot) = index[t] of the buffers (rows,
    Hkv, C, D), attention among the pack's tokens under its folded block-causal mask (a refilled
    row has no prefix), SDPA's kernel where the layer is compiled too."""
    q, k, v = layer_qkv(layer, x, fused)  # (1, T, Hq, D), (1, T, Hkv, D)
    return layer_out(layer, x, pack_attend(layer, q, k, v, k_cache, v_cache, cos, sin, index,
                                           mask), fused)  # fmt: skip


def pack_attend(
    layer: nn.Module, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
    cos: Tensor, sin: Tensor, index: tuple[Tensor, Tensor], mask: Tensor,
) -> Tensor:  # fmt: skip
    """prefill_layer's attention over a pack's projections q (1, T, Hq, D), k / v (1, T, Hkv, D):
    the rotated K/V written at (row, slot) = index[t], the queries attending among the pack's
    tokens under `mask`. Returns (1, T, Hq*D) for the layer's output projection."""
    rows, slots = index
    q = rotate(q.transpose(1, 2), cos, sin)  # (1, Hq, T, D)
    k = rotate(k.transpose(1, 2), cos, sin)  # (1, Hkv, T, D)
    v = v.transpose(1, 2)  # (1, Hkv, T, D)
    k_cache[rows, :, slots] = k[0].transpose(0, 1)  # (T, Hkv, D)
    v_cache[rows, :, slots] = v[0].transpose(0, 1)
    y = layer_attention(layer, q, k, v, mask, kernel=True)  # (1, Hq, T, D)
    return y.transpose(1, 2).flatten(2)


def pack_masks(pack: Tensor, windows: Sequence[int | None], groups: int) -> list[Tensor]:
    """A pack's (4, T) folded masks (groups x T, T), one per entry of `windows`: each token sees
    its own prompt's tokens up to its position (within the window)."""
    _, _, pos, seg = pack
    block = (seg[:, None] == seg[None]) & (pos[:, None] >= pos[None])  # (T, T): own prompt
    return [fold_mask(windowed(block, pos, pos, w), groups) for w in windows]


def pack_forward(
    m, ks: Sequence[Tensor], vs: Sequence[Tensor], pack: Tensor, taps: Sequence[int] = (),
    layer_fn: Callable = prefill_layer,
) -> tuple[Tensor, list[Tensor]]:  # fmt: skip
    """A pack (4, T) of ids, cache rows, positions and prompt numbers through every layer of
    the engine's target `m` (its base, fused weights, RoPE tables and masks' windows: a
    BatchedEngine or a StaticTarget): each token's K/V written at (row, position) of the
    per-layer buffers ks / vs, attention within its own prompt only. The last layer's rows
    (1, T, H) and the rows of the layers in `taps`, in that order. `layer_fn`: prefill_layer
    or a compiled copy of it."""
    ids, rows, pos, _ = pack
    x = m.base.embed_tokens(ids[None])  # (1, T, H)
    masks = pack_masks(pack, m.windows, m.groups)
    tapped = {}
    for i, layer in enumerate(m.base.layers):
        cos, sin = m.tables[m.rope_of[i]]
        x = layer_fn(layer, x, ks[i], vs[i], cos[pos], sin[pos], (rows, pos),
                     masks[m.mask_of[i]], m.fused[i])  # fmt: skip
        if i in taps:
            tapped[i] = x
    return x, [tapped[i] for i in taps]


def decode_state(rows: int, capacity: int, device: torch.device) -> dict[str, Tensor]:
    """Every row's decode state, idle: the step's graph inputs and outputs, which `advance`
    updates in place (the engine's, and benchmarks/draw.py's)."""
    long = {"dtype": torch.long, "device": device}
    return {
        "token": torch.zeros(rows, **long),  # the next input (not cached yet)
        "length": torch.zeros(rows, **long),  # committed slots = the input's position
        "produced": torch.zeros(rows, **long),  # answer tokens so far
        "limit": torch.zeros(rows, **long),  # the request's max_new_tokens
        "active": torch.zeros(rows, dtype=torch.bool, device=device),
        "sampled": torch.zeros(rows, dtype=torch.bool, device=device),
        "uniforms": torch.zeros(rows, capacity, device=device),  # (R, C) float32
        "packed": torch.zeros(3, rows, **long),  # [emitted, token, done]: the read-back
    }


def advance(
    norm: nn.Module, lm_head: nn.Module, x: Tensor, state: dict[str, Tensor], stops: Tensor,
    sampling: Sampling | None, softcap: float | None = None,
) -> None:  # fmt: skip
    """The step's tokens from the last layer's rows x (R, H) and every row's state, in place:
    active rows take their token (the argmax, or `draw` for sampled rows when `sampling`),
    length and produced += 1, done = a stop token or the row's limit reached; packed (3, R) =
    [emitted, token, done], the step's read-back."""
    s = state
    logits = lm_head(norm(x)).float()  # (R, V)
    if softcap is not None:  # Gemma's final logit soft-capping
        logits = torch.tanh(logits / softcap) * softcap
    token = logits.argmax(-1)  # (R,)
    if sampling is not None:
        t = s["produced"].clamp(max=s["uniforms"].shape[1] - 1)[:, None]  # (R, 1)
        drawn = draw(logits, s["uniforms"].gather(1, t)[:, 0], sampling)  # (R,)
        token = torch.where(s["sampled"], drawn, token)
    active = s["active"].clone()  # (R,) bool
    step = active.long()  # (R,)
    s["produced"].add_(step)
    s["length"].add_(step)
    done = active & ((token[:, None] == stops[None]).any(-1) | (s["produced"] >= s["limit"]))
    s["packed"].copy_(torch.stack([step, token, done.long()]))  # (3, R)
    s["token"].copy_(torch.where(active, token, s["token"]))
    s["active"].copy_(active & ~done)


def default_pack(model: nn.Module) -> int:
    """The default prefill pack length: the largest power of two at which the pack's dense
    attention (4 x T x Hq x D flops per token and layer) costs at most what its linear layers do
    (2 x the decoder layers' weights per token), within PACK_MASK_BYTES of mask (the engine
    raises it to its capacity: every prompt fits one pack). SmolLM2-135M: 2,048; Qwen3-8B:
    8,192 (the mask's bound)."""
    heads, kv_heads, head_dim = head_shape(model.config)
    layers = model.get_decoder().layers
    weights = sum(p.numel() for p in layers.parameters())
    even = weights // (2 * heads * head_dim * len(layers))  # attention flops = linear flops
    fits = int((PACK_MASK_BYTES / (heads // kv_heads)) ** 0.5)
    return max(MIN_PACK, 1 << (min(even, fits).bit_length() - 1))


def span_lengths(capacity: int) -> list[int]:
    """The cache spans a decode step may attend over, shortest first: the capacity's quarters
    (aligned), the capacity last. Each step takes the shortest that holds every busy row's slots
    so far and the one it writes, so it reads about as much of the cache as the rows fill, and a
    run fed longest prompts first (as regenerate's plan is) less and less as it goes."""
    aligned = {-(-capacity * q // 4 // CAPACITY_ALIGN) * CAPACITY_ALIGN for q in (1, 2, 3)}
    return sorted(n for n in aligned if n < capacity) + [capacity]


def pack_lengths(tokens: int) -> list[int]:
    """The pack lengths a run may use, shortest first: `tokens` over powers of 4, >= MIN_PACK."""
    lengths = [tokens]
    while lengths[-1] // 4 >= MIN_PACK:
        lengths.append(lengths[-1] // 4)
    return lengths[::-1]
