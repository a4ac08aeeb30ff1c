"""Decoding at concurrency c: c sequences side by side on the static engine's models, as a
serving engine batches its requests (evaluate.concurrency).

    rows          c row slots, each with its own target K/V (c, Hkv, C, D per layer) and drafter
                  context rows; a row holds one prompt at a time and takes the next from the
                  queue when its answer ends (continuous batching), so rows never wait for
                  each other's acceptance
    refill        the queue's next prompts into the rows a step freed, as many to one pack
                  as fit (packs.py): every layer's K/V at the rows' slots 0..P-1, the
                  drafter's context where DFlash decodes, each prompt's first token. "step"
                  (the default, as serving engines mix prefill into decode batches): the pack
                  rides in the next step's matmuls (`mixed_layer`; a graph per step kind and
                  pack length) and its rows join after it. "pack": a forward of its own
                  between steps (a graph per pack length), two target steps or more whatever
                  it holds (benchmarks/RESULTS.md)
    greedy step   target([anchor_r] at slot T_r) for every row in one forward -> g_r
    dflash step   drafter: c blocks [anchor_r, MASK x B-1] in one forward -> drafts (c, B-1);
                  verify: target(c x B tokens) in one forward -> greedy (c, B); each row accepts
                  its own matched prefix n_r and advances T_r by n_r + 1
    lookup step   the host's drafts per row (padded to K, with their counts), verified as above
    read back     (c, Q+1): [n_r + 1, g_r0..g_rQ-1] per row, one tensor per step ([1, its
                  first token] for a row the step refilled)

Every row's position is its slot (a row's own cache starts at 0), so a step's mask is the row's
slots up to each query's own (`cols <= slots`): the committed prefix and the chain before it.
A row with nothing left to decode idles: its length is put back to 0 after each step, so its
writes stay in its own first slots, and its outputs are dropped. Steps are fixed-shape functions
over static buffers, compiled and captured as CUDA graphs where the engine is (engine.py).

The layers are every engine's (layers.py, over N = c rows) on the engine's models
(static_models.py); this module decides what runs each step, the refills and the acceptance.
Outputs equal the c = 1 engine's token for token in float32 (tests/test_families.py, every
family). DDTree is not batched: evaluate measures it at c = 1 only.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from dflashpipe.decoding.layers import (
    accept_chain,
    chain_drafts,
    context_rows,
    decoder_layer,
    drafter_inputs,
    drafter_layer,
    mixed_layer,
    pack_masks,
    rows_inputs,
    target_outputs,
)
from dflashpipe.decoding.lookup import LookupConfig, PromptLookupProposer
from dflashpipe.decoding.memory import MEMORY_SHARE, free_memory
from dflashpipe.decoding.packs import default_pack, fill_pack, pack_lengths
from dflashpipe.decoding.static_models import capture, compiled
from dflashpipe.decoding.types import Decoded, clock, finish

if TYPE_CHECKING:  # the c = 1 engine whose models the rows run on; no code of it runs here
    from dflashpipe.decoding.engine import Engine

# prompt lookup's setting: one for every prompt, or one per prompt (evaluate: each source's best)
Lookups = LookupConfig | Sequence[LookupConfig] | None
# how freed rows take the queue's next prompts: in the next step's forward ("step") or in a
# forward of their own between steps ("pack")
REFILLS = ("step", "pack")


def rows_bytes(engine: Engine, rows: int) -> int:
    """What `rows` row slots take: the target's and the drafter's K/V buffers (the engine's hold
    one row each) once per row and once more for the refills' scratch row."""
    d = engine.drafter
    return (rows + 1) * (engine.target.kv.nbytes + (d.kv.nbytes if d is not None else 0))


