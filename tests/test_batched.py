"""Batched, continuous generation (decoding/batched.py) and regenerate on it: greedy answers equal
transformers' generate() token for token (CPU, float32) on the tiny target and on SmolLM2,
sampled answers do not depend on the run, the row count or a resume, and bad inputs are refused
before anything is decoded."""

import json
import shutil

import pyarrow.parquet as pq
import pytest
import torch
from conftest import SMOLLM2_GGUF

from dflashpipe.chat import encode_prompt, end_of_turn_ids
from dflashpipe.config import Config, TargetConfig
from dflashpipe.decoding.batched import BatchedEngine, Request
from dflashpipe.decoding.hf_generate import generate_batch, generation_config
from dflashpipe.decoding.memory import cache_bytes, generate_rows, prefill_bytes, step_bytes
from dflashpipe.decoding.sampling import Sampling
from dflashpipe.errors import ConfigError
from dflashpipe.prompts import Prompt, prompt_key, write_prompts
from dflashpipe.regenerate import PartStore, RegeneratePaths, run
from dflashpipe.target import load_target

ASK = ["What is 2+2?", "Say hi.", "Name a color.", "What is the capital of France?",
       "Is fire hot? Yes or no.", "Name one fruit.", "Give me a word that rhymes with cat.",
       "What is 3 times 3?"]  # fmt: skip
SAMPLING = Sampling(temperature=1.0, top_p=0.9, top_k=40)


def questions(n: int) -> list[str]:
    """n short questions padded to mixed lengths (about 40-90 tokens with the template)."""
    return [ASK[i % 8] + " Reply in one word." + " Be brief." * (i * 5 % 17) for i in range(n)]


def chat_prompts(tok, n: int) -> list[list[int]]:
    return [encode_prompt(tok, [{"role": "user", "content": q}]) for q in questions(n)]


def reference(model, tok, prompts, max_new: int, stops: set[int]) -> list[tuple]:
    """Today's path: generate() on left-padded batches of 12 (float32 on the CPU)."""
    from dflashpipe.config import RegenerateConfig

    gen = RegenerateConfig(max_new_tokens=max_new, cache="dynamic")
    cfg = generation_config(gen, stops, tok.pad_token_id or 0, model.device, False)
    return [a for i in range(0, len(prompts), 12)
            for a in generate_batch(model, prompts[i : i + 12], cfg, stops, 12)]  # fmt: skip


