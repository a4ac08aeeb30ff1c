"""Batched, continuous generation over a static KV cache: regenerate's engine.

    requests ─► queue ─► a free row slot ─► refill: the prompt but its last token prefilled
                  ▲                          into the row's cache (refills of one length bucket
                  │                          in one forward); the last token is the row's next
                  │                          input, so every answer token comes from a step
    decode step   all R rows, one fixed shape (a CUDA graph on CUDA; eager on the CPU):
                  token (R,) at position length (R,) -> logits (R, V) -> greedy or sampled
                  token; active rows: length += 1, produced += 1, done = a stop token or the
                  row's limit; read back [emitted, token, done] (3, R)
    host          appends the emitted tokens; a done row yields its Answer, frees its slot ─┘

Cache: one buffer (2 x layers, R + 1, n_kv, capacity, D); row r holds its sequence at slots =
positions 0..length-1, so nothing depends on the slot a request lands in or on its neighbours
(sampling too: sampling.py). Row R is scratch, written by the pad rows of prefill chunks (padded
to a power-of-two row count: few shapes). The step attends over each row's whole buffer under a
length mask (a windowed layer's also drops what lies past its window), so its shape never
changes.

Pipelined by one step: the host reads step t-1 back while step t runs and refills the rows it
finished after step t, so a finished row idles exactly one step and the device never waits on
host work; that read-back is the step's only sync (refills add host-to-device copies only).
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from dflashpipe.decoding.families import (
    check_target,
    final_softcap,
    fold_mask,
    fuse_layer,
    graph_safe_experts,
    head_shape,
    layer_attention,
    layer_out,
    layer_qkv,
    layer_windows,
    rope_tables,
    rotate,
    windowed,
)
from dflashpipe.decoding.memory import check_fit
from dflashpipe.decoding.sampling import Sampling, draw
from dflashpipe.decoding.static_models import CAPACITY_ALIGN, compiled, kv_buffer

WARMUP_RUNS = 3  # eager runs on a side stream before a capture, as the CUDA-graph docs advise
MIN_BUCKET = 16  # the shortest prefill length bucket
PREFILL_TOKENS = 16384  # rows x bucket length of one prefill forward, at most
MAX_STOPS = 32  # stop ids a call may give (a fixed-size buffer the step reads)


@dataclass(frozen=True)
class Request:
    """One answer to make. `seed`: None decodes greedily, else the sampling generator's seed;
    `max_new_tokens`: None takes the call's; `name` (e.g. the sample id) names it in errors."""

    name: str
    prompt: Sequence[int]
    seed: int | None = None
    max_new_tokens: int | None = None


@dataclass(frozen=True)
class Answer:
    index: int  # of the request in the call
    tokens: list[int]  # the new tokens, a stop token included
    finish: str  # "stop" (a stop token) or "length" (max_new_tokens)


def decode_inputs(
    embed: nn.Module, tables: list[tuple[Tensor, Tensor]], cols: Tensor, token: Tensor,
    length: Tensor, windows: list[int | None], groups: int,
) -> tuple[Tensor, list[tuple[Tensor, Tensor]], tuple[Tensor, Tensor], list[Tensor]]:  # fmt: skip
    """A decode step's inputs to its layers: embeddings (R, H) of each row's input token at
    position = slot = length (R,), per RoPE table (C, D) its rows (R, 1, 1, D), where its K/V go
    (rows 0..R-1, slots `length`), and per entry of `windows` the folded mask (R, 1, g, C) the
    layers of that window share: the row's committed slots and its new one (within the window)."""
    R = token.shape[0]
    full = (cols[None] <= length[:, None])[:, None]  # (R, 1, C): one query per row
    masks = [windowed(full, length[:, None], cols[None], w)[:, None].expand(R, 1, groups, -1)
             for w in windows]  # (R, 1, g, C) each  # fmt: skip
    index = (torch.arange(R, device=token.device), length)  # (R,), (R,)
    ropes = [(cos[length][:, None, None], sin[length][:, None, None]) for cos, sin in tables]
    return embed(token), ropes, index, masks


