import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from conftest import base_config, write_yaml

from dflashpipe.config import Config, PromptsConfig, SourceConfig
from dflashpipe.errors import DataError
from dflashpipe.prompts import (
    BadConversation,
    PromptsPaths,
    _prompts_of,
    build,
    normalize_turns,
    prompt_key,
    read_prompts,
    run,
    train_quotas,
)
from dflashpipe.sources import DropLog, RawConversation


def _build(data_dir, **overrides):
    return build(Config.from_dict(base_config(data_dir, **overrides)).prompts)


def test_counts_per_source_and_reason(data_dir):
    train, evals, stats = _build(data_dir)
    s = stats["sources"]
    assert s["share"]["conversations"] == 5 and s["share"]["prompts"] == 5
    assert s["share"]["dropped"] == {
        "duplicate": 1, "empty_conversation": 1, "malformed_json": 1, "truncated_tail": 1,
        "unknown_role": 1,
    }  # fmt: skip
    assert s["msgs"]["dropped"] == {"empty_message": 1, "malformed_json": 1, "missing_field": 1}
    assert (s["share"]["train"], s["msgs"]["train"], s["pq"]["train"], s["he"]["train"]) == (
        4,
        4,
        2,
        0,
    )
    assert s["he"]["eval"] == 3 and len(evals) == 3 and len(train) == 10
    # what each source adds after filters and dedupe: conv-c's repeat of conv-a is share's loss
    assert {n: v["added"] for n, v in s.items()} == {"share": 4, "msgs": 4, "pq": 2, "he": 3}
    assert all(v["added"] == v["prompts"] - v["dropped"].get("duplicate", 0) for v in s.values())
    assert stats["totals"] == {
        "train": 10, "eval": 3,
        "dropped": {"duplicate": 1, "empty_conversation": 1, "empty_message": 1,
                    "malformed_json": 2, "missing_field": 1, "truncated_tail": 1, "unknown_role": 1},
    }  # fmt: skip


def test_turn_expansion_and_history(data_dir):
    train, _, _ = _build(data_dir)
    m2 = sorted((p for p in train if p.conversation_id == "m2"), key=lambda p: p.turn)
    assert [p.turn for p in m2] == [0, 1]
    assert [m["role"] for m in m2[1].messages] == ["system", "user", "assistant", "user"]
    assert m2[1].messages[-1]["content"] == "Say goodbye." and m2[1].reference == "Goodbye!"
    assert m2[0].messages[0] == {"role": "system", "content": "Be kind."}
    # the duplicate dropped was conv-c's first turn (conv-a came first); its unanswered turn stays
    conv_c = [p for p in train if p.conversation_id == "conv-c"]
    assert len(conv_c) == 1 and conv_c[0].turn == 1 and conv_c[0].reference is None


def test_one_prompt_per_conversation_when_not_expanding(data_dir):
    train, _, stats = _build(data_dir, expand_turns=False)
    m2 = [p for p in train if p.conversation_id == "m2"]
    assert len(m2) == 1 and m2[0].turn == 1
    assert stats["sources"]["share"]["train"] == 3  # conv-a (last), conv-b, conv-c (last)


def test_unanswered_turns_dropped_on_request(data_dir):
    train, _, stats = _build(data_dir, keep_unanswered=False)
    assert all(p.reference is not None for p in train)
    assert stats["sources"]["share"]["dropped"]["unanswered"] == 1


def test_roles_are_normalized(data_dir):
    train, _, _ = _build(data_dir)
    roles = {m["role"] for p in train for m in p.messages}
    assert roles == {"user", "assistant", "system"}
    pq_prompt = next(p for p in train if p.source == "pq" and "two" in p.messages[0]["content"])
    assert pq_prompt.messages[0]["role"] == "user"


def test_normalize_repairs_and_rejects():
    turns = [("gpt", "hello first"), ("human", "a"), ("user", "b"), ("gpt", "c")]
    assert normalize_turns(turns, {}) == [
        {"role": "user", "content": "a\n\nb"}, {"role": "assistant", "content": "c"},
    ]  # fmt: skip
    with pytest.raises(BadConversation, match="unknown_role"):
        normalize_turns([("narrator", "x")], {})
    assert normalize_turns([("narrator", "x")], {"narrator": "user"})[0]["role"] == "user"
    with pytest.raises(BadConversation, match="system_not_first"):
        normalize_turns([("human", "x"), ("system", "y")], {})
    with pytest.raises(BadConversation, match="empty_conversation"):
        normalize_turns([("gpt", "only an answer")], {})