def check_rows(engine: Engine, rows: int, key: str = "evaluate.concurrency") -> None:
    """Refuse (ValueError naming `key`) a concurrency below 1 or whose buffers exceed
    MEMORY_SHARE of the device's free memory, before anything is allocated."""
    if rows < 1:
        raise ValueError(f"{key}: {rows} is below 1; a concurrency counts rows decoded at once")
    need, budget = rows_bytes(engine, rows), int(MEMORY_SHARE * free_memory(engine.device))
    if need > budget:
        gib = 2**30
        raise ValueError(
            f"{key}: {rows} rows need {need / gib:.2f} GiB of K/V buffers (target and drafter, "
            f"{engine.max_len} slots a row), more than the {budget / gib:.2f} GiB budget on "
            f"{engine.device}; use a lower concurrency or shorter prompts / answers"
        )


@dataclass
class _Row:
    index: int  # the prompt's position in the request list
    prompt: list[int]
    out: list[int]
    accepted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    proposer: PromptLookupProposer | None = None
    tokens: list[int] = field(init=False)  # prompt + out, kept for the proposer

    def __post_init__(self) -> None:
        self.tokens = self.prompt + self.out

    def take(self, new: list[int]) -> None:
        self.out += new
        self.tokens += new


class ConcurrentEngine:
    """`rows` sequences decoded side by side (module docstring) on `engine`'s models: its
    target and drafter modules, fused weights, RoPE tables and compile / graph settings; one
    set of row buffers per instance. `dynamic` (torch.compile's, where the engine compiles):
    None, one graph per step function for every row count above 1 (Dynamo's automatic dynamic
    shapes); False, one per row count (benchmarks/RESULTS.md compares them). `refill` (REFILLS):
    "step" puts the queue's next prompts into the next step's forward, beside the busy rows'
    tokens (a graph per pack length and step kind); "pack" gives them a forward of their own
    between steps (a graph per pack length)."""

    def __init__(
        self, engine: Engine, rows: int, dynamic: bool | None = None, refill: str = "step"
    ):
        if refill not in REFILLS:
            raise ValueError(f"refill {refill!r}: one of {', '.join(REFILLS)}")
        check_rows(engine, rows)
        self.engine, self.rows, self.refill = engine, rows, refill
        t, d = engine.target, engine.drafter
        self.device, on = engine.device, engine.compiled
        # one row more than the steps read (row `rows`): a refill pack's padding writes there
        _, self.k_all, self.v_all = t.buffers(rows + 1)
        self.k, self.v = [k[:rows] for k in self.k_all], [v[:rows] for v in self.v_all]
        if d is not None:
            self.dkv, dk, dv = d.buffers(rows + 1)
            self.dk, self.dv = [k[:rows] for k in dk], [v[:rows] for v in dv]
        longest = 1 << (t.capacity - 1).bit_length()  # every prompt fits a pack
        self.packs = pack_lengths(max(longest, default_pack(t.model)))
        # the engine's layers, their graphs kept apart from its c = 1 steps' (`compiled`)
        self.inputs = compiled(rows_inputs, on, dynamic, cache="rows")
        self.layer = compiled(decoder_layer, on, dynamic, cache="rows")
        self.outputs = compiled(target_outputs, on, dynamic)
        self.draft_inputs = compiled(drafter_inputs, on, dynamic, cache="rows")
        self.draft_layer = compiled(drafter_layer, on, dynamic, cache="rows drafter")
        self.context = compiled(context_rows, on, dynamic, cache="rows")
        self.chain = compiled(chain_drafts, on, dynamic, cache="rows")
        self.prefill = compiled(decoder_layer, on, None, cache="pack")  # pack lengths vary
        self.mix = compiled(mixed_layer, on, None)
        long = {"dtype": torch.long, "device": self.device}
        self.length = torch.zeros(rows, **long)
        self.anchor = torch.zeros(rows, **long)
        self.idle = torch.zeros(rows, dtype=torch.bool, device=self.device)
        self.last = torch.zeros(rows, **long)  # a pack's: each prompt's last position in it
        self.first = torch.zeros(rows, **long)  # a pack's: each prompt's first new token
        # a refilling step's, per row: [refilled (0/1), its prompt's length, the prompt's last
        # token's place in the pack]; and a refill's pack (4, T) per pack length (static inputs,
        # either refill's)
        self.joins = torch.zeros(3, rows, **long)
        self.pack_in: dict[int, Tensor] = {}
        self.packed: dict[str, Tensor] = {}
        self.drafts: dict[str, Tensor] = {}  # lookup@K: (rows, K+1) [count, d_1..d_K]
        self.plans: dict[str, np.ndarray] = {}  # their host copies (the drafted counts)
        self.steps: dict[str, Callable[[], None]] = {}
        self._graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}  # (kind, pack length)
        self._packs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (length, taps)
        self._pool = None
        # the last decode's: steps (one forward of every row each), refill packs, seconds in
        # refills (packing, prefill, read-back) and in host work between steps (the device idle)
        self.steps_run, self.prefills, self.prefill_s, self.host_s = 0, 0, 0.0, 0.0

    # -- device work -------------------------------------------------------------------------

    def _forward(
        self, ids: Tensor, slots: Tensor, taps: bool, T: int = 0
    ) -> tuple[Tensor, Tensor | None, tuple[Tensor, Tensor | None] | None]:
        """The target over the rows' tokens ids (N, Q) at `slots`: logits (N, Q, V) and, with
        `taps`, the tapped layers' rows side by side; with a pack length T, the refill pack
        pack_in[T] in the same matmuls (`mixed_layer`), whose last layer's rows (T, H) and
        tapped rows (T, n_taps*H) (None without taps) come third."""
        t = self.engine.target
        x, ropes, index, masks = self.inputs(t.base.embed_tokens, t.tables, t.cols, ids, slots,
                                             t.windows, t.groups)  # fmt: skip
        taps_of = t.layer_ids if taps else ()
        if not T:
            x, tapped = t.run_layers(x, ropes, index, masks, self.k, self.v, self.layer, taps_of)
            return (*self.outputs(t.base.norm, t.model.lm_head, x, tapped, t.softcap), None)
        pack = self.pack_in[T]
        _, prow, ppos, _ = pack
        N, Q = ids.shape
        n = N * Q
        x = torch.cat([x.flatten(0, 1), t.base.embed_tokens(pack[0])])  # (N*Q + T, H)
        pack_ropes = [(cos[ppos], sin[ppos]) for cos, sin in t.tables]  # (T, D) each
        ropes = [(*rows, *pack) for rows, pack in zip(ropes, pack_ropes, strict=True)]
        masks = list(zip(masks, pack_masks(pack, t.windows, t.groups), strict=True))
        x, tapped = t.run_layers(x, ropes, (index, (prow, ppos)), masks, self.k_all, self.v_all,
                                 self.mix, taps_of)  # fmt: skip
        logits, states = self.outputs(t.base.norm, t.model.lm_head, x[:n].unflatten(0, (N, Q)),
                                      [h[:n].unflatten(0, (N, Q)) for h in tapped],
                                      t.softcap)  # fmt: skip
        pack_states = torch.cat([h[n:] for h in tapped], -1) if taps else None
        return logits, states, (x[n:], pack_states)

    def _join(self, kind: str, T: int, pack_out: tuple[Tensor, Tensor | None]) -> None:
        """After a refilling step: the rows its pack filled (joins) take their prompt's length
        and first token (greedy at the prompt's last place in the pack: their anchor, and
        [1, token] in the step's read-back) and stop idling; with the pack's tapped rows, the
        drafter's context of every prompt token (written after the step's own, which the
        refilled rows' idle tokens wrote at their first slots)."""
        new, length, last = self.joins[0] > 0, self.joins[1], self.joins[2]
        first = self._pack_outputs(*pack_out, self.pack_in[T], last)  # (rows,)
        self.anchor.copy_(torch.where(new, first, self.anchor))
        self.length.copy_(torch.where(new, length, self.length))
        self.idle.logical_and_(~new)
        packed = self.packed[kind]
        packed[:, 0].copy_(torch.where(new, 1, packed[:, 0]))
        packed[:, 1].copy_(torch.where(new, first, packed[:, 1]))

    def _pack_step(self, pack: Tensor, taps: bool) -> None:
        """A refill pack (4, T) (StaticTarget.pack) into the rows' buffers; each
        prompt's first token (greedy at its last position, `last`) into `first`; with `taps`,
        the drafter's context of every prompt token."""
        t = self.engine.target
        x, tapped = t.pack(pack, self.k_all, self.v_all, t.layer_ids if taps else (), self.prefill)
        states = torch.cat(tapped, -1)[0] if taps else None
        self.first.copy_(self._pack_outputs(x[0], states, pack, self.last))

    def _pack_outputs(self, x: Tensor, states: Tensor | None, pack: Tensor, last: Tensor) -> Tensor:
        """What a refill pack (4, T) leaves from its last layer's rows x (T, H): the greedy
        token at each place in `last` (a prompt's last token: its first new one), and, with the
        tapped rows `states` (T, n_taps*H), the drafter's context of every prompt token."""
        t, d = self.engine.target, self.engine.drafter
        logits, _ = target_outputs(t.base.norm, t.model.lm_head, x[last], [], t.softcap)
        if states is not None:
            _, rows, pos, _ = pack
            context_rows(d.drafter, states[None], self.dkv, d.context_weight, d.cos, d.sin,
                         (rows[None], pos[None]))  # fmt: skip
        return logits.argmax(-1)

    def _propose(self) -> Tensor:
        d = self.engine.drafter
        x = d.rows(self.anchor, self.length, self.dk, self.dv, self.draft_inputs, self.draft_layer)
        return self.chain(d.drafter, x, self.anchor)  # (N, B-1)

    def _greedy_step(self, T: int = 0) -> None:
        slots = self.length[:, None]  # (N, 1)
        logits, _, pack = self._forward(self.anchor[:, None], slots, False, T)
        empty = self.anchor.new_zeros(self.rows, 0)
        accept_chain(logits, empty, None, self.anchor, self.packed["greedy"], self.length)
        self._rest("greedy", T, pack)

    def _dflash_step(self, T: int = 0) -> None:
        d = self.engine.drafter
        drafts = self._propose()  # (N, B-1)
        slots = self.length[:, None] + d.offsets  # (N, B)
        ids = torch.cat([self.anchor[:, None], drafts], 1)
        logits, states, pack = self._forward(ids, slots, True, T)
        rows = torch.arange(self.rows, device=self.device)[:, None]
        self.context(d.drafter, states, self.dkv, d.context_weight, d.cos, d.sin, (rows, slots))
        accept_chain(logits, drafts, None, self.anchor, self.packed["dflash"], self.length)
        self._rest("dflash", T, pack)

    def _lookup_step(self, kind: str, T: int = 0) -> None:
        plan = self.drafts[kind]
        count, drafts = plan[:, 0], plan[:, 1:]  # (N,), (N, K)
        slots = self.length[:, None] + torch.arange(drafts.shape[1] + 1, device=self.device)
        ids = torch.cat([self.anchor[:, None], drafts], 1)
        logits, _, pack = self._forward(ids, slots, False, T)
        accept_chain(logits, drafts, count, self.anchor, self.packed[kind], self.length)
        self._rest(kind, T, pack)

    def _rest(self, kind: str, T: int, pack: tuple[Tensor, Tensor | None] | None) -> None:
        """Idle rows back to length 0 (their writes stay in their first slots); then the rows a
        refilling step's pack filled join (`_join`)."""
        self.length.masked_fill_(self.idle, 0)
        if T:
            self._join(kind, T, pack)

    def _pack(self, jobs: list[tuple[int, int, list[int]]]) -> tuple[np.ndarray, list[int]]:
        """The jobs' (row, prompt index, tokens) pack (packs.fill_pack) and their ends."""
        return fill_pack([(r, ids) for r, _, ids in jobs], self.packs, self.rows)

    def _stage(self, jobs: list[tuple[int, int, list[int]]]) -> int:
        """The jobs' pack into the static input of its length and their rows into `joins`, for
        the next step to refill (refill "step"); returns the pack length."""
        pack, ends = self._pack(jobs)
        T = pack.shape[1]
        joins = np.zeros((3, self.rows), dtype=np.int64)
        for (r, _, p), end in zip(jobs, ends, strict=True):
            joins[:, r] = 1, len(p), end
        self._pack_input(T).copy_(torch.from_numpy(pack))
        self.joins.copy_(torch.from_numpy(joins))
        return T

    def _pack_input(self, T: int) -> Tensor:
        """The static pack input of length T (a blank pack when new)."""
        if T not in self.pack_in:
            self.pack_in[T] = torch.from_numpy(self._blank(T)).to(self.device)
        return self.pack_in[T]

    def _prefill(self, jobs: list[tuple[int, int, list[int]]], taps: bool) -> list[int]:
        """Refill "pack": the jobs' prompts (`_pack`) through a forward of their own between
        steps; each row's anchor (its first new token) and length set. Returns the first tokens
        (the pack's one read-back)."""
        start = clock(self.device)  # the device is idle here: after a read-back or a refill
        pack, ends = self._pack(jobs)
        T, last = pack.shape[1], np.zeros(self.rows, dtype=np.int64)
        last[: len(ends)] = ends
        # the graph first: a capture (none where decode prepared them) blanks the inputs
        graph = self._pack_graph(T, taps) if self.engine.graphs else None
        self._pack_input(T).copy_(torch.from_numpy(pack))
        self.last.copy_(torch.from_numpy(last))
        if graph is None:
            self._pack_step(self.pack_in[T], taps)
        else:
            graph.replay()
        n, long = len(jobs), {"dtype": torch.long, "device": self.device}
        rows = torch.tensor([r for r, _, _ in jobs], **long)
        self.anchor.index_copy_(0, rows, self.first[:n])
        self.length.index_copy_(0, rows, torch.tensor([len(p) for _, _, p in jobs], **long))
        firsts = self.first[:n].tolist()
        self.prefills += 1
        self.prefill_s += time.perf_counter() - start
        return firsts

    def _blank(self, T: int) -> np.ndarray:
        """A pack (4, T) of padding only: it writes the scratch row."""
        return fill_pack([], [T], self.rows)[0]

    def _pack_graph(self, T: int, taps: bool) -> torch.cuda.CUDAGraph:
        """The refill pack of length T as a CUDA graph over its static input (`_pack_input`),
        captured on a blank pack (which writes the scratch row only) where none is yet."""
        if (T, taps) not in self._packs:
            self._pool = self._pool or torch.cuda.graph_pool_handle()
            static = self._pack_input(T)
            static.copy_(torch.from_numpy(self._blank(T)))
            self.last.zero_()
            graph = capture(lambda: self._pack_step(static, taps), self.device, self._pool)
            self._packs[T, taps] = graph
        return self._packs[T, taps]

    # -- steps and graphs --------------------------------------------------------------------

    def _kind(self, method: str, lookup: Lookups) -> tuple[str, int]:
        """The step kind of `method` and its tokens per row (registered on first use); prompt
        lookup's verifies the most drafts any of its settings proposes."""
        long = {"dtype": torch.long, "device": self.device}
        if method == "target":
            kind, q, step = "greedy", 1, self._greedy_step
        elif method == "dflash":
            if self.engine.drafter is None:
                raise ValueError("this engine was built without a drafter; DFlash needs one")
            kind, q, step = "dflash", self.engine.drafter.block_size, self._dflash_step
        elif method == "prompt_lookup":
            K = max(c.num_drafts for c in _settings(lookup, 1))
            kind, q = f"lookup@{K}", K + 1
            self.drafts.setdefault(kind, torch.zeros(self.rows, K + 1, **long))
            self.plans.setdefault(kind, np.zeros((self.rows, K + 1), dtype=np.int64))
            step = lambda T=0: self._lookup_step(kind, T)  # noqa: E731
        else:
            raise ValueError(f"no batched step for method {method!r} (DDTree runs at c = 1 only)")
        if kind not in self.steps:
            self.packed[kind] = torch.zeros(self.rows, q + 1, **long)
            self.steps[kind] = step
        return kind, q

    def _lengths(self) -> list[int]:
        """The pack lengths a step may carry (0: none)."""
        return [0, *self.packs] if self.refill == "step" else [0]

    def _capture(self, kind: str) -> None:
        """The step's CUDA graphs, one per pack length it may carry, recorded before any row
        holds a prompt (the warm-up runs write the rows' first slots; a blank pack writes the
        scratch row, and no row joins)."""
        if not self.engine.graphs:
            return
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        for T in self._lengths():
            if (kind, T) in self._graphs:
                continue
            self.idle.fill_(False)
            self.joins.zero_()
            if T:
                self._pack_input(T).copy_(torch.from_numpy(self._blank(T)))
            run = functools.partial(self.steps[kind], T)
            self._graphs[kind, T] = capture(run, self.device, self._pool, self._reset)

    def _reset(self) -> None:
        self.length.zero_()
        self.anchor.zero_()

    def _run(self, kind: str, T: int = 0) -> None:
        if self.engine.graphs:
            self._graphs[kind, T].replay()
        else:
            self.steps[kind](T)

    @torch.no_grad()
    def prepare(self, method: str, lookup: Lookups = None) -> None:
        """Compile and capture `method`'s step before any timing (decode does it too)."""
        kind, _ = self._kind(method, lookup)
        self._reset()
        self.idle.fill_(False)
        self._capture(kind)
        if not self.engine.graphs:
            self._run(kind)  # compiles, where the engine compiles
        self._capture_packs(kind)

    def _capture_packs(self, kind: str) -> None:
        """Refill "pack": every pack length's refill graph for the step kind (DFlash's writes
        the drafter's context too), so that no capture falls in a timed decode."""
        if self.engine.graphs and self.refill == "pack":
            for T in self.packs:
                self._pack_graph(T, kind == "dflash")

    # -- the loop ----------------------------------------------------------------------------

    @torch.no_grad()
    def decode(
        self, method: str, prompts: Sequence[list[int]], max_new_tokens: int, stop_ids: set[int],
        lookup: Lookups = None,
    ) -> tuple[list[Decoded], float]:  # fmt: skip
        """Every prompt decoded with `method` ("target", "dflash", "prompt_lookup" with the
        `lookup` setting, or each prompt with its own: a proposer of it per row), `rows` at a
        time with refill; the responses in prompt order and the wall time of the whole
        (prefills included)."""
        kind, q = self._kind(method, lookup)
        settings = _settings(lookup, len(prompts)) if kind.startswith("lookup@") else None
        self._capture(kind)
        self._capture_packs(kind)
        slack = 0 if kind == "greedy" else q
        for p in prompts:
            self.engine._check_fit(len(p), max_new_tokens, slack)
        queue = deque(enumerate(prompts))
        busy: dict[int, _Row] = {}
        done: list[Decoded | None] = [None] * len(prompts)
        in_step = self.refill == "step"
        t0 = clock(self.device)
        self.steps_run, self.prefills, self.prefill_s, self.host_s = 0, 0, 0.0, 0.0

        def take(free: list[int]) -> list[tuple[int, int, list[int]]]:
            """The queue's next prompts for the free rows, as many as one pack holds."""
            jobs, used = [], 0
            while free and queue and used + len(queue[0][1]) <= self.packs[-1]:
                i, p = queue.popleft()
                jobs.append((free.pop(), i, list(p)))
                used += len(p)
            return jobs

        def start(jobs: list[tuple[int, int, list[int]]], firsts: list[int]) -> list[int]:
            """The jobs' rows busy with their first tokens; a prompt whose first token ends it
            is done at once. Returns the rows free again."""
            again = []
            for (r, i, p), first in zip(jobs, firsts, strict=True):
                row = _Row(i, p, [first])
                if settings is not None:
                    row.proposer = PromptLookupProposer(**asdict(settings[i]))
                    row.proposer.start(p, None)
                if first in stop_ids or max_new_tokens <= 1:
                    done[i] = _decoded(row, max_new_tokens, stop_ids)
                    again.append(r)
                else:
                    busy[r] = row
            return again

        def rest(free: list[int]) -> None:
            """The free rows idle on the device until a prompt joins them."""
            if free:
                idle = torch.tensor(free, dtype=torch.long, device=self.device)
                self.idle.index_fill_(0, idle, True)
                self.length.index_fill_(0, idle, 0)

        def admit(free: list[int]) -> None:
            """Refill "pack": the queue's next prompts into the free rows, a pack forward at a
            time. Rows the queue cannot fill idle (the queue is empty then)."""
            while free and queue:
                jobs = take(free)
                free += start(jobs, self._prefill(jobs, kind == "dflash"))
            rest(free)

        free = list(range(self.rows))[::-1]
        self.idle.fill_(False)
        if in_step:
            rest(free)
        else:
            admit(free)
        mark, refills = time.perf_counter(), self.prefill_s
        while busy or (in_step and queue and free):
            jobs = take(free) if in_step else []
            T = self._stage(jobs) if jobs else 0
            self.steps_run += 1
            self.prefills += bool(jobs)
            if kind.startswith("lookup@"):
                self._plan_lookups(kind, busy)
            self.host_s += time.perf_counter() - mark - (self.prefill_s - refills)
            self._run(kind, T)
            packed = self.packed[kind].tolist()  # the step's one read-back
            mark, refills = time.perf_counter(), self.prefill_s
            freed = []
            for r in list(busy):
                row = busy[r]
                count, *greedy = packed[r]
                new = greedy[:count]
                row.take(new)
                if kind != "greedy":  # per verify step, as the c = 1 engine counts
                    row.accepted.append(len(new))
                    row.drafted.append(q - 1 if kind == "dflash" else int(self.plans[kind][r, 0]))
                if len(row.out) >= max_new_tokens or any(t in stop_ids for t in new):
                    done[row.index] = _decoded(row, max_new_tokens, stop_ids)
                    del busy[r]
                    freed.append(r)
            freed += start(jobs, [packed[r][1] for r, _, _ in jobs])
            if in_step:
                rest(freed)
                free += freed
            elif freed:
                admit(freed)
        wall = clock(self.device) - t0
        return [d for d in done if d is not None], wall

    def _plan_lookups(self, kind: str, busy: dict[int, _Row]) -> None:
        """Each busy row's host drafts (padded to K, with their count) into the step's input."""
        plan = self.plans[kind]
        K = plan.shape[1] - 1
        plan.fill(0)
        for r, row in busy.items():
            drafts = row.proposer.propose(row.tokens)[:K]
            plan[r, 0] = n = len(drafts)
            plan[r, 1 : 1 + n] = drafts
        self.drafts[kind].copy_(torch.from_numpy(plan))  # one host-to-device copy a step


def _settings(lookup: Lookups, prompts: int) -> list[LookupConfig]:
    """Prompt lookup's setting per prompt (a single one for all; refused: none, or a list of
    another length)."""
    if lookup is None:
        raise ValueError("prompt lookup needs its setting: pass lookup=LookupConfig(...)")
    if isinstance(lookup, LookupConfig):
        return [lookup] * prompts
    if prompts > 1 and len(lookup) != prompts:
        raise ValueError(f"{len(lookup)} prompt lookup settings for {prompts} prompts")
    return list(lookup)


def _decoded(row: _Row, max_new_tokens: int, stop_ids: set[int]) -> Decoded:
    out, reason = finish(row.out, max_new_tokens, stop_ids)
    return Decoded(out, reason, 0.0, 0.0, row.accepted, row.drafted)
