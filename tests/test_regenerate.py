import json

import pyarrow.parquet as pq
import pytest

from dflashpipe.chat import encode_chat, encode_prompt
from dflashpipe.config import Config
from dflashpipe.errors import DataError
from dflashpipe.prompts import Prompt, prompt_key, write_prompts
from dflashpipe.regenerate import PartStore, RegeneratePaths, plan_batches, run
from dflashpipe.target import load_tokenizer

QUESTIONS = [
    "What is the capital of France?", "Name three colors.", "Say hi.",
    "Explain what a prime number is, briefly, in one or two sentences please.",
    "Count from one to five.", "What is 2+2?", "Give me a word that rhymes with cat.",
    "Translate 'hello' to Spanish.", "Why is the sky blue?", "List two fruits.",
]  # fmt: skip


@pytest.fixture
def prompts_file(tmp_path):
    prompts = []
    for i, q in enumerate(QUESTIONS):
        msgs = [{"role": "user", "content": q}]
        prompts.append(Prompt(prompt_key(msgs), "t", str(i), 0, msgs, f"Answer {i}.", f"f:{i}"))
    prompts[2].reference = None
    write_prompts(tmp_path / "train.parquet", prompts)
    return tmp_path / "train.parquet"


def _cfg(target_dir, **regen) -> Config:
    raw = {
        "target": {"model": str(target_dir)},
        "devices": {"extract": "auto"},
        "prompts": {"sources": [{"name": "x", "kind": "jsonl", "path": "unused.jsonl"}]},
        "regenerate": {"shards": 2, "batch_size": 2, "max_new_tokens": 8, "save_every": 2, **regen},
        "extract": {"max_length": 256},
    }
    return Config.from_dict(raw)


def _table(path):
    return pq.read_table(path)


def test_rows_are_exact_and_greedy_is_deterministic(tiny_target_dir, prompts_file, tmp_path):
    cfg = _cfg(tiny_target_dir)
    assert run(cfg, RegeneratePaths(str(prompts_file), 0, str(tmp_path / "a.parquet")))
    assert run(cfg, RegeneratePaths(str(prompts_file), 0, str(tmp_path / "b.parquet")))
    a, b = _table(tmp_path / "a.parquet"), _table(tmp_path / "b.parquet")
    assert a.to_pylist() == b.to_pylist() and a.num_rows == 5
    tok = load_tokenizer(cfg.target)
    prompts = {r["prompt_id"]: r for r in pq.read_table(prompts_file).to_pylist()}
    for row in a.to_pylist():
        expected_prompt = encode_prompt(tok, prompts[row["prompt_id"]]["messages"])
        n = row["num_prompt_tokens"]
        assert row["input_ids"][:n] == expected_prompt and n == len(expected_prompt)
        assert row["loss_mask"] == [0] * n + [1] * (len(row["input_ids"]) - n)
        assert 1 <= len(row["input_ids"]) - n <= 8
        assert row["finish_reason"] in ("stop", "length")
    meta = a.schema.metadata
    assert json.loads(meta[b"target"])["name"] == str(tiny_target_dir)
    assert json.loads(meta[b"stats"])["samples"] == 5
    # shards 0 and 1 partition the prompts
    run(cfg, RegeneratePaths(str(prompts_file), 1, str(tmp_path / "c.parquet")))
    ids = {r["prompt_id"] for r in a.to_pylist()} | {
        r["prompt_id"] for r in _table(tmp_path / "c.parquet").to_pylist()
    }
    assert ids == set(prompts)


def test_interrupted_shard_resumes_to_the_same_bytes(tiny_target_dir, prompts_file, tmp_path):
    cfg = _cfg(tiny_target_dir)
    whole = tmp_path / "whole.parquet"
    run(cfg, RegeneratePaths(str(prompts_file), 0, str(whole)))
    out = tmp_path / "resumed.parquet"
    assert run(cfg, RegeneratePaths(str(prompts_file), 0, str(out)), max_batches=1) is False
    assert not out.exists()
    assert len(PartStore(out).done()) == 1
    assert (
        run(cfg, RegeneratePaths(str(prompts_file), 0, str(out)), max_batches=1) is False
    )  # one more batch
    assert len(PartStore(out).done()) == 2
    assert run(cfg, RegeneratePaths(str(prompts_file), 0, str(out)))
    assert _table(out).to_pylist() == _table(whole).to_pylist()
    assert not PartStore(out).dir.exists()