def test_prompt_id_is_a_content_hash():
    a = [{"role": "user", "content": "What  is\nthis?"}]
    b = [{"role": "user", "content": "What is this?"}]
    c = [{"role": "system", "content": "What is this?"}]
    assert prompt_key(a) == prompt_key(b) != prompt_key(c)
    assert len(prompt_key(a)) == 20


def test_prompt_ids_stay_what_they_were(data_dir):
    """Kept answers and earlier runs are keyed by prompt_id: the key is still sha256 of the
    (role, NFKC text with regex \\s+ runs made one space, stripped) list, for every Unicode
    space, and a conversation's turns get the keys their histories get alone."""
    import hashlib
    import json
    import re
    import unicodedata

    def reference(messages):
        canon = [(m["role"], re.sub(r"\s+", " ", unicodedata.normalize("NFKC", m["content"]))
                  .strip()) for m in messages]  # fmt: skip
        return hashlib.sha256(json.dumps(canon, ensure_ascii=False).encode()).hexdigest()[:20]

    spaces = (
        " \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2003\u2028\u2029\u202f\u3000\u200b\ufeff"
    )
    texts = [f"{s}a{s}{s}b\u0301{s}" for s in spaces] + ["ﬁ  ①", "", "x"]
    conv = [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(texts)]
    for i in range(1, len(conv) + 1):
        assert prompt_key(conv[:i]) == reference(conv[:i]), repr(texts[i - 1])
    turns = [(m["role"], m["content"] or ".") for m in conv]
    cfg = Config.from_dict(base_config(data_dir, min_chars=1)).prompts
    got = _prompts_of(RawConversation("c", "f:0", turns), cfg.sources[0], cfg, DropLog())
    assert got and all(p.prompt_id == reference(p.messages) for p in got)


def test_eval_split_holds_out_whole_conversations(data_dir):
    raw = base_config(data_dir)
    raw["prompts"]["sources"][1]["eval_count"] = 1
    train, evals, _ = build(Config.from_dict(raw).prompts)
    assert {p.prompt_id for p in train}.isdisjoint(p.prompt_id for p in evals)
    train_convs = {(p.source, p.conversation_id) for p in train}
    eval_convs = {(p.source, p.conversation_id) for p in evals}
    assert train_convs.isdisjoint(eval_convs)
    assert sum(p.source == "msgs" for p in evals) in (1, 2)  # all turns of one conversation


def test_eval_only_source_wins_dedupe(tmp_path, data_dir):
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"messages": [{"role": "user", "content": "Count to   three."}]}\n')
    raw = base_config(data_dir)
    raw["prompts"]["sources"].append(
        {"name": "heldout", "kind": "jsonl", "path": str(dup), "split": "eval"}
    )
    train, evals, stats = build(Config.from_dict(raw).prompts)
    assert any(p.source == "heldout" for p in evals)
    assert not any(p.conversation_id == "m5" for p in train)
    assert stats["sources"]["msgs"]["dropped"]["duplicate"] == 1


def test_length_filters(data_dir):
    _, _, stats = _build(data_dir, min_chars=20, max_chars=40, max_turns=1, max_reference_chars=10)
    dropped = stats["totals"]["dropped"]
    assert dropped["too_short"] > 0 and dropped["too_long"] > 0
    assert dropped["too_many_turns"] >= 1 and dropped["reference_too_long"] >= 1
    train, _, _ = _build(data_dir, min_chars=20, max_chars=40, max_turns=1, max_reference_chars=10)
    for p in train:
        chars = sum(len(m["content"]) for m in p.messages)
        assert 20 <= chars <= 40 and len(p.reference or "") <= 10


def test_limits_and_weights():
    sources = [
        SourceConfig(name="a", kind="jsonl", path="x", weight=3.0),
        SourceConfig(name="b", kind="jsonl", path="x", weight=1.0, limit=5),
        SourceConfig(name="c", kind="jsonl", path="x", weight=4.0),
    ]
    cfg = PromptsConfig(sources=sources, max_train=8)
    assert train_quotas(cfg, {"a": 100, "b": 100, "c": 2}) == {"a": 3, "b": 1, "c": 2}
    assert train_quotas(PromptsConfig(sources=sources), {"a": 9, "b": 9, "c": 9}) == {
        "a": 9,
        "b": 5,
        "c": 9,
    }


def test_max_train_is_applied(data_dir):
    train, _, stats = _build(data_dir, max_train=3)
    assert len(train) == 3
    assert stats["totals"]["dropped"]["over_limit"] == 7


def test_seeded_and_deterministic(data_dir):
    ids = [[p.prompt_id for p in _build(data_dir, seed=s)[0]] for s in (0, 0, 1)]
    assert ids[0] == ids[1]
    assert sorted(ids[0]) == sorted(ids[2])
    orders = {tuple(p.prompt_id for p in _build(data_dir, seed=s)[0]) for s in range(5)}
    assert len(orders) > 1