def decode_layer(
    layer: nn.Module, x: Tensor, k_cache: Tensor, v_cache: Tensor, cos: Tensor, sin: Tensor,
    index: tuple[Tensor, Tensor], mask: Tensor, fused: tuple,
) -> Tensor:  # fmt: skip
    """One decoder layer over one new token per row, x (R, H): each row's K/V written at its own
    slot (index: rows, slots) of its row of the buffers (R, Hkv, C, D), attention over that row
    only. The write is an index_put_ of R x Hkv vectors, which the compiler keeps in place; a
    scatter_ into the buffer view made it copy the whole buffer, twice per layer and step
    (H200 profile: 70% of the step, benchmarks/RESULTS.md)."""
    rows, slots = index
    q, k, v = layer_qkv(layer, x, fused)  # (R, Hq, D), (R, Hkv, D)
    q = rotate(q[:, :, None], cos, sin)  # (R, Hq, 1, D)
    k_cache[rows, :, slots] = rotate(k[:, :, None], cos, sin)[:, :, 0]  # (R, Hkv, D)
    v_cache[rows, :, slots] = v
    y = layer_attention(layer, q, k_cache, v_cache, mask)  # (R, Hq, 1, D)
    return layer_out(layer, x, y.flatten(1), fused)


def prefill_layer(
    layer: nn.Module, x: Tensor, k_cache: Tensor, v_cache: Tensor, cos: Tensor, sin: Tensor,
    rows: Tensor, mask: Tensor, fused: tuple,
) -> Tensor:  # fmt: skip
    """One decoder layer over whole prompts x (n, P, H) (right-padded) at positions 0..P-1:
    their K/V written at slots 0..P-1 of cache rows `rows` (n,), causal attention among
    themselves (a refilled row has no prefix)."""
    P = x.shape[1]
    q, k, v = layer_qkv(layer, x, fused)  # (n, P, Hq, D), (n, P, Hkv, D)
    q = rotate(q.transpose(1, 2), cos, sin)  # (n, Hq, P, D)
    k = rotate(k.transpose(1, 2), cos, sin)  # (n, Hkv, P, D)
    v = v.transpose(1, 2)  # (n, Hkv, P, D)
    k_cache[:, :, :P].index_copy_(0, rows, k)
    v_cache[:, :, :P].index_copy_(0, rows, v)
    y = layer_attention(layer, q, k, v, mask)  # (n, Hq, P, D)
    return layer_out(layer, x, y.transpose(1, 2).flatten(2), fused)


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


