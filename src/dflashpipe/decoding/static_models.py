"""Static KV caches: the target and the DFlash drafter over fixed buffers.

    StaticTarget    an HF causal LM of a supported family (families.py), its own modules and
                    weights; K/V of all layers in one (2 x layers, 1, n_kv, capacity, D) buffer
                    (per-layer views); new tokens at explicit slots and positions
                    (a tree's siblings share a position, each has its own slot); mask = committed
                    prefix (< cache_len) + `visible` among the new slots, limited per windowed
                    layer to its sliding window by position; commit() moves a kept tree path
                    behind the prefix
    StaticDrafter   DFlash drafter; context K/V of all layers in one buffer, projected once per
                    accepted row at slot = position (append: one matmul for every layer), a
                    block [anchor, MASK..] drafted against it (propose, top_k)

Both are what engine.py's fixed-shape steps run (tests check them against the HF forward and the
eager DFlashProposer in float32). Only step-time values live on the device: no host sync inside.

Compilation (`compile=True`, the engine's default on CUDA): the per-layer functions below
(`target_layer`, `drafter_layer`, `context_rows`) are compiled whole for fixed shapes, one graph
per step shape, shared by every layer (their weights are arguments; a sliding and a full layer
differ only in the mask and RoPE rows they are given); so is the glue around the layers
(`target_inputs`, `target_outputs`, `drafter_inputs`, `chain_drafts`, `tree_candidates`: masks,
RoPE rows, embeddings, final norm, LM head, argmax or top-k), which would otherwise be a few
dozen small kernels per step, each its own launch inside the step's graph. A prefill passes
`eager=True` and runs them uncompiled, since its length changes per prompt. Inside a compiled
function `attend_cache` takes plain ops the compiler fuses instead of SDPA's kernel.

Fused projections (both models, as serving engines run them): each layer's q/k/v_proj is one
matmul and gate/up_proj another (`fuse_layer`; the modules' weights become views of the fused
ones), and the drafter's context rows take every layer's k/v in one matmul (`context_rows`).
A faster target step is also the honest baseline: speculative methods look better against a
target step padded with launches they amortize.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from dflashpipe.decoding.families import (
    Fused,
    attend_cache,
    check_target,
    final_softcap,
    fold_mask,
    fuse_layer,
    fused_mlp,
    head_shape,
    layer_attention,
    layer_out,
    layer_qkv,
    layer_windows,
    project_qkv,
    rope_tables,
    rotate,
    windowed,
)
from dflashpipe.decoding.tree_search import draft_candidates
from dflashpipe.model import Drafter, apply_rope

CAPACITY_ALIGN = 16  # buffer lengths rounded up: memory-efficient SDPA wants aligned mask rows


def target_layer(
    layer: nn.Module, x: Tensor, k_cache: Tensor, v_cache: Tensor, cos: Tensor, sin: Tensor,
    slots: Tensor, mask: Tensor, fused: Fused,
) -> Tensor:  # fmt: skip
    """One HF decoder layer over Q rows x (Q, H) at RoPE rows cos/sin (Q, D): its new K/V
    written into `slots` of the static buffers (1, Hkv, L, D), attention over them under the
    folded mask (`fold_mask`; the layer's window is in it); q/k/v and gate/up as one matmul
    each (`fuse_layer`)."""
    q, k, v = layer_qkv(layer, x, fused)  # (Q, Hq, D), (Q, Hkv, D)
    q = rotate(q.transpose(0, 1)[None], cos, sin)  # (1, Hq, Q, D)
    k_cache.index_copy_(2, slots, rotate(k.transpose(0, 1)[None], cos, sin))
    v_cache.index_copy_(2, slots, v.transpose(0, 1)[None])
    y = layer_attention(layer, q, k_cache, v_cache, mask)  # (1, Hq, Q, D)
    return layer_out(layer, x, y[0].transpose(0, 1).flatten(1), fused)


def drafter_layer(
    layer: nn.Module, x: Tensor, k_cache: Tensor, v_cache: Tensor, cos: Tensor, sin: Tensor,
    slots: Tensor, mask: Tensor, fused: Fused,
) -> Tensor:  # fmt: skip
    """One DFlash drafter layer over a block x (B, H): the block's K/V written into `slots`,
    attention over context + block (the mask of its sliding window, folded); q/k/v and gate/up
    as one matmul each (`fuse_layer`)."""
    attn = layer.self_attn
    B = x.shape[0]
    q, k, v = project_qkv(layer.input_layernorm(x), fused, attn.num_kv_heads, attn.head_dim)
    q, k = attn.q_norm(q), attn.k_norm(k)  # (B, Hq, D), (B, Hkv, D)
    q = apply_rope(q.transpose(0, 1)[None], cos, sin)  # (1, Hq, B, D)
    k_cache.index_copy_(2, slots, apply_rope(k.transpose(0, 1)[None], cos, sin))
    v_cache.index_copy_(2, slots, v.transpose(0, 1)[None])
    y = attend_cache(q, k_cache, v_cache, mask, None)  # (1, Hq, B, D)
    x = x + attn.o_proj(y[0].transpose(0, 1).reshape(B, -1))
    return x + fused_mlp(layer.mlp, layer.post_attention_layernorm(x), fused)


def context_rows(
    drafter: Drafter, states: Tensor, kv: Tensor, weight: Tensor, cos: Tensor, sin: Tensor,
    start: Tensor | int,
) -> None:  # fmt: skip
    """Project target states (R, n_taps*H) once into every drafter layer's context K/V at
    slots = positions start..start+R-1: k_proj and v_proj of all n layers as one matmul with
    `weight` (2n*Hkv*D, H) (the layers' k_proj then v_proj rows, `stacked_context_weights`), each
    layer's k_norm and RoPE (rows of the tables cos/sin (L, D)) on its keys, one write into `kv`
    (2n, 1, Hkv, L, D) (layer i's K at i, its V at n+i)."""
    ctx = drafter.context(states)  # (R, H)
    n, R, D = len(drafter.layers), ctx.shape[0], drafter.config.head_dim
    slots = start + torch.arange(R, device=ctx.device)  # (R,)
    cos, sin = cos[slots], sin[slots]  # (R, D)
    rows = (ctx @ weight.T).view(R, 2 * n, -1, D).transpose(0, 1)  # (2n, R, Hkv, D)
    k = torch.stack([layer.self_attn.k_norm(rows[i]) for i, layer in enumerate(drafter.layers)])
    k = apply_rope(k.transpose(1, 2), cos, sin)  # (n, Hkv, R, D)
    new = torch.cat([k, rows[n:].transpose(1, 2)])[:, None]  # (2n, 1, Hkv, R, D)
    kv.index_copy_(3, slots, new)


def step_mask(cols: Tensor, slots: Tensor, cache_len: Tensor, visible: Tensor | None) -> Tensor:
    """(Q, L) bool over buffer columns `cols` (L,): the committed prefix (< cache_len) plus,
    among the new `slots`, `visible` (Q, Q) (None: causal; a tree passes its ancestor matrix)."""
    Q = slots.shape[0]
    if visible is None:
        visible = torch.ones(Q, Q, dtype=torch.bool, device=cols.device).tril()
    return (cols < cache_len).repeat(Q, 1).index_copy_(1, slots, visible)


def target_inputs(
    embed: nn.Module, tables: list[tuple[Tensor, Tensor]], cols: Tensor, ids: Tensor,
    positions: Tensor, slots: Tensor, cache_len: Tensor, visible: Tensor | None,
    windows: list[int | None], groups: int,
) -> tuple[Tensor, list[tuple[Tensor, Tensor]], list[Tensor]]:  # fmt: skip
    """A target step's inputs to its layers: embeddings (Q, H) (the model's embedding module:
    Gemma's scales them), per RoPE table (L, D) the rows (Q, D) of the positions, and per entry
    of `windows` the folded mask the layers of that window share. A windowed mask measures
    positions, not slots: a slot's position is its own among the new slots (tree siblings
    share one), its index in the committed prefix."""
    full = step_mask(cols, slots, cache_len, visible)  # (Q, L)
    k_pos = cols.index_copy(0, slots, positions)  # (L,): each slot's position
    masks = [fold_mask(windowed(full, positions, k_pos, w), groups) for w in windows]
    return embed(ids), [(cos[positions], sin[positions]) for cos, sin in tables], masks


def target_outputs(
    norm: nn.Module, lm_head: nn.Module, x: Tensor, tapped: list[Tensor], softcap: float | None
) -> tuple[Tensor, Tensor | None]:
    """Logits (Q, V) of the last layer's rows x (Q, H) (soft-capped where the family does it),
    and the tapped layers' rows side by side (Q, n_taps*H), or None without taps."""
    logits = lm_head(norm(x))
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits, torch.cat(tapped, -1) if tapped else None


def drafter_inputs(
    drafter: Drafter, anchor: Tensor, mask_ids: Tensor, cos: Tensor, sin: Tensor, cols: Tensor,
    offsets: Tensor, length: Tensor, windows: list[int | None], groups: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, list[Tensor]]:  # fmt: skip
    """A draft's inputs to the drafter's layers for the block [anchor (1,), mask_ids (B-1,)]
    anchored at position T = length: embeddings (B, H), slots T..T+B-1 (B,), their RoPE rows
    (B, D), and per entry of `windows` (None: full attention) the folded SDPA form of
    masks.block_mask_mod: context j < T, every slot of the block; a window measures from the
    query's position T+k and is causal inside the block."""
    block = torch.cat([anchor, mask_ids])  # (B,)
    B = block.shape[0]
    x = drafter.embed_blocks(block[None])[0]  # (B, H)
    slots = length + offsets  # (B,)
    slot = offsets[:, None]  # (B, 1)
    j = cols[None, :]  # (1, L)
    kv_slot = j - length  # (1, L): block slot of column j, negative for context
    context = j < length  # (1, L)
    in_block = (kv_slot >= 0) & (kv_slot < B)  # (1, L)
    masks = []
    for w in windows:
        if w is None:
            mask = (context | in_block).expand(B, -1)  # (B, L)
        else:
            near = length + slot - j < w  # (B, L)
            causal = (kv_slot <= slot) & (slot - kv_slot < w)  # (B, L)
            mask = (context & near) | (in_block & causal)  # (B, L)
        masks.append(fold_mask(mask, groups))
    return x, slots, cos[slots], sin[slots], masks


def chain_drafts(drafter: Drafter, x: Tensor) -> Tensor:
    """The greedy drafts (B-1,) of slots 1..B-1 from the last layer's block rows x (B, H)."""
    return drafter.lm_head(drafter.norm(x)[1:]).argmax(-1)


def tree_candidates(drafter: Drafter, x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Per slot 1..B-1 the k most likely tokens: float32 log-probabilities and ids (B-1, k)."""
    return draft_candidates(drafter.lm_head(drafter.norm(x)[1:]), k)


def stacked_context_weights(drafter: Drafter) -> Tensor:
    """What `context_rows` takes, copied once from the drafter's layers: every layer's k_proj
    then every layer's v_proj weight as one (2n*Hkv*D, H) matrix. A copy (each layer's own k/v
    rows are views of its `fuse_layer` stack): build the StaticDrafter after the drafter's
    weights are final."""
    attns = [layer.self_attn for layer in drafter.layers]
    weight = torch.cat([a.k_proj.weight for a in attns] + [a.v_proj.weight for a in attns])
    return weight.detach().clone()


def kv_buffer(n_layers: int, shape: tuple[int, ...], like: Tensor) -> tuple[Tensor, list, list]:
    """One zeroed buffer (2 x n_layers, *shape) for every layer's K (at i) and V (at n + i) in
    the dtype and device of `like`, so one index_copy or index_select moves all layers at once;
    and its per-layer K and V views."""
    kv = torch.zeros((2 * n_layers, *shape), dtype=like.dtype, device=like.device)
    return kv, list(kv[:n_layers]), list(kv[n_layers:])


WARMUP_RUNS = 3  # eager runs on a side stream before a capture, as the CUDA-graph docs advise


def capture(
    fn: Callable[[], None], device: torch.device, pool, reset: Callable[[], None] = lambda: None
) -> torch.cuda.CUDAGraph:
    """fn's kernels as a CUDA graph in memory pool `pool` (the engines' graphs replay one at a
    time, so they share one), after warm-up runs on a side stream; `reset` runs before each
    warm-up and before the capture. fn runs for real in the warm-ups: after `reset` it must give
    the same result when run again."""
    with torch.cuda.device(device):
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                reset()
                fn()
        current.wait_stream(side)
        reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn()
    return graph


def compiled(fn, on: bool, dynamic: bool | None = False):
    """fn compiled for fixed shapes (one graph per shape; a layer function is shared by every
    layer of a model: regional compilation), or fn itself. `dynamic=None`: Dynamo's automatic
    dynamic shapes instead, one graph for the sizes a second call changes (sizes 0 and 1 keep
    their own): the concurrent engine's steps, whose row count is each level's."""
    return torch.compile(fn, fullgraph=True, dynamic=dynamic) if on else fn


def _aligned(n: int) -> int:
    return -(-n // CAPACITY_ALIGN) * CAPACITY_ALIGN


class StaticTarget:
    """An HF causal LM of a supported family (its own modules and weights) over a static KV cache
    of max_len slots per layer. Slots and positions are separate, so a tree's nodes can share a
    position while occupying their own slots."""

    def __init__(
        self, model: nn.Module, max_len: int, layer_ids: Sequence[int] = (), compile: bool = False
    ):
        check_target(model)
        self.layer = compiled(target_layer, compile)
        self.inputs = compiled(target_inputs, compile)
        self.outputs = compiled(target_outputs, compile)
        self.model = model
        self.base = model.get_decoder()
        self.layer_ids = list(layer_ids)
        if bad := [i for i in self.layer_ids if not 0 <= i < len(self.base.layers)]:
            raise ValueError(
                f"tapped layers {bad} are not layers of the {len(self.base.layers)}-layer target"
            )
        weight = self.base.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.max_len, self.capacity = max_len, _aligned(max_len)
        heads, self.num_kv_heads, self.head_dim = head_shape(model.config)
        self.groups = heads // self.num_kv_heads
        shape = (1, self.num_kv_heads, self.capacity, self.head_dim)
        # one buffer: a tree's commit moves the accepted slots of all layers in two kernels
        self.kv, self.k, self.v = kv_buffer(len(self.base.layers), shape, weight)
        self.fused = [fuse_layer(layer) for layer in self.base.layers]
        self.cols = torch.arange(self.capacity, device=self.device)  # (L,)
        self.tables, self.rope_of = rope_tables(self.base, self.cols, self.dtype)  # per layer
        per_layer = layer_windows(model.config)
        self.windows = list(dict.fromkeys(per_layer))  # one mask per distinct window
        self.mask_of = [self.windows.index(w) for w in per_layer]
        self.softcap = final_softcap(model.config)

    @torch.no_grad()
    def forward(
        self,
        ids: Tensor,
        positions: Tensor,
        slots: Tensor,
        cache_len: Tensor,
        visible: Tensor | None = None,
        taps: bool = False,
        last_only: bool = False,
        eager: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Logits (Q, V) (the last row only with last_only) of Q new tokens `ids` at `positions`,
        their K/V written into `slots` (all (Q,) device tensors; cache_len a one-element tensor)
        and, with taps, the outputs of decoder layers `layer_ids` (Q, n_taps*H). `eager`: the
        uncompiled layers (a prefill, whose length changes per prompt)."""
        inputs, run, outputs = (
            (target_inputs, target_layer, target_outputs)
            if eager
            else (self.inputs, self.layer, self.outputs)
        )
        x, ropes, masks = inputs(self.base.embed_tokens, self.tables, self.cols, ids, positions,
                                 slots, cache_len, visible, self.windows, self.groups)  # fmt: skip
        tapped = {}
        for i, layer in enumerate(self.base.layers):
            cos, sin = ropes[self.rope_of[i]]
            mask = masks[self.mask_of[i]]
            x = run(layer, x, self.k[i], self.v[i], cos, sin, slots, mask, self.fused[i])
            if i in self.layer_ids:
                tapped[i] = x
        if last_only:
            x = x[-1:]
        taps_in_order = [tapped[i] for i in self.layer_ids] if taps else []
        return outputs(self.base.norm, self.model.lm_head, x, taps_in_order, self.softcap)

    @torch.no_grad()
    def commit(self, src_slots: Tensor, dst_start: Tensor | int) -> None:
        """Copy the K/V at src_slots (n,) to the contiguous slots dst_start.. (a tree's accepted
        path moved behind the prefix). The sources are gathered first, so ranges may overlap."""
        dst = dst_start + torch.arange(src_slots.shape[0], device=self.device)  # (n,)
        self.kv.index_copy_(3, dst, self.kv.index_select(3, src_slots))  # (2L, 1, n_kv, slot, D)


class StaticDrafter:
    """A DFlash drafter whose context keys/values live in one static buffer for all layers: each
    accepted row is projected once (k_proj -> k_norm -> RoPE at its position, v_proj; every layer
    in one matmul), at slot = position.
    A draft writes its block's own K/V at slots T..T+B-1 (the next append overwrites them)."""

    def __init__(self, drafter: Drafter, max_len: int, compile: bool = False):
        self.drafter = drafter
        self.layer = compiled(drafter_layer, compile)
        self.context_rows = compiled(context_rows, compile)
        self.inputs = compiled(drafter_inputs, compile)
        self.chain = compiled(chain_drafts, compile)
        self.candidates = compiled(tree_candidates, compile)
        cfg = drafter.config
        self.block_size = cfg.block_size
        if cfg.block_size + 1 > max_len:
            raise ValueError(
                f"drafter block_size {cfg.block_size} does not fit max_len {max_len}: a step "
                "needs block_size slots after at least one committed token"
            )
        weight = drafter.fc.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.max_len, self.capacity = max_len, _aligned(max_len)
        shape = (1, cfg.num_key_value_heads, self.capacity, cfg.head_dim)
        # one buffer: an append writes the context rows of all layers at once (`context_rows`)
        self.kv, self.k, self.v = kv_buffer(len(drafter.layers), shape, weight)
        self.context_weight = stacked_context_weights(drafter)
        self.fused = [fuse_layer(layer) for layer in drafter.layers]
        self.cols = torch.arange(self.capacity, device=self.device)  # (L,)
        self.offsets = torch.arange(cfg.block_size, device=self.device)  # (B,)
        self.masks_ids = torch.full(
            (cfg.block_size - 1,), cfg.mask_token_id, dtype=torch.long, device=self.device
        )
        with torch.no_grad():
            self.cos, self.sin = drafter.rotary_emb(self.cols)  # (L, D) float32, as Drafter's
        self.windows = list(dict.fromkeys(cfg.sliding_windows))
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads

    @torch.no_grad()
    def append(self, states: Tensor, start: Tensor | int, eager: bool = False) -> None:
        """Context rows of target states (R, n_taps*H) at slots/positions start..start+R-1
        (`eager`: uncompiled, for a prefill's prompt-length rows)."""
        run = context_rows if eager else self.context_rows
        run(self.drafter, states, self.kv, self.context_weight, self.cos, self.sin, start)

    @torch.no_grad()
    def block_rows(self, anchor: Tensor, length: Tensor) -> Tensor:
        """The last layer's rows (B, H) of the block [anchor, MASK..] at positions T..T+B-1."""
        d = self.drafter
        x, slots, cos, sin, masks = self.inputs(d, anchor, self.masks_ids, self.cos, self.sin,
                                                self.cols, self.offsets, length, self.windows,
                                                self.groups)  # fmt: skip
        by_window = dict(zip(self.windows, masks, strict=True))
        for i, layer in enumerate(d.layers):
            mask = by_window[layer.self_attn.sliding_window]
            x = self.layer(layer, x, self.k[i], self.v[i], cos, sin, slots, mask, self.fused[i])
        return x

    @torch.no_grad()
    def propose(self, anchor: Tensor, length: Tensor) -> Tensor:
        """Greedy drafts (B-1,) of slots 1..B-1 (the chain)."""
        return self.chain(self.drafter, self.block_rows(anchor, length))

    @torch.no_grad()
    def top_k(self, anchor: Tensor, length: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """Per slot 1..B-1 the k most likely tokens: float32 log-probabilities and ids (B-1, k)."""
        return self.candidates(self.drafter, self.block_rows(anchor, length), k)