def test_cli_writes_three_outputs(data_dir, tmp_path):
    cfg = write_yaml(tmp_path / "c.yaml", base_config(data_dir))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "dflashpipe", "prompts", "--config", str(cfg),
           "--train", str(out / "train.parquet"), "--eval", str(out / "eval.parquet"),
           "--stats", str(out / "stats.json")]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True)
    table = pq.read_table(out / "train.parquet")
    assert table.schema.names == [
        "prompt_id", "source", "conversation_id", "turn", "messages", "reference", "origin",
    ]  # fmt: skip
    rows = read_prompts(out / "train.parquet")
    assert len(rows) == 10 and rows[0]["messages"][-1]["role"] == "user"
    assert len(read_prompts(out / "eval.parquet")) == 3
    assert sorted(p.name for p in out.iterdir()) == ["eval.parquet", "stats.json", "train.parquet"]


def test_missing_source_file_fails_cleanly(data_dir, tmp_path):
    raw = base_config(data_dir)
    raw["prompts"]["sources"][0]["path"] = str(tmp_path / "gone.json")
    cfg = write_yaml(tmp_path / "c.yaml", raw)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "dflashpipe", "prompts", "--config", str(cfg),
           "--train", str(out / "t.parquet"), "--eval", str(out / "e.parquet"),
           "--stats", str(out / "s.json")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 2
    assert "gone.json" in done.stderr and "Traceback" not in done.stderr
    assert not out.exists() or not any(out.iterdir())


def test_run_output_is_reproducible(data_dir, tmp_path):
    cfg = Config.from_dict(base_config(data_dir))
    for d in ("a", "b"):
        run(cfg, PromptsPaths(*(tmp_path / d / n for n in ("t.parquet", "e.parquet", "s.json"))))
    assert read_prompts(tmp_path / "a" / "t.parquet") == read_prompts(tmp_path / "b" / "t.parquet")
    assert (tmp_path / "a" / "s.json").read_text() == (tmp_path / "b" / "s.json").read_text()


def test_empty_message_counts(data_dir):
    # a conversation whose only user turn is blank is dropped whole, with its row named
    _, _, stats = _build(data_dir)
    assert any(":4: empty_message" in e for e in stats["sources"]["msgs"]["drop_examples"])


def test_eval_order_does_not_depend_on_the_train_limits(data_dir):
    """evaluate reads the first num_prompts eval rows: recipes that differ only in how much they
    train on must evaluate the same prompts (the order once followed the rng's draws for train)."""
    raw = base_config(data_dir)
    raw["prompts"]["sources"][1]["eval_count"] = 2
    orders = []
    for max_train in (None, 3, 5):
        raw["prompts"]["max_train"] = max_train
        train, evals, _ = build(Config.from_dict(raw).prompts)
        assert max_train is None or len(train) == max_train
        orders.append([p.prompt_id for p in evals])
    assert len(orders[0]) >= 3 and orders[0] == orders[1] == orders[2]


def test_code_source_stats_name_the_files_read(data_dir, tmp_path):
    """A code source's stats.json entry says which code it read (a digest two runs can compare)
    and how many prompts it adds once an earlier source's copies are dropped."""
    code = tmp_path / "lib"
    (code / "test").mkdir(parents=True)
    body = '    """{doc}"""\n    return {expr}\n'
    (code / "calc.py").write_text(
        "def double(x):\n" + body.format(doc="Twice x.", expr="2 * x")
        + "\n\ndef half(x):\n" + body.format(doc="Half of x.", expr="x / 2")
    )  # fmt: skip
    (code / "copy.py").write_text("def double(x):\n" + body.format(doc="Twice x.", expr="2 * x"))
    (code / "test" / "test_calc.py").write_text("def test_double():\n    assert True\n")
    raw = base_config(data_dir)
    raw["prompts"]["sources"].append({"name": "code", "kind": "python", "path": str(code)})
    stats = run(
        Config.from_dict(raw), PromptsPaths(*(tmp_path / n for n in ("t.pq", "e.pq", "s.json")))
    )
    written = json.loads((tmp_path / "s.json").read_text())
    assert written == json.loads(json.dumps(stats))
    entry = written["sources"]["code"]
    # calc.py gives two tasks, copy.py the same `double` again: three read, two added
    assert (entry["prompts"], entry["added"], entry["train"]) == (3, 2, 2)
    assert entry["dropped"] == {"duplicate": 1, "test_module": 1}
    files = entry["files"]
    assert files["path"] == str(code) and files["read"] == 2 and len(files["sha256"]) == 64
    assert "files" not in written["sources"]["share"]  # only code sources list their files
    # the prompt is the signature and docstring: another body is still the same prompt
    (code / "copy.py").write_text("def double(x):\n" + body.format(doc="Twice x.", expr="x + x"))
    again = build(Config.from_dict(raw).prompts)[2]["sources"]["code"]
    assert again["files"]["sha256"] != files["sha256"] and again["added"] == 2
    (code / "copy.py").write_text("def double(x):\n" + body.format(doc="2x.", expr="x + x"))
    assert build(Config.from_dict(raw).prompts)[2]["sources"]["code"]["added"] == 3