def test_parts_left_by_another_plan_are_discarded_not_mixed_in(
    tiny_target_dir, prompts_file, tmp_path, caplog
):
    # an interrupted shard's settings edited before the rerun: its parts hold answers of at
    # most 4 tokens, which the 8-token rerun must not take as its own
    short, full = _cfg(tiny_target_dir, max_new_tokens=4), _cfg(tiny_target_dir)
    whole = tmp_path / "whole.parquet"
    run(full, RegeneratePaths(str(prompts_file), 0, str(whole)))
    out = tmp_path / "edited.parquet"
    assert run(short, RegeneratePaths(str(prompts_file), 0, str(out)), max_batches=1) is False
    assert len(PartStore(out).done()) == 1
    with caplog.at_level("WARNING"):
        assert run(full, RegeneratePaths(str(prompts_file), 0, str(out)))
    assert "1 part files were made with another plan" in caplog.text
    assert _table(out).to_pylist() == _table(whole).to_pylist()
    # the same settings again: the parts are resumed, nothing discarded
    again = tmp_path / "again.parquet"
    assert run(full, RegeneratePaths(str(prompts_file), 0, str(again)), max_batches=1) is False
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert run(full, RegeneratePaths(str(prompts_file), 0, str(again)))
    assert "another plan" not in caplog.text
    assert _table(again).to_pylist() == _table(whole).to_pylist()


def test_completed_shard_is_never_redone(tiny_target_dir, prompts_file, tmp_path):
    cfg = _cfg(tiny_target_dir)
    out = tmp_path / "s.parquet"
    run(cfg, RegeneratePaths(str(prompts_file), 0, str(out)))
    before = out.stat().st_mtime_ns
    assert run(cfg, RegeneratePaths(str(prompts_file), 0, str(out)))
    assert out.stat().st_mtime_ns == before


def test_sampling_is_seeded(tiny_target_dir, prompts_file, tmp_path):
    cfg = _cfg(tiny_target_dir, temperature=1.0, top_k=50, seed=3)
    run(cfg, RegeneratePaths(str(prompts_file), 0, str(tmp_path / "a.parquet")))
    run(cfg, RegeneratePaths(str(prompts_file), 0, str(tmp_path / "b.parquet")))
    assert _table(tmp_path / "a.parquet").to_pylist() == _table(tmp_path / "b.parquet").to_pylist()


def test_too_long_prompts_are_counted(tiny_target_dir, prompts_file, tmp_path):
    cfg = _cfg(tiny_target_dir)
    tok = load_tokenizer(cfg.target)
    rows = pq.read_table(prompts_file).to_pylist()[0::2]  # shard 0 of 2
    lengths = sorted(len(encode_prompt(tok, r["messages"])) for r in rows)
    cfg.extract.max_length = lengths[2]  # the budget fits strictly shorter prompts
    run(cfg, RegeneratePaths(str(prompts_file), 0, str(tmp_path / "s.parquet")))
    table = _table(tmp_path / "s.parquet")
    stats = json.loads(table.schema.metadata[b"stats"])
    assert stats["prompt_too_long"] == sum(n >= lengths[2] for n in lengths) >= 1
    assert stats["samples"] == table.num_rows == 5 - stats["prompt_too_long"]


def test_dataset_answers_when_disabled(tiny_target_dir, prompts_file, tmp_path):
    cfg = _cfg(tiny_target_dir, enabled=False)
    run(cfg, RegeneratePaths(str(prompts_file), 0, str(tmp_path / "s.parquet")))
    rows = _table(tmp_path / "s.parquet").to_pylist()
    tok = load_tokenizer(cfg.target)
    prompts = {r["prompt_id"]: r for r in pq.read_table(prompts_file).to_pylist()}
    for row in rows:
        p = prompts[row["prompt_id"]]
        ids, mask = encode_chat(
            tok, [*p["messages"], {"role": "assistant", "content": p["reference"]}]
        )
        assert (row["input_ids"], row["loss_mask"]) == (ids, mask)
        assert row["finish_reason"] == "dataset"
    stats = json.loads(_table(tmp_path / "s.parquet").schema.metadata[b"stats"])
    assert stats["no_reference"] + stats["samples"] == 5