def capture(fn: Callable[[], None], device: torch.device, pool) -> torch.cuda.CUDAGraph:
    """fn's kernels as a CUDA graph, after warm-up runs on a side stream. fn runs for real in the
    warm-ups, so it must give the same result when run again (the prefills and a step of idle
    rows do)."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):  # one pool: the graphs replay one at a time
            fn()
    return graph


def bucket(n: int, capacity: int) -> int:
    """A prefill length for n tokens: the smallest power of two or 1.5 x a power of two >= n
    (MIN_BUCKET at least), within capacity: few shapes, at most a third of a chunk padding
    (powers of two alone pad a 767-token prompt to 1,024)."""
    p = max(MIN_BUCKET, 1 << (n - 1).bit_length())  # (n,) <= p
    return min(p * 3 // 4 if p > MIN_BUCKET and p * 3 // 4 >= n else p, capacity)


class BatchedEngine:
    """Generation for many requests over `rows` row slots of a static cache of `capacity` slots
    each (prompt + max_new_tokens must fit). The target's q/k/v and gate/up weights become views
    of fused ones (families.fuse_layer); a mixture of experts runs capturable experts under
    graphs (families.graph_safe_experts). `graphs` (default: on CUDA) captures the decode step
    and each prefill shape as CUDA graphs; `compile` (default: with graphs) compiles the step's
    per-layer functions for their one shape. `memory_budget`: bytes the cache and step buffers
    may take (None: memory.MEMORY_SHARE of the free memory)."""

    def __init__(
        self, model: nn.Module, rows: int, capacity: int, graphs: bool | None = None,
        compile: bool | None = None, memory_budget: int | None = None,
        prefill_tokens: int = PREFILL_TOKENS,
    ):  # fmt: skip
        check_target(model)
        self.capacity = -(-capacity // CAPACITY_ALIGN) * CAPACITY_ALIGN
        check_fit(model, rows, self.capacity, memory_budget)
        self.model, self.base, self.rows = model, model.get_decoder(), rows
        weight = self.base.embed_tokens.weight
        self.device = weight.device
        cuda = self.device.type == "cuda"
        self.graphs = cuda if graphs is None else graphs
        if self.graphs and not cuda:
            raise ValueError(f"CUDA graphs need a CUDA device; the target is on {self.device}")
        self.compiled = self.graphs if compile is None else compile
        graph_safe_experts(model, self.graphs, self.compiled)  # a MoE target's, fixed-shape
        heads, kv_heads, head_dim = head_shape(model.config)
        self.groups = heads // kv_heads
        shape = (rows + 1, kv_heads, self.capacity, head_dim)  # row `rows`: scratch
        self.kv, self.k, self.v = kv_buffer(len(self.base.layers), shape, weight)
        self.fused = [fuse_layer(layer) for layer in self.base.layers]
        self.prefill_tokens = prefill_tokens
        self.layer = compiled(decode_layer, self.compiled)
        self.inputs = compiled(decode_inputs, self.compiled)
        self.cols = torch.arange(self.capacity, device=self.device)  # (C,)
        # the model's own rotary embedding over every slot (per RoPE kind), as StaticTarget
        self.tables, self.rope_of = rope_tables(self.base, self.cols, weight.dtype)
        per_layer = layer_windows(model.config)
        self.windows = list(dict.fromkeys(per_layer))  # one mask per distinct window
        self.mask_of = [self.windows.index(w) for w in per_layer]
        self.softcap = final_softcap(model.config)
        long = {"dtype": torch.long, "device": self.device}
        # Every row's decode state: graph inputs and outputs, updated in place by the step.
        self.state = {
            "token": torch.zeros(rows, **long),  # the next input (not cached yet)
            "length": torch.zeros(rows, **long),  # committed slots = the input's position
            "produced": torch.zeros(rows, **long),  # answer tokens so far
            "limit": torch.zeros(rows, **long),  # the request's max_new_tokens
            "active": torch.zeros(rows, dtype=torch.bool, device=self.device),
            "sampled": torch.zeros(rows, dtype=torch.bool, device=self.device),
            "uniforms": torch.zeros(rows, self.capacity, device=self.device),  # (R, C) float32
            "packed": torch.zeros(3, rows, **long),  # [emitted, token, done]: the read-back
        }
        self.stops = torch.full((MAX_STOPS,), -1, **long)  # the call's stop ids; -1 pads
        self._steps: dict[Sampling | None, Callable] = {}
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[Tensor]]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        pinned = {"pin_memory": True} if cuda else {}
        self._host = [torch.zeros(3, rows, dtype=torch.long, **pinned) for _ in range(2)]
        self.stats: Counter[str] = Counter()  # steps, prefills, prefill_tokens, captures

    @torch.no_grad()
    def generate(
        self, requests: Sequence[Request], max_new_tokens: int, stop_ids: set[int],
        sampling: Sampling | None = None,
    ) -> Iterator[Answer]:  # fmt: skip
        """Answers to `requests` as they finish (not in request order); requests with a seed
        are sampled under `sampling`. Every request is checked before anything is decoded."""
        limits = self._check(requests, max_new_tokens, stop_ids, sampling)
        key, step = self._decoder(sampling if any(r.seed is not None for r in requests) else None)
        self.stops.fill_(-1).narrow(0, 0, len(stop_ids)).copy_(torch.tensor(sorted(stop_ids)))
        queue, owner = deque(range(len(requests))), [-1] * self.rows  # slot -> request index
        out = np.zeros((self.rows, self.capacity), dtype=np.int64)  # per slot: its answer so far
        count = np.zeros(self.rows, dtype=np.int64)
        busy = self._refill(list(range(self.rows)), queue, owner, requests, limits, count)
        pending, turn = None, 0
        while pending is not None or busy:
            current = None
            if busy:
                self._run(key, step)
                current, turn = self._read_back(turn), turn + 1
            if pending is not None:
                emitted, tokens, done = self._wait(pending)
                hit = np.flatnonzero(emitted)
                out[hit, count[hit]] = tokens[hit]
                count[hit] += 1
                freed = np.flatnonzero(done).tolist()
                for r in freed:
                    new = out[r, : count[r]].tolist()
                    yield Answer(owner[r], new, "stop" if new[-1] in stop_ids else "length")
                    owner[r] = -1
                busy += self._refill(freed, queue, owner, requests, limits, count) - len(freed)
            pending = current
        self.stats["steps"] += turn

    @torch.no_grad()
    def idle_steps(self, n: int) -> None:
        """n greedy decode steps with every row idle (the kernels and shapes of any step: what
        benchmarks time alone)."""
        key, step = self._decoder(None)
        for _ in range(n):
            self._run(key, step)

    def _check(
        self, requests: Sequence[Request], max_new_tokens: int, stop_ids: set[int],
        sampling: Sampling | None,
    ) -> list[int]:  # fmt: skip
        """Each request's limit; a request that cannot be decoded is refused, named."""
        if any(r.seed is not None for r in requests) and sampling is None:
            raise ValueError("requests with a seed are sampled: pass sampling=Sampling(...)")
        if len(stop_ids) > MAX_STOPS or any(t < 0 for t in stop_ids):
            raise ValueError(f"stop ids {sorted(stop_ids)}: expected at most {MAX_STOPS} ids >= 0")
        limits = []
        for r in requests:
            limit = r.max_new_tokens or max_new_tokens
            if not r.prompt or limit < 1:
                raise ValueError(f"request {r.name}: an empty prompt or max_new_tokens {limit}")
            if len(r.prompt) + limit > self.capacity:
                raise ValueError(
                    f"request {r.name}: its prompt of {len(r.prompt)} tokens + max_new_tokens "
                    f"{limit} does not fit the engine's cache of {self.capacity} slots per row"
                )
            limits.append(limit)
        return limits

    def _decoder(self, sampling: Sampling | None) -> tuple[tuple, Callable[[], None]]:
        """The decode step of all rows (greedy, or with sampled rows under `sampling`) and its
        graph's key; every row idle (a call left early leaves rows on), so a first capture's
        warm-up runs change nothing."""
        self.state["active"].zero_()
        if sampling not in self._steps:

            def tokens(norm, lm_head, x, state, stops):  # sampling: a constant of the graph
                advance(norm, lm_head, x, state, stops, sampling, self.softcap)

            choose = compiled(tokens, self.compiled)
            k, v = [k[: self.rows] for k in self.k], [v[: self.rows] for v in self.v]
            s, b = self.state, self.base

            def step() -> None:
                x, ropes, index, masks = self.inputs(b.embed_tokens, self.tables, self.cols,
                                                     s["token"], s["length"], self.windows,
                                                     self.groups)  # fmt: skip
                for i, layer in enumerate(b.layers):
                    cos, sin = ropes[self.rope_of[i]]
                    x = self.layer(layer, x, k[i], v[i], cos, sin, index, masks[self.mask_of[i]],
                                   self.fused[i])  # fmt: skip
                choose(b.norm, self.model.lm_head, x, s, self.stops)

            self._steps[sampling] = step
        key = ("decode", sampling)
        if self.graphs and key not in self._graphs:
            self._graphs[key] = (capture(self._steps[sampling], self.device, self._pool), [])
            self.stats["captures"] += 1
        return key, self._steps[sampling]

    def _refill(
        self, slots: list[int], queue: deque, owner: list[int], requests: Sequence[Request],
        limits: list[int], count: np.ndarray,
    ) -> int:  # fmt: skip
        """The next requests into free `slots`: state, uniforms and prefills, queued on the
        device after the step in flight (the rows take part from the next step on). Returns
        how many slots it filled."""
        taken = [(r, queue.popleft()) for r in slots[: len(queue)]]
        if not taken:
            return 0

        def initial(j: int) -> list[int]:  # token, length, produced, limit, active, sampled
            r = requests[j]
            return [r.prompt[-1], len(r.prompt) - 1, 0, limits[j], 1, int(r.seed is not None)]

        rows = torch.tensor([r for r, _ in taken])  # (n,)
        state = torch.tensor([initial(j) for _, j in taken])  # (n, 6)
        uniforms = torch.zeros(len(taken), self.capacity)  # (n, C)
        for k, (r, j) in enumerate(taken):
            owner[r], count[r] = j, 0
            if requests[j].seed is not None:  # the request's own generator, wherever it runs
                g = torch.Generator().manual_seed(requests[j].seed)
                uniforms[k, : limits[j]] = torch.rand(limits[j], generator=g)
        rows, state = self._upload(rows), self._upload(state)
        for k, name in enumerate(("token", "length", "produced", "limit", "active", "sampled")):
            self.state[name].index_copy_(0, rows, state[:, k].to(self.state[name].dtype))
        self.state["uniforms"].index_copy_(0, rows, self._upload(uniforms))
        self._prefill([(r, requests[j].prompt[:-1]) for r, j in taken])
        return len(taken)

    def _prefill(self, jobs: list[tuple[int, Sequence[int]]]) -> None:
        """Each (row, tokens) cached at slots 0..len-1 of its row: the rows of one length bucket
        together, in chunks of at most prefill_tokens, padded to a power-of-two row count."""
        by_bucket = defaultdict(list)
        for row, ids in jobs:
            if ids:  # a one-token prompt has nothing to cache
                by_bucket[bucket(len(ids), self.capacity)].append((row, ids))
        for P, group in sorted(by_bucket.items()):
            per = 1 << (max(1, self.prefill_tokens // P).bit_length() - 1)
            for i in range(0, len(group), per):
                chunk = group[i : i + per]
                n = 1 << (len(chunk) - 1).bit_length()
                ids = torch.zeros(n, P, dtype=torch.long)  # (n, P), right-padded
                rows = torch.full((n,), self.rows)  # pad rows write the scratch row
                for k, (row, tokens) in enumerate(chunk):
                    ids[k, : len(tokens)], rows[k] = torch.tensor(tokens), row
                self._run(("prefill", n, P), self._prefill_forward, ids, rows)
                self.stats["prefills"] += 1
                self.stats["prefill_tokens"] += n * P

    def _prefill_forward(self, ids: Tensor, rows: Tensor) -> None:
        """Prompts ids (n, P) into cache rows `rows` (n,): every layer's K/V, no logits (a
        row's last prompt token is its first step's input). Eager: its shapes vary."""
        P = ids.shape[1]
        x = self.base.embed_tokens(ids)  # (n, P, H)
        causal = torch.ones(P, P, dtype=torch.bool, device=self.device).tril()  # (P, P)
        pos = self.cols[:P]
        masks = [fold_mask(windowed(causal, pos, pos, w), self.groups) for w in self.windows]
        for i, layer in enumerate(self.base.layers):
            cos, sin = self.tables[self.rope_of[i]]
            x = prefill_layer(layer, x, self.k[i], self.v[i], cos[:P], sin[:P], rows,
                              masks[self.mask_of[i]], self.fused[i])  # fmt: skip

    def _run(self, key: tuple, fn: Callable, *inputs: Tensor) -> None:
        """fn(*inputs), or with graphs the replay of fn's graph for key (inputs copied into its
        static buffers; captured on first use)."""
        if not self.graphs:
            fn(*inputs)
            return
        if key not in self._graphs:
            static = [self._upload(t).clone() for t in inputs]
            self._graphs[key] = (capture(lambda: fn(*static), self.device, self._pool), static)
            self.stats["captures"] += 1
        graph, static = self._graphs[key]
        for buffer, t in zip(static, inputs, strict=True):
            buffer.copy_(t.pin_memory(), non_blocking=True)
        graph.replay()

    def _upload(self, t: Tensor) -> Tensor:
        """t on the device without a sync: through pinned memory on CUDA (the caching host
        allocator keeps the block until the copy is done)."""
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _read_back(self, turn: int) -> tuple[Tensor, torch.cuda.Event | None]:
        """The step's packed (3, R) into one of two pinned host buffers, asynchronously (the
        other holds the previous step's, read meanwhile)."""
        host = self._host[turn % 2]
        host.copy_(self.state["packed"], non_blocking=True)
        if self.device.type != "cuda":
            return host, None
        event = torch.cuda.Event()
        event.record()
        return host, event

    @staticmethod
    def _wait(pending: tuple[Tensor, torch.cuda.Event | None]) -> np.ndarray:
        host, event = pending
        if event is not None:
            event.synchronize()  # the step's one sync
        return host.numpy()