def decode(engine, prompts, max_new, stops, seeds=None, sampling=None) -> list[tuple]:
    seeds = seeds or [None] * len(prompts)
    requests = [Request(f"p{i}", p, s) for i, (p, s) in enumerate(zip(prompts, seeds, strict=True))]
    answers = {a.index: (a.tokens, a.finish) for a in engine.generate(requests, max_new, stops,
                                                                      sampling)}  # fmt: skip
    return [answers[i] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    return load_target(TargetConfig(model=str(tiny_target_dir)), torch.device("cpu"))


@pytest.fixture(scope="module")
def varied(tiny_target_dir):
    """The tiny target with its matrices redrawn at std 0.3: as saved it answers newline after
    newline, which would not tell a wrong row or position from a right one."""
    model, tok = load_target(TargetConfig(model=str(tiny_target_dir)), torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3, generator=g)
    return model, tok


def test_greedy_equals_generate_on_the_tiny_target(varied):
    """36 prompts through 5 row slots; stop tokens the target does emit, so rows finish at
    different steps and are refilled at once (no row decodes past its answer's end)."""
    model, tok = varied
    prompts = chat_prompts(tok, 36)
    first = reference(model, tok, prompts, 12, end_of_turn_ids(tok))
    stops = end_of_turn_ids(tok) | {new[2 + i % 9] for i, (new, _) in enumerate(first[::3])}
    expected = reference(model, tok, prompts, 12, stops)
    assert 8 <= sum(f == "stop" for _, f in expected) <= 28
    engine = BatchedEngine(model, rows=5, capacity=max(map(len, prompts)) + 12)
    assert decode(engine, prompts, 12, stops) == expected
    # continuous: a row's answer and one idle step (the refill waits on the read-back), then
    # the next; only the tail runs with free rows. Batches of 5 decode to their longest answer.
    lengths = [len(new) for new, _ in expected]
    padded = sum(max(lengths[i : i + 5]) for i in range(0, 36, 5))
    assert engine.stats["steps"] <= (sum(lengths) + 36) / 5 + 12 + 1 < padded
    assert engine.stats["prefills"] < 36  # refills prefilled together
    assert engine.stats["prompt_tokens"] == sum(len(p) - 1 for p in prompts)


def test_gathered_refills_and_packs_change_no_answer(varied):
    """Refills that wait for 4 of 6 free rows, in packs of 1-6 prompts or one prompt each: the
    same answers as refilling at once; fewer prefills, each fuller, for a few more steps."""
    model, tok = varied
    prompts = chat_prompts(tok, 30)
    capacity = max(map(len, prompts)) + 10
    at_once = BatchedEngine(model, rows=6, capacity=capacity, refill_rows=1, pack_tokens=128)
    first = decode(at_once, prompts, 10, end_of_turn_ids(tok))  # stops it emits: ragged ends
    stops = end_of_turn_ids(tok) | {new[1 + i % 8] for i, (new, _) in enumerate(first[::4])}
    at_once.stats.clear()
    expected = decode(at_once, prompts, 10, stops)
    assert len({len(new) for new, _ in expected}) >= 5
    gathered = BatchedEngine(model, rows=6, capacity=capacity, refill_rows=4, pack_tokens=512)
    assert gathered.packs == [128, 512]  # 512 over powers of 4, >= the capacity's 128
    assert decode(gathered, prompts, 10, stops) == expected
    a, g = at_once.stats, gathered.stats
    assert a["prompt_tokens"] == g["prompt_tokens"] == sum(len(p) - 1 for p in prompts)
    assert g["prefills"] <= a["prefills"] / 2
    assert g["prompt_tokens"] / g["prefill_tokens"] > a["prompt_tokens"] / a["prefill_tokens"]
    assert a["steps"] < g["steps"] <= a["steps"] * 1.5
    with pytest.raises(ValueError, match=r"refill_rows is 7: expected 1\.\.6"):
        BatchedEngine(model, rows=6, capacity=capacity, refill_rows=7)


def test_a_step_attends_over_the_shortest_span_that_holds_its_busy_rows(varied):
    """Longest prompts first (regenerate's plan) in a cache with room to spare: later steps
    attend over a quarter or half of each row's slots, and the answers are still generate()'s."""
    model, tok = varied
    prompts = sorted(chat_prompts(tok, 20), key=len, reverse=True)
    stops = end_of_turn_ids(tok)
    engine = BatchedEngine(model, rows=4, capacity=max(map(len, prompts)) + 10 + 96)
    assert engine.spans == [64, 112, 160, 208]  # the capacity's quarters, aligned to 16
    assert decode(engine, prompts, 10, stops) == reference(model, tok, prompts, 10, stops)
    assert engine.stats["span_slots"] <= 0.6 * engine.stats["steps"] * engine.capacity
    figures = engine.figures()  # what regenerate logs with each part
    assert figures["steps"] == engine.stats["steps"] and figures["cache_read"] <= 0.6


def test_the_compiled_step_decodes_as_the_eager_one_and_writes_the_cache_in_place(varied):
    """The step's functions compiled (as on a GPU, where graphs capture them), dense and flex:
    the same greedy answers, and Inductor's code writes each step's K/V into the cache itself. A write it could
    not keep in place (a scatter_ into the cache view did this) allocates a buffer of the
    cache's shape and copies all of it, twice per layer and step (H200: 70% of the step)."""
    from torch._inductor.utils import run_and_get_code

    model, _ = varied
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (20, 7, 5, 6, 4, 7)]
    eager = BatchedEngine(model, rows=3, capacity=32)
    compiled = BatchedEngine(model, rows=3, capacity=32, compile=True)
    assert compiled.compiled and not compiled.graphs and compiled.spans == [16, 32]
    want = decode(eager, prompts, 8, {0})
    got, code = run_and_get_code(lambda: decode(compiled, prompts, 8, {0}))
    assert got == want
    steps, slots = compiled.stats["steps"], compiled.stats["span_slots"]
    assert 16 * steps < slots < 32 * steps  # both spans ran: the short one is a strided view
    rows, kv_heads, _, head_dim = compiled.k[0].shape
    for span in compiled.spans:  # (rows, kv_heads, span, head_dim): the cache view a step reads
        assert code and not any(f"empty_strided_cpu({(3, kv_heads, span, head_dim)}" in c
                                for c in code)  # fmt: skip
    # attention "flex" compiles whole (its block mask built inside the compiled layer) as well
    flex = BatchedEngine(model, rows=3, capacity=32, compile=True, attention="flex")
    assert decode(flex, prompts, 8, {0}) == want


