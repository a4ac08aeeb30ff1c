"""Static KV caches: the target and the DFlash drafter over fixed buffers, built once.

    StaticTarget    an HF causal LM of a supported family (families.py), its own modules and
                    weights, q/k/v and gate/up fused (`fuse_layer`: the modules' weights become
                    views of the fused ones), RoPE tables and distinct windows; K/V of all
                    layers in one (2 x layers, rows, n_kv, capacity, D) buffer (per-layer views;
                    `buffers` makes more for the row engines); `forward`: the c = 1 step, new
                    tokens at explicit slots and positions (a tree's siblings share a position,
                    each has its own slot); `run_layers`: every engine's loop over the layers;
                    `pack`: a refill pack's forward; `commit`: a kept tree path moved behind
                    the prefix
    StaticDrafter   DFlash drafter; context K/V of all layers in one buffer, projected once per
                    accepted row at slot = position (append: one matmul for every layer), a
                    block [anchor, MASK..] drafted against it (`rows`, propose, top_k)

The layers are layers.py's, the same for every engine; tests check both models against the HF
forward and the eager DFlashProposer in float32. Only step-time values live on the device: no
host sync inside. Where the engine compiles (its default on CUDA), each layer function and the
glue around the layers are compiled for fixed shapes (`compiled`); a prefill runs them eager,
since its length changes per prompt. A faster target step is also the honest baseline:
speculative methods look better against a target step padded with launches they amortize.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from dflashpipe.decoding.families import (
    check_target,
    final_softcap,
    fuse_layer,
    graph_safe_experts,
    head_shape,
    layer_windows,
    rope_tables,
)
from dflashpipe.decoding.layers import (
    append_context,
    chain_drafts,
    decoder_layer,
    drafter_inputs,
    drafter_layer,
    pack_masks,
    target_inputs,
    target_outputs,
    tree_candidates,
)
from dflashpipe.model import Drafter

log = logging.getLogger(__name__)
CAPACITY_ALIGN = 16  # buffer lengths rounded up: memory-efficient SDPA wants aligned mask rows


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


def step_modes(model: nn.Module, graphs: bool | None, compile: bool | None) -> tuple[bool, bool]:
    """How an engine's steps run on `model`'s device: captured as CUDA graphs (default: on CUDA;
    refused elsewhere) and compiled (default: with graphs); a mixture of experts then runs
    experts it can compile whole and capture (families.graph_safe_experts)."""
    device = model.get_input_embeddings().weight.device
    graphs = device.type == "cuda" if graphs is None else graphs
    if graphs and device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device; the target is on {device}")
    compiled = graphs if compile is None else compile
    if switched := graph_safe_experts(model, graphs, compiled):
        log.info("target experts run as %s: capturable in %s", switched, model.dtype)
    return graphs, compiled


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


_CODE: dict[tuple[Callable, str], Callable] = {}  # (function, cache name) -> its copy


def compiled(fn, on: bool, dynamic: bool | None = False, cache: str | None = None):
    """fn compiled for fixed shapes (one graph per shape; a layer function is shared by every
    layer of a model: regional compilation), or fn itself. `dynamic=None`: Dynamo's automatic
    dynamic shapes instead, one graph for the sizes a second call changes (sizes 0 and 1 keep
    their own): the concurrent engine's steps, whose row count is each level's. `cache`: a copy
    of fn's code under that name, one per name for every engine that names it. Dynamo keeps its
    graphs, its recompile count and the sizes it has seen per code object: the engines share
    one layer function (layers.py) but keep their graphs apart, as when each had its own."""
    if not on:
        return fn
    if cache is not None:
        if (fn, cache) not in _CODE:
            _CODE[fn, cache] = types.FunctionType(fn.__code__.replace(), fn.__globals__,
                                                  fn.__name__, fn.__defaults__, fn.__closure__)  # fmt: skip
        fn = _CODE[fn, cache]
    return torch.compile(fn, fullgraph=True, dynamic=dynamic)


def _aligned(n: int) -> int:
    return -(-n // CAPACITY_ALIGN) * CAPACITY_ALIGN


class StaticTarget:
    """An HF causal LM of a supported family (its own modules and weights) over a static KV cache
    of max_len slots per layer and `rows` rows (the c = 1 engine: one). Slots and positions are
    separate, so a tree's nodes can share a position while occupying their own slots."""

    def __init__(
        self, model: nn.Module, max_len: int, layer_ids: Sequence[int] = (), compile: bool = False,
        rows: int = 1,
    ):  # fmt: skip
        check_target(model)
        self.layer = compiled(decoder_layer, compile)
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
        # one buffer: a tree's commit moves the accepted slots of all layers in two kernels
        self.kv, self.k, self.v = self.buffers(rows)
        self.fused = [fuse_layer(layer) for layer in self.base.layers]
        self.cols = torch.arange(self.capacity, device=self.device)  # (L,)
        self.tables, self.rope_of = rope_tables(self.base, self.cols, self.dtype)  # per layer
        per_layer = layer_windows(model.config)
        self.windows = list(dict.fromkeys(per_layer))  # one mask per distinct window
        self.mask_of = [self.windows.index(w) for w in per_layer]
        self.softcap = final_softcap(model.config)

    def buffers(self, rows: int) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Zeroed K/V buffers of `rows` rows for every layer: one (2 x layers, rows, n_kv,
        capacity, D) tensor and its per-layer K and V views (`kv_buffer`)."""
        shape = (rows, self.num_kv_heads, self.capacity, self.head_dim)
        return kv_buffer(len(self.base.layers), shape, self.base.embed_tokens.weight)

    def run_layers(
        self, x: Tensor, ropes: list[tuple], index: tuple, masks: list, ks: Sequence[Tensor],
        vs: Sequence[Tensor], layer: Callable, taps: Sequence[int] = (),
    ) -> tuple[Tensor, list[Tensor]]:  # fmt: skip
        """x through every decoder layer with `layer` (layers.decoder_layer, compiled or not,
        or mixed_layer) over the per-layer buffers ks / vs: each layer takes its RoPE table's
        entry of `ropes` and its window's of `masks`. The last layer's rows and those of the
        layers in `taps`, in that order."""
        tapped = {}
        for i, module in enumerate(self.base.layers):
            x = layer(module, x, ks[i], vs[i], *ropes[self.rope_of[i]], index,
                      masks[self.mask_of[i]], self.fused[i])  # fmt: skip
            if i in taps:
                tapped[i] = x
        return x, [tapped[i] for i in taps]

    def pack(
        self, pack: Tensor, ks: Sequence[Tensor], vs: Sequence[Tensor], taps: Sequence[int] = (),
        layer: Callable = decoder_layer,
    ) -> tuple[Tensor, list[Tensor]]:  # fmt: skip
        """A refill pack (4, T) of ids, cache rows, positions and prompt numbers (packs.py)
        through every layer: each token's K/V written at (row, position) of ks / vs, attention
        within its own prompt only. The last layer's rows (1, T, H) and the rows of the layers
        in `taps`, in that order. `layer`: decoder_layer or a compiled copy of it."""
        ids, rows, pos, _ = pack
        ropes = [(cos[pos], sin[pos]) for cos, sin in self.tables]  # (T, D) each
        masks = pack_masks(pack, self.windows, self.groups)
        x = self.base.embed_tokens(ids[None])  # (1, T, H)
        return self.run_layers(x, ropes, (rows, pos), masks, ks, vs, layer, taps)

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
        inputs, layer, outputs = (
            (target_inputs, decoder_layer, target_outputs)
            if eager
            else (self.inputs, self.layer, self.outputs)
        )
        x, ropes, index, masks = inputs(self.base.embed_tokens, self.tables, self.cols, ids,
                                        positions, slots, cache_len, visible, self.windows,
                                        self.groups)  # fmt: skip
        x, tapped = self.run_layers(x, ropes, index, masks, self.k, self.v, layer,
                                    self.layer_ids if taps else ())  # fmt: skip
        x = x[0, -1:] if last_only else x[0]  # (Q, H): the one row
        return outputs(self.base.norm, self.model.lm_head, x, [t[0] for t in tapped], self.softcap)

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
        self.layer = compiled(drafter_layer, compile, cache="drafter")
        self.context_rows = compiled(append_context, compile)
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
        # one buffer: an append writes the context rows of all layers at once (`context_rows`)
        self.kv, self.k, self.v = self.buffers(1)
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

    def buffers(self, rows: int) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Zeroed context K/V buffers of `rows` rows for every layer (`kv_buffer`)."""
        cfg = self.drafter.config
        shape = (rows, cfg.num_key_value_heads, self.capacity, cfg.head_dim)
        return kv_buffer(len(self.drafter.layers), shape, self.drafter.fc.weight)

    @torch.no_grad()
    def append(self, states: Tensor, start: Tensor | int, eager: bool = False) -> None:
        """Context rows of target states (R, n_taps*H) at slots/positions start..start+R-1
        (`eager`: uncompiled, for a prefill's prompt-length rows)."""
        run = append_context if eager else self.context_rows
        run(self.drafter, states, self.kv, self.context_weight, self.cos, self.sin, start)

    def rows(
        self, anchor: Tensor, length: Tensor, ks: Sequence[Tensor], vs: Sequence[Tensor],
        inputs: Callable, layer: Callable,
    ) -> Tensor:  # fmt: skip
        """The last layer's rows (N, B, H) of the blocks [anchor_r, MASK..] (anchor, length
        (N,)) at positions T_r..T_r+B-1 over the context buffers ks / vs, with `inputs`
        (layers.drafter_inputs) and `layer` (drafter_layer), compiled or not."""
        d = self.drafter
        x, index, cos, sin, masks = inputs(d, anchor, self.masks_ids, self.cos, self.sin,
                                           self.cols, self.offsets, length, self.windows,
                                           self.groups)  # fmt: skip
        by_window = dict(zip(self.windows, masks, strict=True))
        for i, module in enumerate(d.layers):
            mask = by_window[module.self_attn.sliding_window]
            x = layer(module, x, ks[i], vs[i], cos, sin, index, mask, self.fused[i])
        return x

    @torch.no_grad()
    def block_rows(self, anchor: Tensor, length: Tensor) -> Tensor:
        """The last layer's rows (B, H) of the block [anchor, MASK..] at positions T..T+B-1."""
        return self.rows(anchor, length, self.k, self.v, self.inputs, self.layer)[0]

    @torch.no_grad()
    def propose(self, anchor: Tensor, length: Tensor) -> Tensor:
        """Greedy drafts (B-1,) of slots 1..B-1 (the chain)."""
        x = self.rows(anchor, length, self.k, self.v, self.inputs, self.layer)  # (1, B, H)
        return self.chain(self.drafter, x, anchor)[0]

    @torch.no_grad()
    def top_k(self, anchor: Tensor, length: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
        """Per slot 1..B-1 the k most likely tokens: float32 log-probabilities and ids (B-1, k),
        and the slots' final states (B-1, H) (layers.tree_candidates)."""
        return self.candidates(self.drafter, self.block_rows(anchor, length), k)