def _long_conversations(path):
    """ShareGPT-shaped conversations of growing length: their later turns' histories are over
    200 characters; conversation 7's first question alone is, so that conversation has trimmed
    turns only."""
    convs = []
    for c in range(30):
        turns = []
        for t in range(1 + c % 5):
            turns += [{"from": "human", "value": f"conv {c} question {t} " + "why? " * (c % 7)},
                      {"from": "gpt", "value": f"answer {t} of {c} " + "because. " * 6}]  # fmt: skip
        if c == 7:
            turns[0]["value"] = "x" * 250
        convs.append({"id": f"c{c}", "conversations": turns})
    path.write_text(json.dumps(convs))
    return path


def test_trim_history_keeps_the_tail_of_long_turns_for_training_only(tmp_path):
    """trim_history: a turn over max_chars trains on the longest tail of whole messages from a
    user message that fits; the eval prompts are exactly those without the option, no trimmed
    turn of a held-out conversation trains, a message alone over max_chars is still dropped, and
    unset the option stays out of the prompts section (its digest)."""
    source = {"name": "s", "kind": "sharegpt", "path": str(_long_conversations(tmp_path / "c.json")),
              "split": "both", "eval_count": 6}  # fmt: skip
    raw = {"target": {"model": "m"}, "prompts": {"sources": [source], "max_chars": 200}}
    plain = Config.from_dict(raw)
    assert "trim_history" not in plain.raw["prompts"] and "exclude" not in plain.raw["prompts"]
    train0, eval0, stats0 = build(plain.prompts)
    raw["prompts"]["trim_history"] = True
    train, evals, stats = build(Config.from_dict(raw).prompts)
    assert evals == eval0 and [p.prompt_id for p in evals] == [p.prompt_id for p in eval0]
    assert {p.prompt_id for p in train0} < {p.prompt_id for p in train}
    trimmed = [p for p in train if p.history_cut]
    assert len(trimmed) == stats["sources"]["s"]["trimmed"] > 0
    assert len(train) == len(train0) + len(trimmed)
    held = {p.conversation_id for p in evals}
    assert not held & {p.conversation_id for p in train}
    assert stats["sources"]["s"]["dropped"]["trimmed_held_out"] > 0
    assert stats["sources"]["s"]["dropped"]["too_long"] == 1  # conversation 7's first question
    assert "c7" in {p.conversation_id for p in trimmed} - {p.conversation_id for p in train0}
    assert stats0["sources"]["s"]["dropped"]["too_long"] > 1
    for p in trimmed:
        assert p.messages[0]["role"] == "user" and p.messages[-1]["role"] == "user"
        assert sum(len(m["content"]) for m in p.messages) <= 200
        # the longest such tail: one more user-started stretch would be over
        turns = json.loads((tmp_path / "c.json").read_text())[int(p.conversation_id[1:])]
        history = [m["value"].strip() for m in turns["conversations"][: 2 * p.turn + 1]]
        assert [m["content"] for m in p.messages] == history[p.history_cut :]
        assert sum(len(m) for m in history[p.history_cut - 2 :]) > 200
    written = tmp_path / "train.parquet"
    from dflashpipe.prompts import write_prompts

    write_prompts(written, train0)
    assert pq.read_table(written).schema.names == [  # the file format did not change
        "prompt_id", "source", "conversation_id", "turn", "messages", "reference", "origin"]  # fmt: skip
    raw["prompts"]["exclude"] = [str(written)]
    added, evals2, stats2 = build(Config.from_dict(raw).prompts)
    assert evals2 == eval0 and {p.prompt_id for p in added} == {p.prompt_id for p in trimmed}
    assert stats2["sources"]["s"]["dropped"]["excluded"] == len(train0)
    raw["prompts"]["exclude"] = [str(tmp_path / "gone.parquet")]
    with pytest.raises(DataError, match=r"prompts\.exclude: .*gone\.parquet does not exist"):
        build(Config.from_dict(raw).prompts)