def test_sampled_answers_do_not_depend_on_rows_runs_or_resume(varied):
    model, tok = varied
    prompts, stops = chat_prompts(tok, 14), end_of_turn_ids(tok)
    seeds = [1000 + i if i % 3 else None for i in range(14)]  # greedy ones mixed in
    capacity = max(map(len, prompts)) + 10
    three = BatchedEngine(model, rows=3, capacity=capacity)
    a = decode(three, prompts, 10, stops, seeds, SAMPLING)
    assert decode(three, prompts, 10, stops, seeds, SAMPLING) == a  # the same engine, again
    assert decode(BatchedEngine(model, rows=8, capacity=capacity + 32), prompts, 10, stops, seeds,
                  SAMPLING) == a  # fmt: skip
    # a run stopped after 5 answers, the rest decoded by a fresh engine in another order
    requests = [Request(f"p{i}", p, s) for i, (p, s) in enumerate(zip(prompts, seeds, strict=True))]
    it = BatchedEngine(model, rows=4, capacity=capacity).generate(requests, 10, stops, SAMPLING)
    got = {x.index: (x.tokens, x.finish) for x, _ in zip(it, range(5), strict=False)}
    rest = [i for i in range(14) if i not in got][::-1]
    again = decode(three, [prompts[i] for i in rest], 10, stops, [seeds[i] for i in rest], SAMPLING)
    got.update(zip(rest, again, strict=True))
    assert [got[i] for i in range(14)] == a
    greedy = decode(three, prompts, 10, stops)
    assert all(a[i] == greedy[i] for i in range(14) if seeds[i] is None)
    assert sum(a[i] != greedy[i] for i in range(14) if seeds[i] is not None) >= 5


@pytest.fixture(scope="module")
def smollm2(smollm2_dir, smollm2_cache):
    from conftest import cache_dir

    with cache_dir(smollm2_cache):  # the run's conversion of the GGUF
        cfg = TargetConfig(model=str(smollm2_dir), gguf_file=SMOLLM2_GGUF)
        return load_target(cfg, torch.device("cpu"))


def test_greedy_equals_generate_on_smollm2(smollm2):
    """The real target (float32) answers 12 prompts of 39-89 tokens in 4 row slots."""
    model, tok = smollm2
    prompts, stops = chat_prompts(tok, 12), end_of_turn_ids(tok)
    expected = reference(model, tok, prompts, 12, stops)
    assert sum(f == "stop" for _, f in expected) >= 4  # real answers end at different steps
    engine = BatchedEngine(model, rows=4, capacity=max(map(len, prompts)) + 12)
    assert decode(engine, prompts, 12, stops) == expected


# ------------------------------------------------------------------------------ regenerate
def write_questions(path, n: int):
    rows = []
    for i, q in enumerate(questions(n)):
        msgs = [{"role": "user", "content": q}]
        rows.append(Prompt(prompt_key(msgs), "t", str(i), 0, msgs, None, f"f:{i}"))
    write_prompts(path, rows)
    return path


def config(target, **regen) -> Config:
    raw = {
        "target": {"model": str(target)},
        "prompts": {"sources": [{"name": "x", "kind": "jsonl", "path": "unused.jsonl"}]},
        "regenerate": {"shards": 1, "batch_size": 3, "max_new_tokens": 8, "save_every": 4,
                       **regen},
        "extract": {"max_length": 512},
    }  # fmt: skip
    return Config.from_dict(raw)


