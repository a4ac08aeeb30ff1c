"""decoding/concurrent.py: c rows side by side on the c = 1 engine's models. Every family's
rows-equal-one-at-a-time exactness lives in the family matrix (test_families.py); here the
engine's own rules: refusals before anything is allocated, per-prompt lookup settings, idle
rows, and the compiled and graphed steps against the eager ones."""

import copy

import pytest
import torch
from test_engine import (
    LOOKUP_PROMPTS,
    MAX_LEN,
    NEW,
    PROMPTS,
    make_drafter,
    runs_drafter,
    runs_llama,
)

from dflashpipe.decoding.concurrent import ConcurrentEngine, check_rows, rows_bytes
from dflashpipe.decoding.engine import Engine
from dflashpipe.decoding.lookup import LookupConfig, PromptLookupProposer
from dflashpipe.decoding.memory import MEMORY_SHARE, free_memory


@pytest.fixture(scope="module")
def llama():
    return runs_llama()  # the engine tests' Llama and drafter: DFlash gets runs accepted


@pytest.fixture(scope="module")
def drafter(llama):
    return runs_drafter(llama)


def test_rows_below_one_or_past_the_memory_are_refused_before_allocating(llama, drafter):
    """A concurrency below 1, or one whose K/V buffers pass MEMORY_SHARE of the free memory,
    is refused naming evaluate.concurrency; the byte count is the engine's buffers per row plus
    the refills' scratch row."""
    engine = Engine(llama, MAX_LEN, drafter)
    with pytest.raises(ValueError, match="evaluate.concurrency: 0 is below 1"):
        ConcurrentEngine(engine, 0)
    per_row = engine.target.kv.nbytes + engine.drafter.kv.nbytes
    assert rows_bytes(engine, 3) == 4 * per_row
    too_many = int(MEMORY_SHARE * free_memory(engine.device)) // per_row + 1
    with pytest.raises(ValueError, match=rf"evaluate.concurrency: {too_many} rows need .* GiB"):
        check_rows(engine, too_many)
    check_rows(engine, 2)  # fits


def test_methods_and_settings_it_cannot_run_are_refused(llama, drafter):
    target_only = ConcurrentEngine(Engine(llama, MAX_LEN), 2)
    with pytest.raises(ValueError, match="without a drafter; DFlash needs one"):
        target_only.decode("dflash", PROMPTS, NEW, set())
    rows = ConcurrentEngine(Engine(llama, MAX_LEN, drafter), 2)
    with pytest.raises(ValueError, match="DDTree runs at c = 1 only"):
        rows.decode("ddtree", PROMPTS, NEW, set())
    with pytest.raises(ValueError, match="needs its setting"):
        rows.decode("prompt_lookup", PROMPTS, NEW, set())
    with pytest.raises(ValueError, match="2 prompt lookup settings for 3 prompts"):
        rows.decode("prompt_lookup", PROMPTS, NEW, set(), [LookupConfig()] * 2)


def test_each_prompt_takes_its_own_lookup_setting(llama):
    """Prompt lookup with a setting per prompt (evaluate: each source's best), 2 rows for 3
    prompts: each prompt's tokens, acceptances and drafted counts are the c = 1 engine's with
    that prompt's proposer; the step verifies the most drafts any setting proposes."""
    engine = Engine(llama, MAX_LEN)
    settings = [LookupConfig(num_drafts=2, max_ngram_size=1), LookupConfig(num_drafts=5),
                LookupConfig(num_drafts=3, max_ngram_size=3)]  # fmt: skip
    want = [engine.lookup(ids, NEW, set(), PromptLookupProposer(s.num_drafts, s.max_ngram_size))
            for ids, s in zip(LOOKUP_PROMPTS, settings, strict=True)]  # fmt: skip
    rows = ConcurrentEngine(engine, 2)
    got, _ = rows.decode("prompt_lookup", LOOKUP_PROMPTS, NEW, set(), settings)
    assert [d.output_ids for d in got] == [d.output_ids for d in want]
    assert [d.accepted_lengths for d in got] == [d.accepted_lengths for d in want]
    assert [d.drafted for d in got] == [d.drafted for d in want]
    assert max(n for d in got for n in d.accepted_lengths) > 1  # drafts were accepted
    assert "lookup@5" in rows.steps


def test_compiled_concurrent_steps_decode_as_the_eager_ones_in_one_graph_per_step(llama, drafter):
    """evaluate.concurrency's steps compiled (as on a GPU): every level decodes the tokens and
    acceptances of the uncompiled engine, and the row counts above 2 reuse the graphs compiled
    for 2 (dynamic rows), so a level costs no compile of its own."""
    from torch._dynamo.utils import counters

    eager, compiled = Engine(llama, MAX_LEN, drafter), Engine(llama, MAX_LEN, drafter, compile=True)
    graphs = {}
    for rows in (1, 2, 3):
        before = counters["stats"]["unique_graphs"]
        _concurrent_rows_match(eager, compiled, rows)
        graphs[rows] = counters["stats"]["unique_graphs"] - before
    assert graphs[1] > 0 and graphs[2] > 0 and graphs[3] == 0, graphs


def _concurrent_rows_match(eager: Engine, other: Engine, rows: int, refill: str = "step") -> None:
    """target-only and DFlash `rows` at a time on `other`'s steps give `eager`'s tokens and
    acceptances (`refill` on `other`; the eager rows refill in their steps)."""
    from dflashpipe.decoding.concurrent import ConcurrentEngine

    for method in ("target", "dflash"):
        want, got = (ConcurrentEngine(e, rows, refill=r).decode(method, PROMPTS, NEW, set())[0]
                     for e, r in ((eager, "step"), (other, refill)))  # fmt: skip
        assert [d.output_ids for d in got] == [d.output_ids for d in want], (rows, method)
        assert [d.accepted_lengths for d in got] == [d.accepted_lengths for d in want]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphed_concurrent_rows_decode_as_the_eager_ones(llama, drafter):
    """evaluate.concurrency as a GPU runs it: steps and refill packs compiled (the packs' T x T
    attention on SDPA's kernel) and captured, a graph per pack length (and step kind, where the
    steps carry the refills), decode the eager rows' tokens and acceptances (float32) at one row
    and at three (refills packed together), with either refill."""
    model = copy.deepcopy(llama).cuda()
    d = make_drafter(model)
    d.load_state_dict(drafter.state_dict())
    d = d.cuda()
    eager, graphed = Engine(model, MAX_LEN, d, graphs=False), Engine(model, MAX_LEN, d)
    assert graphed.graphs and graphed.compiled and not eager.compiled
    for rows in (1, 3):
        for refill in ("step", "pack"):
            _concurrent_rows_match(eager, graphed, rows, refill)
