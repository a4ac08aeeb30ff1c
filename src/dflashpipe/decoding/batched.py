"""Batched, continuous generation over a static KV cache: regenerate's engine.

    requests ─► queue ─► free row slots, gathered ─► refill: the prompts but their last tokens
                  ▲                                  packed into one sequence of a fixed length
                  │                                  (one forward, one shape), each prompt's K/V
                  │                                  written to its row's cache; the last token
                  │                                  is the row's next input, so every answer
                  │                                  token comes from a step
    decode step   all R rows, one fixed shape (a CUDA graph on CUDA; eager on the CPU):
                  token (R,) at position length (R,) -> logits (R, V) -> greedy or sampled
                  token; active rows: length += 1, produced += 1, done = a stop token or the
                  row's limit; read back [emitted, token, done] (3, R)
    host          appends the emitted tokens; a done row yields its Answer, frees its slot ─┘

Cache: one buffer (2 x layers, R + 1, n_kv, capacity, D); row r holds its sequence at slots =
positions 0..length-1, so nothing depends on the slot a request lands in or on its neighbours
(sampling too: sampling.py). Row R is scratch, written by a pack's padding. A step attends
over the first `span` slots of every row under a length mask (a windowed layer's also drops what
lies past its window): the shortest of the capacity's quarters that holds every busy row's
filled slots, one captured graph per span (`span_lengths`), so the cache it reads follows how
full the rows are rather than the longest prompt + max_new_tokens. With `attention="flex"` each
row reads only its own KV blocks instead (flex_attention over a per-row block table built in the
step: `flex_blocks`); not for sink logits or score soft-capping. Which is faster on a GPU is
benchmarks/regenerate.py's `--attention dense flex`.

Refills are gathered: freed rows wait until the next prompts fill a pack (packs.py), or
`refill_rows` rows are free, or nothing else would run (no row busy, or the queue's last
requests fit the free rows), so prefill work is the prompts' tokens, not a padded forward per row.

Pipelined by one step: the host reads step t-1 back while step t runs and refills the rows it
finished after step t, so the device never waits on host work; that read-back is the step's
only sync (refills add host-to-device copies only).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from dflashpipe.decoding.batched_step import advance, decode_state
from dflashpipe.decoding.families import attention_extras, check_target
from dflashpipe.decoding.layers import FLEX_BLOCK, decoder_layer, rows_inputs
from dflashpipe.decoding.memory import check_fit
from dflashpipe.decoding.packs import default_pack, fill_pack, pack_lengths
from dflashpipe.decoding.sampling import Sampling
from dflashpipe.decoding.static_models import (
    CAPACITY_ALIGN,
    StaticTarget,
    capture,
    compiled,
    step_modes,
)

REFILL_SHARE = 16  # by default refills wait for rows / REFILL_SHARE free rows at most
MAX_STOPS = 32  # stop ids a call may give (a fixed-size buffer the step reads)
ATTENTIONS = ("dense", "flex")


def span_lengths(capacity: int) -> list[int]:
    """The cache spans a decode step may attend over, shortest first: the capacity's quarters
    (aligned), the capacity last. Each step takes the shortest that holds every busy row's slots
    so far and the one it writes, so it reads about as much of the cache as the rows fill, and a
    run fed longest prompts first (as regenerate's plan is) less and less as it goes."""
    aligned = {-(-capacity * q // 4 // CAPACITY_ALIGN) * CAPACITY_ALIGN for q in (1, 2, 3)}
    return sorted(n for n in aligned if n < capacity) + [capacity]


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


class Queue:
    """The requests not admitted yet, taken in order, with their prompts' prefill tokens (all
    but the last) summed, so the gathering rule costs O(1) per step at any row count."""

    def __init__(self, requests: Sequence[Request]):
        self.requests, self.head = requests, 0
        self.csum = np.cumsum([0] + [len(r.prompt) - 1 for r in requests])

    def __len__(self) -> int:
        return len(self.requests) - self.head

    def tokens(self, n: int) -> int:
        """Prefill tokens of the next n requests."""
        return int(self.csum[self.head + n] - self.csum[self.head])

    def fitting(self, budget: int, n: int) -> int:
        """How many of the next n requests fit `budget` prefill tokens together."""
        ends = self.csum[self.head + 1 : self.head + n + 1] - self.csum[self.head]
        return int(np.searchsorted(ends, budget, side="right"))

    def take(self, k: int) -> range:
        taken = range(self.head, self.head + k)
        self.head += k
        return taken


class BatchedEngine:
    """Generation for many requests over `rows` row slots of a static cache of `capacity` slots
    each (prompt + max_new_tokens must fit). The target's q/k/v and gate/up weights become views
    of fused ones (families.fuse_layer); a mixture of experts runs capturable experts under
    graphs (families.graph_safe_experts). `graphs` (default: on CUDA) captures the decode step
    and each prefill shape as CUDA graphs; `compile` (default: with graphs) compiles the step's
    per-layer functions for their one shape. `memory_budget`: bytes the cache and step buffers
    may take (None: memory.MEMORY_SHARE of the free memory). `pack_tokens`: the longest prefill
    pack (None: `default_pack`; at least the capacity); `refill_rows`: free rows that start a
    refill however few tokens their prompts hold (None: rows / REFILL_SHARE, at least 1);
    `attention`: "dense" (a step reads a span of every row's cache) or "flex" (each row reads
    its own KV blocks; the capacity then rounds up to FLEX_BLOCK)."""

    def __init__(
        self, model: nn.Module, rows: int, capacity: int, graphs: bool | None = None,
        compile: bool | None = None, memory_budget: int | None = None,
        pack_tokens: int | None = None, refill_rows: int | None = None,
        attention: str = "dense",
    ):  # fmt: skip
        check_target(model)
        if attention not in ATTENTIONS:
            raise ValueError(f"attention is {attention!r}: expected one of {ATTENTIONS}")
        if attention == "flex" and attention_extras(model):
            raise ValueError(f"attention 'flex' does not take {attention_extras(model)} "
                             f"({model.config.model_type}): use 'dense'")  # fmt: skip
        self.attention, self.flex = attention, attention == "flex"
        align = FLEX_BLOCK if self.flex else CAPACITY_ALIGN
        self.capacity = -(-capacity // align) * align
        check_fit(model, rows, self.capacity, memory_budget)
        self.model, self.rows = model, rows
        self.device = model.get_input_embeddings().weight.device
        self.graphs, self.compiled = step_modes(model, graphs, compile)
        # the target's buffers (row `rows`: scratch), fused weights, RoPE tables and windows
        self.target = StaticTarget(model, self.capacity, rows=rows + 1)
        self.kv, self.k, self.v = self.target.kv, self.target.k, self.target.v
        longest = 1 << (self.capacity - 1).bit_length()  # every prompt fits a pack
        self.pack = max(longest, pack_tokens or default_pack(model))
        self.packs = pack_lengths(self.pack)
        self.refill_rows = refill_rows or max(1, rows // REFILL_SHARE)
        if not 1 <= self.refill_rows <= rows:
            raise ValueError(f"refill_rows is {refill_rows}: expected 1..{rows} (the rows)")
        # the engine's layers, their graphs kept apart from the other engines' (`compiled`)
        cache = "decode flex" if self.flex else "decode"
        self.layer = compiled(decoder_layer, self.compiled, cache=cache)
        self.inputs = compiled(rows_inputs, self.compiled, cache="decode")
        # every row's decode state (graph inputs and outputs); the call's stop ids, -1 padded
        self.state = decode_state(rows, self.capacity, self.device)
        self.stops = torch.full((MAX_STOPS,), -1, dtype=torch.long, device=self.device)
        # flex reads each row's own blocks: one span, the whole cache
        self.spans = [self.capacity] if self.flex else span_lengths(self.capacity)
        self._prompt = np.zeros(rows, dtype=np.int64)  # per row: its prompt's length; 0: free
        self._choosers: dict[Sampling | None, Callable] = {}
        self._steps: dict[tuple, Callable] = {}
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[Tensor]]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        pinned = {"pin_memory": True} if self.device.type == "cuda" else {}
        self._host = [torch.zeros(3, rows, dtype=torch.long, **pinned) for _ in range(2)]
        self.stats: Counter[str] = Counter()  # steps, prefills, prefill/prompt_tokens, captures

    @torch.no_grad()
    def generate(
        self, requests: Sequence[Request], max_new_tokens: int, stop_ids: set[int],
        sampling: Sampling | None = None,
    ) -> Iterator[Answer]:  # fmt: skip
        """Answers to `requests` as they finish (not in request order); requests with a seed
        are sampled under `sampling`. Every request is checked before anything is decoded."""
        limits = self._check(requests, max_new_tokens, stop_ids, sampling)
        sampled = sampling if any(r.seed is not None for r in requests) else None
        self.state["active"].zero_()  # every row idle (a call left early leaves rows on)
        self._prompt[:] = 0
        steps = [self._decoder(sampled, span) for span in self.spans]
        self.stops.fill_(-1).narrow(0, 0, len(stop_ids)).copy_(torch.tensor(sorted(stop_ids)))
        queue, owner = Queue(requests), [-1] * self.rows  # slot -> request index
        out = np.zeros((self.rows, self.capacity), dtype=np.int64)  # per slot: its answer so far
        count = np.zeros(self.rows, dtype=np.int64)
        free = list(range(self.rows))[::-1]
        busy = self._admit(free, queue, 0, owner, limits, count)
        pending, turn = None, 0
        while pending is not None or busy:
            current = None
            if busy:  # the shortest span that holds every busy row's slots in this step
                k = bisect.bisect_left(self.spans, self._reach(count))
                self._run(*steps[k])
                self.stats["steps"] += 1
                self.stats["span_slots"] += self.spans[k]
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
                free += freed
                self._prompt[freed] = 0
                busy -= len(freed)
                busy += self._admit(free, queue, busy, owner, limits, count)
            pending = current

    def figures(self, since: Mapping[str, int] | None = None) -> dict:
        """The work since `since` (an earlier copy of `stats`; None: all of it): steps, prefills,
        how full the packs were and what share of the cache the steps read (0-1), graphs
        captured. Regenerate logs it with each part; the benchmark reports its timed run's."""
        s = {k: v - (since or {}).get(k, 0) for k, v in self.stats.items()}
        fill = s["prompt_tokens"] / s["prefill_tokens"] if s.get("prefill_tokens") else 0.0
        span = s["span_slots"] / (s["steps"] * self.capacity) if s.get("steps") else 0.0
        return {"steps": s.get("steps", 0), "prefills": s.get("prefills", 0),
                "pack_fill": round(fill, 4), "cache_read": round(span, 4),
                "captures": s.get("captures", 0)}  # fmt: skip

    @torch.no_grad()
    def prepare(self, sampling: Sampling | None = None) -> None:
        """Capture (or, compiled without graphs, run once) the decode step and every pack
        length's prefill now, so a run compiles and captures nothing: all-padding packs, which
        write the scratch row only. Eager (neither), there is nothing to prepare: running every
        span and pack once took 25 s of a CPU regenerate shard's 43 on SmolLM2."""
        if not (self.graphs or self.compiled):
            return
        self.state["active"].zero_()
        for key in [None] + ([sampling] if sampling is not None else []):
            for span in self.spans:
                self._decoder(key, span)
        for T in self.packs:  # all padding: writes the scratch row only
            self._run(("prefill", T), self._prefill_forward,
                      torch.from_numpy(fill_pack([], [T], self.rows)[0]))  # fmt: skip

    @torch.no_grad()
    def idle_steps(self, n: int) -> None:
        """n greedy decode steps over the whole cache with every row idle (the kernels and
        shapes of the longest step: what benchmarks time alone)."""
        self.state["active"].zero_()
        key, step = self._decoder(None, self.capacity)
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

    def _decoder(self, sampling: Sampling | None, span: int) -> tuple[tuple, Callable[[], None]]:
        """The decode step of all rows over the first `span` slots of their cache (greedy, or
        with sampled rows under `sampling`) and its graph's key, captured on first use. A
        capture's warm-ups run the step for real, so it must come while every row is idle:
        generate() and prepare() take every span's step before any row is busy."""
        key = ("decode", sampling, span)
        if key not in self._steps:
            if sampling not in self._choosers:

                def tokens(norm, lm_head, x, state, stops):  # sampling: a constant of the graph
                    advance(norm, lm_head, x, state, stops, sampling, self.target.softcap)

                self._choosers[sampling] = compiled(tokens, self.compiled)
            choose = self._choosers[sampling]
            k = [k[: self.rows, :, :span] for k in self.k]  # views: the step reads no further
            v = [v[: self.rows, :, :span] for v in self.v]
            t, s = self.target, self.state
            cols = t.cols[:span]

            def step() -> None:  # one token per row: (R, 1) inputs, views of the state
                x, ropes, index, masks = self.inputs(t.base.embed_tokens, t.tables, cols,
                                                     s["token"][:, None], s["length"][:, None],
                                                     t.windows, t.groups, self.flex)  # fmt: skip
                x, _ = t.run_layers(x, ropes, index, masks, k, v, self.layer)  # (R, 1, H)
                choose(t.base.norm, self.model.lm_head, x[:, 0], s, self.stops)

            self._steps[key] = step
        if self.graphs and key not in self._graphs:
            self._graphs[key] = (capture(self._steps[key], self.device, self._pool), [])
            self.stats["captures"] += 1
        return key, self._steps[key]

    def _reach(self, count: np.ndarray) -> int:
        """Slots the step about to run may touch in any busy row: its prompt, the answer tokens
        the host has read back (`count`: through the step before the one in flight) and one more
        for the step in flight: the row's input sits at slot prompt - 1 + produced."""
        return int(np.where(self._prompt > 0, self._prompt + count, 0).max()) + 1

    def _admit(
        self, free: list[int], queue: Queue, busy: int, owner: list[int], limits: list[int],
        count: np.ndarray,
    ) -> int:  # fmt: skip
        """The next requests into `free` rows, a pack at a time, while the gathering rule (module
        docstring) holds: the free rows' next prompts fill a pack, `refill_rows` rows are free,
        no row is busy, or the queue's last requests fit the free rows. Returns how many."""
        admitted = 0
        while free and queue:
            n = min(len(free), len(queue))
            if not (queue.tokens(n) >= self.pack or len(free) >= self.refill_rows
                    or busy + admitted == 0 or len(queue) <= len(free)):  # fmt: skip
                break
            taken = [(free.pop(), j) for j in queue.take(queue.fitting(self.pack, n))]
            self._refill(taken, queue.requests, owner, limits, count)
            admitted += len(taken)
        return admitted

    def _refill(
        self, taken: list[tuple[int, int]], requests: Sequence[Request], owner: list[int],
        limits: list[int], count: np.ndarray,
    ) -> None:  # fmt: skip
        """Requests j into rows r, (r, j) in `taken`: state, uniforms and one pack's prefill,
        queued on the device after the step in flight (the rows take part from the next step
        on)."""

        def initial(j: int) -> list[int]:  # token, length, produced, limit, active, sampled
            r = requests[j]
            return [r.prompt[-1], len(r.prompt) - 1, 0, limits[j], 1, int(r.seed is not None)]

        rows = torch.tensor([r for r, _ in taken])  # (n,)
        state = torch.tensor([initial(j) for _, j in taken])  # (n, 6)
        uniforms = torch.zeros(len(taken), self.capacity)  # (n, C)
        for k, (r, j) in enumerate(taken):
            owner[r], count[r] = j, 0
            self._prompt[r] = len(requests[j].prompt)
            if requests[j].seed is not None:  # the request's own generator, wherever it runs
                g = torch.Generator().manual_seed(requests[j].seed)
                uniforms[k, : limits[j]] = torch.rand(limits[j], generator=g)
        rows, state = self._upload(rows), self._upload(state)
        for k, name in enumerate(("token", "length", "produced", "limit", "active", "sampled")):
            self.state[name].index_copy_(0, rows, state[:, k].to(self.state[name].dtype))
        self.state["uniforms"].index_copy_(0, rows, self._upload(uniforms))
        self._prefill([(r, requests[j].prompt[:-1]) for r, j in taken])

    def _prefill(self, jobs: list[tuple[int, Sequence[int]]]) -> None:
        """Each (row, tokens) cached at slots 0..len-1 of its row, all in one pack
        (packs.fill_pack; the pad writes the scratch row), with no logits: a row's last prompt
        token is its first step's input. Eager, one graph per pack length on CUDA."""
        used = sum(len(ids) for _, ids in jobs)
        if not used:  # one-token prompts have nothing to cache
            return
        pack, _ = fill_pack(jobs, self.packs, self.rows)
        T = pack.shape[1]
        self._run(("prefill", T), self._prefill_forward, torch.from_numpy(pack))
        self.stats["prefills"] += 1
        self.stats["prefill_tokens"] += T
        self.stats["prompt_tokens"] += used

    def _prefill_forward(self, pack: Tensor) -> None:
        self.target.pack(pack, self.k, self.v)

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