def rows(path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def test_regenerate_on_the_engine_resumes_to_the_same_answers(tiny_target_dir, tmp_path):
    """Sampled answers (2 per prompt, the first greedy): an uninterrupted run, runs stopped after
    each part and resumed, and another row count give the same rows; the engine is recorded,
    and its greedy answers are generate()'s."""
    prompts = write_questions(tmp_path / "p.parquet", 10)
    sampled = {"samples_per_prompt": 2, "temperature": 1.0, "top_p": 0.9, "top_k": 40, "seed": 7}
    whole = tmp_path / "whole.parquet"
    assert run(config(tiny_target_dir, **sampled), RegeneratePaths(str(prompts), 0, str(whole)))
    meta = pq.read_table(whole).schema.metadata
    assert meta[b"engine"] == b"static" and b"auto" in meta[b"engine_reason"]
    resumed = tmp_path / "resumed.parquet"
    cfg = config(tiny_target_dir, **sampled, batch_size=5)
    assert not run(cfg, RegeneratePaths(str(prompts), 0, str(resumed)), max_batches=1)
    assert len(PartStore(resumed).done()) == 1
    while not run(cfg, RegeneratePaths(str(prompts), 0, str(resumed)), max_batches=2):
        pass
    assert rows(resumed) == rows(whole)
    greedy = {r["sample_id"]: r for r in rows(whole) if r["sample_id"].endswith("-0")}
    hf = tmp_path / "hf.parquet"
    run(config(tiny_target_dir, engine="hf"), RegeneratePaths(str(prompts), 0, str(hf)))
    assert {r["sample_id"]: r for r in rows(hf)} == greedy
    assert pq.read_table(hf).schema.metadata[b"engine"] == b"hf"


# ------------------------------------------------------------------------------- bad input
def test_too_many_rows_for_the_memory_are_refused(tiny, tiny_target_dir, tmp_path):
    model, _ = tiny
    need = cache_bytes(model, 4, 64)
    assert need == 5 * 64 * 3 * 2 * 2 * 16 * 4  # (rows+1) x slots x layers x K,V x heads x D x 4
    with pytest.raises(ValueError, match=r"4 rows x 64 slots need .* GiB budget on cpu"):
        BatchedEngine(model, rows=4, capacity=64, memory_budget=need)
    prompts = write_questions(tmp_path / "p.parquet", 2)
    out = tmp_path / "o.parquet"
    with pytest.raises(ConfigError, match=r"regenerate\.batch_size 100000000: .*more than"):
        run(config(tiny_target_dir, batch_size=10**8), RegeneratePaths(str(prompts), 0, str(out)))
    assert not out.exists() and not PartStore(out).dir.exists()  # nothing written


def test_generate_rows_are_sized_from_the_memory_budget(tiny):
    """generate()'s rows per call: as many as the budget holds (its static cache, the prefill's
    MLP and hidden activations, a step's buffers), capped at the batch; none below one row."""
    model, _ = tiny
    cfg = model.config
    assert (
        prefill_bytes(model, 2, 64)
        == 2 * 64 * (3 * cfg.intermediate_size + 4 * cfg.hidden_size) * 4
    )

    def need(n: int) -> int:  # 64 prompt positions + 16 new tokens
        return cache_bytes(model, n, 80) + prefill_bytes(model, n, 64) + step_bytes(model, n)

    assert generate_rows(model, 8, 64, 16, budget=need(3)) == 3
    assert generate_rows(model, 8, 64, 16, budget=need(3) - 1) == 2
    assert generate_rows(model, 2, 64, 16, budget=need(3)) == 2  # the batch caps it
    assert generate_rows(model, 8, 64, 16, budget=need(1) - 1) == 0


def test_generate_in_calls_of_the_rows_that_fit_gives_the_same_answers(varied):
    """A batch decoded in calls of 3 rows (what fits) answers as the whole batch in one call."""
    model, tok = varied
    prompts, stops = chat_prompts(tok, 7), end_of_turn_ids(tok)
    from dflashpipe.config import RegenerateConfig

    cfg = generation_config(RegenerateConfig(max_new_tokens=6, cache="dynamic"), stops, 0,
                            model.device, False)  # fmt: skip
    whole = generate_batch(model, prompts, cfg, stops, 7)
    calls, real = [], model.generate
    model.generate = lambda **kw: calls.append(kw["input_ids"].shape) or real(**kw)
    try:
        assert generate_batch(model, prompts, cfg, stops, 7, max_rows=3) == whole
    finally:
        del model.generate
    assert [rows for rows, _ in calls] == [3, 3, 3] and len({w for _, w in calls}) == 1
    assert len(whole) == 7 and len({tuple(a) for a, _ in whole}) > 1  # rows differ


def test_generate_rows_that_cannot_fit_are_refused_before_decoding(tiny_target_dir, tmp_path):
    """regenerate.engine hf: an answer length whose cache holds not one row in the free memory
    is refused before anything is decoded or written, naming the key."""
    prompts = write_questions(tmp_path / "p.parquet", 2)
    out = tmp_path / "o.parquet"
    huge = config(tiny_target_dir, engine="hf", max_new_tokens=10**10)
    with pytest.raises(ConfigError, match=r"regenerate\.batch_size 3: not even one prompt"):
        run(huge, RegeneratePaths(str(prompts), 0, str(out)))
    assert not out.exists() and not PartStore(out).dir.exists()


def test_a_prompt_longer_than_the_cache_is_refused_before_decoding(tiny):
    model, tok = tiny
    engine = BatchedEngine(model, rows=2, capacity=32)
    requests = [Request("short-0", [5] * 10), Request("long-0", [5] * 30)]
    with pytest.raises(ValueError, match=r"request long-0: .*30 tokens \+ max_new_tokens 16"):
        next(engine.generate(requests, 16, {0}))
    assert engine.stats["steps"] == 0 and engine.stats["prefills"] == 0


def test_bad_sampling_settings_are_refused():
    for top_p in (0, 1.5):
        with pytest.raises(ValueError, match=f"top_p is {top_p}"):
            Sampling(top_p=top_p)
        with pytest.raises(ConfigError, match=r"regenerate\.top_p"):
            config("unused", top_p=top_p)
    with pytest.raises(ConfigError, match=r"regenerate\.engine"):
        config("unused", engine="vllm")
    with pytest.raises(ConfigError, match=r"regenerate\.cache is 'static' with regenerate\.engine"):
        config("unused", engine="static", cache="static")


def test_an_unsupported_family_is_refused_by_static_and_falls_back_on_auto(
    tiny_target_dir, tmp_path, caplog
):
    from transformers import GPT2Config, GPT2LMHeadModel

    target = tmp_path / "gpt2"
    shutil.copytree(tiny_target_dir, target, ignore=shutil.ignore_patterns("*.safetensors",
                                                                          "config.json"))  # fmt: skip
    tok_size = json.loads((tiny_target_dir / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    GPT2LMHeadModel(
        GPT2Config(vocab_size=tok_size, n_embd=32, n_layer=8, n_head=2)  # default taps 1..5
    ).save_pretrained(target)
    prompts = write_questions(tmp_path / "p.parquet", 2)
    with pytest.raises(ConfigError, match=r"regenerate\.engine is static.*'gpt2'"):
        run(
            config(target, engine="static"),
            RegeneratePaths(str(prompts), 0, str(tmp_path / "s.parquet")),
        )
    assert not (tmp_path / "s.parquet").exists()
    with caplog.at_level("INFO", logger="dflashpipe.regenerate"):
        assert run(
            config(target, max_new_tokens=2),
            RegeneratePaths(str(prompts), 0, str(tmp_path / "a.parquet")),
        )
    assert "engine hf (regenerate.engine auto: transformers' generate(), since" in caplog.text
    assert pq.read_table(tmp_path / "a.parquet").schema.metadata[b"engine"] == b"hf"


@pytest.mark.parametrize("how", ["draw", "draw_searched"])
def test_draw_follows_temperature_top_k_and_top_p(how):
    """Evenly spread uniforms land on each token as often as its probability after the filters,
    for the sort's draw and the nucleus search's."""
    from dflashpipe.decoding import sampling

    draw = getattr(sampling, how)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    where = torch.tensor([2, 0, 3, 1])  # the vocabulary's order is not the probabilities'
    u = (torch.arange(1000) + 0.5) / 1000  # (1000,)
    logits = torch.empty(4).scatter_(0, where, probs.log()).expand(1000, 4)

    def shares(**kw) -> list[float]:  # each probability's share, likeliest first
        tokens = draw(logits, u, Sampling(**kw))
        return (torch.bincount(tokens, minlength=4)[where] / 1000).tolist()

    assert shares() == pytest.approx([0.5, 0.3, 0.15, 0.05], abs=2e-3)
    assert shares(top_k=2) == pytest.approx([0.625, 0.375, 0, 0], abs=2e-3)
    assert shares(top_p=0.8) == pytest.approx([0.625, 0.375, 0, 0], abs=2e-3)  # 0.5 + 0.3 reach it
    assert shares(top_p=0.81) == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], abs=2e-3)
    hot = probs.pow(0.5) / probs.pow(0.5).sum()  # temperature 2: p^(1/2), renormalized
    assert shares(temperature=2.0) == pytest.approx(hot.tolist(), abs=2e-3)


def test_the_nucleus_search_keeps_what_the_sort_keeps():
    """nucleus_floor's tokens (probability >= the floor) are the sort's top-p nucleus on rows
    from peaked to flat (1 to about 4,700 of 5,000 tokens kept), and every token tied at the
    nucleus' edge is kept."""
    from dflashpipe.decoding.sampling import nucleus_floor

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 5000, generator=g) * torch.logspace(-1, 1.3, 64)[:, None]
    for top_p in (0.5, 0.9, 0.95):
        probs = logits.softmax(-1)
        ordered, ids = probs.sort(-1, descending=True)
        kept = torch.zeros_like(probs, dtype=torch.bool)
        kept.scatter_(-1, ids, ordered.cumsum(-1) - ordered < top_p)
        assert torch.equal(probs.view(torch.int32) >= nucleus_floor(probs, top_p), kept)
        assert kept.sum(-1).min() == 1 and kept.sum(-1).max() > 2000
    tied = torch.tensor([[0.4, 0.2, 0.2, 0.2]])  # 0.4 + one 0.2 reach 0.5: both 0.2s tied with it
    assert (tied.view(torch.int32) >= nucleus_floor(tied, 0.5)).tolist() == [[True] * 4]