def test_bad_shard_and_empty_prompts(tiny_target_dir, prompts_file, tmp_path):
    cfg = _cfg(tiny_target_dir)
    with pytest.raises(DataError, match="shard index 2 is out of range"):
        run(cfg, RegeneratePaths(str(prompts_file), 2, str(tmp_path / "x.parquet")))
    write_prompts(tmp_path / "empty.parquet", [])
    with pytest.raises(DataError, match="holds no prompts"):
        run(cfg, RegeneratePaths(str(tmp_path / "empty.parquet"), 0, str(tmp_path / "y.parquet")))


def test_batches_are_length_sorted():
    assert plan_batches([3, 9, 1, 7, 5], 2) == [[1, 3], [4, 0], [2]]


def test_static_cache_decodes_like_dynamic(tiny_target_dir, prompts_file, tmp_path):
    """generate()'s GPU default (static KV cache) gives the same greedy answers as its CPU one."""
    for cache in ("dynamic", "static"):
        cfg = _cfg(tiny_target_dir, cache=cache, engine="hf")
        run(cfg, RegeneratePaths(str(prompts_file), 0, str(tmp_path / f"{cache[0]}.parquet")))
    assert _table(tmp_path / "d.parquet").to_pylist() == _table(tmp_path / "s.parquet").to_pylist()


def test_padded_shapes_are_few():
    from dflashpipe.decoding.hf_generate import padded_shape

    assert padded_shape([3, 10], 4) == (4, 64)
    assert padded_shape([65, 100], 2) == (2, 128)
    assert padded_shape([1000], 1) == (1, 1024)
    widths = {padded_shape([n], 8)[1] for n in range(1, 4097)}
    assert len(widths) <= 7  # under dynamo's recompile limit of 8


def test_static_cache_batches_share_the_widest_shape(tiny_target_dir, tmp_path, caplog):
    """generate() and one long prompt: with a static cache every batch is padded to its width
    (one decode graph), and the answers are still those of the dynamic cache's per-batch widths."""
    questions = [*QUESTIONS[:5], " ".join(["Please summarize the following list:"] + QUESTIONS)]
    prompts = []
    for i, q in enumerate(questions):
        msgs = [{"role": "user", "content": q}]
        prompts.append(Prompt(prompt_key(msgs), "t", str(i), 0, msgs, None, f"f:{i}"))
    write_prompts(tmp_path / "p.parquet", prompts)
    shapes = {}
    for cache in ("dynamic", "static"):
        caplog.clear()
        with caplog.at_level("INFO", logger="dflashpipe.regenerate"):
            run(_cfg(tiny_target_dir, cache=cache, shards=1, engine="hf"),
                RegeneratePaths(str(tmp_path / "p.parquet"), 0, str(tmp_path / f"{cache}.parquet")))  # fmt: skip
        shapes[cache] = [
            m.split("shape ")[1].split(":")[0] for m in caplog.messages if "shape" in m
        ]
    assert len(shapes["static"]) == 3 and set(shapes["static"]) == {"(2, 128)"}
    assert set(shapes["dynamic"]) == {"(2, 128)", "(2, 64)"}
    a, b = _table(tmp_path / "dynamic.parquet"), _table(tmp_path / "static.parquet")
    assert a.to_pylist() == b.to_pylist()


