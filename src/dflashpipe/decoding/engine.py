"""Batch-1 greedy decoding as a serving engine runs it: static caches, fixed-shape steps, graphs.

    prefill (eager, P tokens)   StaticTarget.forward(prompt at slots 0..P-1) -> x_P, taps (P, n*H)
                                StaticDrafter.append(taps, 0)    context K/V of rows 0..P-1
    device state                T = committed length (target KV and drafter context rows 0..T-1)
                                anchor = the last accepted token (not cached yet)
    greedy step                 target([anchor] at slot T) -> g;  T += 1;  anchor = g
                                read back: g
    dflash step   (one kind)
                  draft         block [anchor, MASK x B-1] at T..T+B-1, keys = context [0, T)
                                + the block itself -> d_1..d_{B-1}            (stays on device)
                  verify        target([anchor, d]) at slots T..T+B-1 -> g_0..g_{B-1}, taps
                                drafter.append(taps, T): all B rows, only the accepted stay valid
                                n = matched prefix of d vs g;  T += n+1;  anchor = g_n
                                read back: [n+1, g_0..g_{B-1}]                 (one int tensor)
    ddtree step   (ddtree.py, a registered step family)
                                draft top-k -> the tree of `budget` nodes (fixed shape) ->
                                verify [anchor + nodes] in one forward -> walk -> commit the
                                matched path's K/V rows, all on the device
                                read back: [L+1, accepted tokens]              (one int tensor)

Fixed shapes: every step writes its rows at slots T..T+B-1 whatever is accepted and advances T
on the device by the accepted count; rows past T are masked and overwritten by the next step, so
nothing is trimmed and no host value enters a step (prompt lookup's host drafts are the
exception: they are copied in). On CUDA each step kind is captured once as a
CUDA graph over static buffers and replayed; the host reads back one small tensor per step (the
decision to stop needs it). On the CPU the same step functions run directly.

Plug-ins (ddtree.py) register a step family (`Engine.register_steps`); the engine imports none.

Outputs equal `eager.greedy_decode` / `eager.speculative_decode(..., DFlashProposer)` up to
rounding (tests check it token for token in float32); the models are static_models.py's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from dflashpipe.decoding.families import check_target
from dflashpipe.decoding.layers import accept_chain
from dflashpipe.decoding.static_models import (
    StaticDrafter,
    StaticTarget,
    capture,
    compiled,
    step_modes,
)
from dflashpipe.decoding.types import Decoded, Proposer, clock, finish
from dflashpipe.model import Drafter

# Step shapes per compiled layer function: target 1 (greedy), B (verify), budget+1 per DDTree
# budget; dynamo's default (8) would fall back to eager from the ninth.
RECOMPILE_LIMIT = 32


class Engine:
    """Greedy decoding of one sequence at a time: target-only (`greedy`), with a DFlash
    drafter (`dflash`) or with DDTree draft trees (`ddtree`), each step one fixed-shape function over the static state below, replayed
    as a CUDA graph when `graphs` (default: on for CUDA). max_len bounds prompt + new tokens +
    one block of slack; build one engine per (target, drafter, max_len) and reuse it. The
    models' q/k/v and gate/up weights become views of fused ones (families.fuse_layer): save
    them before, and build a new engine after a `.float()` or `.to()`. Step families of
    plug-ins (DDTree) join through `register_steps` (module docstring)."""

    # name -> make(engine): the plug-in step families every engine can use (register_steps)
    _registry: ClassVar[dict[str, Callable[[Engine], Any]]] = {}

    @classmethod
    def register_steps(cls, name: str, make: Callable[[Engine], Any]) -> None:
        """Register a plug-in's family of step kinds under `name` (ddtree.py registers "ddtree"
        when imported). `make(engine)` builds the family's step functions and buffers for one
        engine, on its first use (`family`); the family adds its step kinds with `add_step`."""
        known = cls._registry.get(name)
        if known is not None and known is not make:
            raise ValueError(f"step family {name!r} is registered already, by {known!r}")
        cls._registry[name] = make

    def family(self, name: str) -> Any:
        """This engine's instance of the step family registered under `name`, made on first use."""
        if name not in self._families:
            make = self._registry.get(name)
            if make is None:
                raise ValueError(
                    f"no step family {name!r} is registered with the engine (registered: "
                    f"{sorted(self._registry)}); import the module that registers it, e.g. "
                    "dflashpipe.decoding.ddtree for 'ddtree'"
                )
            self._families[name] = make(self)
        return self._families[name]

    def __init__(
        self,
        model: nn.Module,
        max_len: int,
        drafter: Drafter | None = None,
        graphs: bool | None = None,
        compile: bool | None = None,
    ):
        check_target(model)  # before anything of the model changes
        self.graphs, self.compiled = step_modes(model, graphs, compile)
        if self.compiled:  # one graph per step shape of each layer function (module docstring)
            torch._dynamo.config.recompile_limit = max(
                torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT
            )
        layer_ids = list(drafter.config.target_layer_ids) if drafter is not None else []
        self.target = StaticTarget(model, max_len, layer_ids, self.compiled)
        self.drafter = (
            StaticDrafter(drafter, max_len, self.compiled) if drafter is not None else None
        )
        if drafter is not None:
            _check_pair(model, drafter)
        self.device, self.max_len = self.target.device, max_len
        B = self.drafter.block_size if self.drafter is not None else 1
        long = {"dtype": torch.long, "device": self.device}
        # The static state every step reads and updates in place (graph inputs and outputs).
        self.length = torch.zeros(1, **long)  # T: committed slots of the target and the drafter
        self.anchor = torch.zeros(1, **long)  # the last accepted token, not cached yet
        self.greedy_packed = torch.zeros(2, **long)  # greedy: [1, g], the read-back
        self.token = self.greedy_packed[1:]  # greedy: the step's token
        self.no_drafts = torch.zeros(0, **long)  # greedy: a chain of no drafts
        self.packed = torch.zeros(B + 1, **long)  # dflash: [n+1, g_0..g_{B-1}], the read-back
        self.offsets = torch.arange(B, **long)
        self.accept = compiled(accept_chain, self.compiled)
        self.steps: dict[str, Callable[[], None]] = {
            "greedy": self._greedy_step,
            "dflash": self._dflash_step,
        }
        self.captures: Counter[str] = Counter()  # graph captures per step kind (once each)
        self._graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._families: dict[str, Any] = {}  # registered step families, made on first use
        self.lookup_drafts: dict[int, torch.Tensor] = {}  # prompt lookup, per K: (K+1,)
        self.lookup_packed: dict[int, torch.Tensor] = {}  # its read-back (K+2,)

    def _greedy_step(self) -> None:
        T = self.length  # (1,): position = slot = T
        logits, _ = self.target.forward(self.anchor, T, T, T)  # (1, V)
        self.accept(logits[None], self.no_drafts[None], None, self.anchor, self.greedy_packed[None],
                    self.length)  # fmt: skip

    def _dflash_step(self) -> None:
        """Draft a block, verify it: one step kind, so one graph replay per step."""
        T = self.length
        drafts = self.drafter.propose(self.anchor, T)  # (B-1,)
        slots = T + self.offsets  # (B,): positions too
        ids = torch.cat([self.anchor, drafts])  # (B,)
        logits, states = self.target.forward(ids, slots, slots, T, taps=True)  # (B, V)
        # Every row goes into the drafter's context; T advanced by n+1 keeps only the accepted.
        self.drafter.append(states, T)
        self.accept(logits[None], drafts[None], None, self.anchor, self.packed[None], self.length)

    def add_step(self, kind: str, step: Callable[[], None]) -> None:
        """A new step kind: one fixed-shape function over the static state (graph inputs and
        outputs), captured once by `capture` when the engine uses graphs."""
        if kind in self.steps:
            raise ValueError(f"step kind {kind!r} is registered already")
        self.steps[kind] = step

    def run(self, kind: str) -> None:
        """One step of `kind`: its graph replayed, or (no graphs) its function called."""
        if self.graphs:
            self._graphs[kind].replay()
        else:
            self.steps[kind]()

    def _reset(self) -> None:
        self.length.zero_()
        self.anchor.zero_()

    def capture(self, kinds: Sequence[str]) -> None:
        """Capture each step kind once per engine, before any timing. Warm-up runs and capture
        start from T = 0: their cache writes land in slots the next prefill overwrites."""
        if not self.graphs:
            return
        for kind in kinds:
            if kind not in self._graphs:
                self._pool = self._pool or torch.cuda.graph_pool_handle()
                self._graphs[kind] = capture(self.steps[kind], self.device, self._pool, self._reset)
                self.captures[kind] += 1

    def _check_fit(
        self, prompt_length: int, max_new_tokens: int, slack: int, what: str = "block_size"
    ) -> None:
        if prompt_length < 1 or max_new_tokens < 1:
            raise ValueError(
                f"prompt length {prompt_length} and max_new_tokens {max_new_tokens} must be >= 1"
            )
        need = prompt_length + max_new_tokens + slack
        if need > self.max_len:
            block = f" + {what} {slack}" if slack else ""
            raise ValueError(
                f"prompt length {prompt_length} + max_new_tokens {max_new_tokens}{block} = {need} "
                f"does not fit the engine's max_len {self.max_len}"
            )

    def _prefill(self, prompt_ids: list[int], taps: bool) -> int:
        """The prompt in one eager forward at slots 0..P-1; returns the first new token."""
        P = len(prompt_ids)
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)  # (P,)
        slots = torch.arange(P, device=self.device)  # (P,)
        logits, states = self.target.forward(
            ids, slots, slots, torch.zeros_like(self.length), taps=taps, last_only=True, eager=True
        )
        if states is not None:
            self.drafter.append(states, 0, eager=True)
        first = logits[-1].argmax()
        self.anchor.copy_(first.view(1))
        self.length.fill_(P)
        return int(first)

    @torch.no_grad()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> Decoded:
        """Target-only greedy decoding, one token per step (as `eager.greedy_decode`)."""
        self._check_fit(len(prompt_ids), max_new_tokens, 0)
        self.capture(["greedy"])
        t0 = clock(self.device)
        out = [self._prefill(prompt_ids, taps=False)]
        t1 = clock(self.device)
        while len(out) < max_new_tokens and out[-1] not in stop_ids:
            self.run("greedy")
            out.append(int(self.token))  # the step's one read-back
        t2 = clock(self.device)
        out, reason = finish(out, max_new_tokens, stop_ids)
        return Decoded(out, reason, t1 - t0, t2 - t1)

    @torch.no_grad()
    def speculate(
        self, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int], taps: bool,
        step: Callable[[list[int]], tuple[list[int], int]],
    ) -> Decoded:  # fmt: skip
        """The loop every speculative method shares: an eager prefill, then `step(tokens so
        far)` -> (accepted tokens + bonus, drafts proposed) until max_new_tokens or a stop id.
        Callers check the fit and capture their step kinds first."""
        t0 = clock(self.device)
        out = [self._prefill(prompt_ids, taps)]
        t1 = clock(self.device)
        accepted_lengths, drafted = [], []
        stopped = out[0] in stop_ids
        while len(out) < max_new_tokens and not stopped:
            new, proposed = step(out)
            out += new
            stopped = any(t in stop_ids for t in new)
            accepted_lengths.append(len(new))
            drafted.append(proposed)
        t2 = clock(self.device)
        out, reason = finish(out, max_new_tokens, stop_ids)
        return Decoded(out, reason, t1 - t0, t2 - t1, accepted_lengths, drafted)

    @torch.no_grad()
    def dflash(self, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> Decoded:
        """DFlash speculative decoding (as `speculative_decode` with a `DFlashProposer`)."""
        if self.drafter is None:
            raise ValueError("this Engine was built without a drafter; pass drafter= to decode")
        B = self.drafter.block_size
        self._check_fit(len(prompt_ids), max_new_tokens, B)
        self.capture(["dflash"])

        def step(_: list[int]) -> tuple[list[int], int]:
            self.run("dflash")
            count, *greedy = self.packed.tolist()  # the step's one read-back
            return greedy[:count], B - 1  # accepted drafts (= the target's tokens), the bonus

        return self.speculate(prompt_ids, max_new_tokens, stop_ids, True, step)

    @torch.no_grad()
    def lookup(
        self, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int],
        proposer: Proposer,
    ) -> Decoded:  # fmt: skip
        """Prompt lookup (as `speculative_decode` with the proposer): the host proposes up to
        K = proposer.num_drafts tokens, padded to K; one fixed-shape verify of K+1 accepts at
        most the real ones. A step with no proposal is a target-only step."""
        K = proposer.num_drafts
        self._check_fit(len(prompt_ids), max_new_tokens, K + 1, "anchor + num_drafts")
        kind = self._lookup_kind(K)
        self.capture(["greedy", kind])
        proposer.start(list(prompt_ids), None)
        tokens = list(prompt_ids)

        def step(out: list[int]) -> tuple[list[int], int]:
            tokens.extend(out[len(tokens) - len(prompt_ids) :])
            drafts = proposer.propose(tokens)[:K]
            if not drafts:
                self.run("greedy")
                return [int(self.token)], 0
            self.lookup_drafts[K].copy_(
                torch.tensor([len(drafts)] + drafts + [0] * (K - len(drafts)))
            )
            self.run(kind)
            count, *greedy = self.lookup_packed[K].tolist()  # the step's one read-back
            return greedy[:count], len(drafts)

        return self.speculate(prompt_ids, max_new_tokens, stop_ids, False, step)

    def _lookup_kind(self, K: int) -> str:
        """The verify step of K host drafts, registered with its buffers on first use."""
        kind = f"lookup@{K}"
        if kind not in self.steps:
            long = {"dtype": torch.long, "device": self.device}
            self.lookup_drafts[K] = torch.zeros(K + 1, **long)  # [count, d_1..d_K (padded)]
            self.lookup_packed[K] = torch.zeros(K + 2, **long)  # [n+1, g_0..g_K]
            self.add_step(kind, lambda: self._lookup_step(K))
        return kind

    def _lookup_step(self, K: int) -> None:
        T, plan = self.length, self.lookup_drafts[K]
        count, drafts = plan[:1], plan[1:]  # (1,), (K,)
        slots = T + torch.arange(K + 1, device=self.device)  # (K+1,): positions too
        logits, _ = self.target.forward(torch.cat([self.anchor, drafts]), slots, slots, T)
        packed = self.lookup_packed[K][None]  # one row
        self.accept(logits[None], drafts[None], count, self.anchor, packed, self.length)

    @torch.no_grad()
    def ddtree(
        self, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int], budget: int,
        top_k: int,
    ) -> Decoded:  # fmt: skip
        """DDTree speculative decoding: per step a best-first tree of `budget` nodes from the
        drafter's top_k candidates per slot, verified in one target forward. The "ddtree" step
        family does it (ddtree.py registers it; import that module first)."""
        return self.family("ddtree").decode(prompt_ids, max_new_tokens, stop_ids, budget, top_k)


def _check_pair(model: nn.Module, drafter: Drafter) -> None:
    """The drafter's fc must take this target's tapped states."""
    hidden = model.config.get_text_config().hidden_size
    n_taps = len(drafter.config.target_layer_ids)
    if drafter.fc.in_features != n_taps * hidden:
        raise ValueError(
            f"drafter fc takes {drafter.fc.in_features} features, but {n_taps} taps of the "
            f"target's hidden size {hidden} give {n_taps * hidden}"
        )