def test_prompts_over_max_prompt_tokens_are_skipped(tiny_target_dir, prompts_file, tmp_path):
    cfg = _cfg(tiny_target_dir, shards=1)
    tok = load_tokenizer(cfg.target)
    lengths = sorted(
        len(encode_prompt(tok, r["messages"])) for r in pq.read_table(prompts_file).to_pylist()
    )
    cfg = _cfg(tiny_target_dir, shards=1, max_prompt_tokens=lengths[4])
    run(cfg, RegeneratePaths(str(prompts_file), 0, str(tmp_path / "s.parquet")))
    table = _table(tmp_path / "s.parquet")
    stats = json.loads(table.schema.metadata[b"stats"])
    assert stats["prompt_too_long"] == sum(n > lengths[4] for n in lengths) >= 1
    assert table.num_rows == 10 - stats["prompt_too_long"]
    assert max(table.column("num_prompt_tokens").to_pylist()) <= lengths[4]


def _answers(path) -> dict[str, list[int]]:
    return {r["sample_id"]: r["input_ids"] for r in _table(path).to_pylist()}


def test_several_answers_per_prompt(tiny_target_dir, prompts_file, tmp_path):
    """Answer 0 is the greedy one; the sampled ones are the same on a rerun and after a resume."""
    greedy = tmp_path / "greedy.parquet"
    run(_cfg(tiny_target_dir), RegeneratePaths(str(prompts_file), 0, str(greedy)))
    cfg = _cfg(tiny_target_dir, samples_per_prompt=3, temperature=1.0, top_k=50, seed=5)
    whole = tmp_path / "whole.parquet"
    assert run(cfg, RegeneratePaths(str(prompts_file), 0, str(whole)))
    answers = _answers(whole)
    prompt_ids = {r["prompt_id"] for r in _table(greedy).to_pylist()}
    stats = json.loads(_table(whole).schema.metadata[b"stats"])
    assert stats["samples"] == len(answers) == 15 - stats.get("duplicate_answers", 0)
    assert {k for k in answers if k.endswith("-0")} == {f"{p}-0" for p in prompt_ids}
    assert {k: v for k, v in answers.items() if k.endswith("-0")} == _answers(greedy)
    sampled = [v for k, v in answers.items() if not k.endswith("-0")]
    assert len(sampled) >= 8 and any(v not in _answers(greedy).values() for v in sampled)
    assert stats.get("finish_stop", 0) + stats.get("finish_length", 0) == 15  # before dedupe
    rows = _table(whole).to_pylist()  # a prompt's answers are together, by sample index
    assert [r["sample_id"] for r in rows] == sorted(
        (r["sample_id"] for r in rows), key=lambda s: ([r["prompt_id"] for r in rows].index(
            s.rpartition("-")[0]), s))  # fmt: skip
    again = tmp_path / "again.parquet"
    run(cfg, RegeneratePaths(str(prompts_file), 0, str(again)))
    assert _table(again).to_pylist() == rows
    resumed = tmp_path / "resumed.parquet"
    while not run(cfg, RegeneratePaths(str(prompts_file), 0, str(resumed)), max_batches=2):
        pass  # stops after two batches, here inside the sampled answers
    assert _table(resumed).to_pylist() == rows


def test_identical_answers_are_kept_once(tiny_target_dir, prompts_file, tmp_path):
    """top_k 1 samples the greedy token: answers 1 and 2 repeat answer 0 and are dropped."""
    cfg = _cfg(tiny_target_dir, samples_per_prompt=3, temperature=1.0, top_k=1)
    run(cfg, RegeneratePaths(str(prompts_file), 0, str(tmp_path / "s.parquet")))
    stats = json.loads(_table(tmp_path / "s.parquet").schema.metadata[b"stats"])
    assert stats["duplicate_answers"] == 10 and stats["samples"] == 5
    assert all(k.endswith("-0") for k in _answers(tmp_path / "s.parquet"))


def test_several_greedy_answers_are_refused(tiny_target_dir):
    from dflashpipe.errors import ConfigError

    with pytest.raises(ConfigError, match="samples_per_prompt is 2 with regenerate.temperature 0"):
        _cfg(tiny_target_dir, samples_per_prompt=2)
    with pytest.raises(ConfigError, match="samples_per_prompt is 2 with regenerate.enabled false"):
        _cfg(tiny_target_dir, samples_per_prompt=2, temperature=1.0, enabled=False)
