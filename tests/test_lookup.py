"""Prompt lookup's proposer against a brute-force search, and the sweep's grid."""

import random

import pytest

from dflashpipe.decoding.lookup import GRID, LookupConfig, PromptLookupProposer, replay, sweep


def brute_force(tokens: list[int], prompt_len: int, cfg: LookupConfig) -> list[int]:
    """Every occurrence of the last n tokens that ends before the last token (and inside the
    prompt for search "prompt"), scanned from scratch; the earliest or latest one's followers."""
    limit = len(tokens) - 1 if cfg.search == "all" else min(len(tokens) - 1, prompt_len)
    for n in range(min(cfg.max_ngram_size, len(tokens)), 0, -1):
        tail = tokens[-n:]
        ends = [e for e in range(n, limit + 1) if tokens[e - n : e] == tail]
        if ends:
            end = min(ends) if cfg.occurrence == "earliest" else max(ends)
            return tokens[end : end + cfg.num_drafts]
    return []


@pytest.mark.parametrize("cfg", GRID[::5] + (LookupConfig(3, 3, "latest", "prompt"),), ids=str)
def test_proposer_matches_a_brute_force_search(cfg):
    """Random token lists over small vocabularies (so n-grams recur), grown one step at a time
    as decoding grows them: the incremental index answers as a full rescan does."""
    rng = random.Random(7)
    for vocab in (2, 3, 5):
        for _ in range(20):
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
            p = PromptLookupProposer(cfg.num_drafts, cfg.max_ngram_size, cfg.occurrence, cfg.search)
            p.start(prompt, None)
            tokens = list(prompt)
            for _ in range(15):
                tokens += [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
                assert p.propose(tokens) == brute_force(tokens, len(prompt), cfg), (tokens, cfg)


def test_earliest_follows_transformers_and_latest_the_most_recent():
    p = PromptLookupProposer(num_drafts=3, max_ngram_size=2)
    p.start([], None)
    assert p.propose([5, 6, 7, 8, 5, 6]) == [7, 8, 5]  # bigram (5, 6) at 0
    assert p.propose([5, 6, 7, 8, 5, 6, 9]) == []  # 9 never seen before
    assert p.propose([5, 6, 7, 8, 5, 6, 9, 8]) == [5, 6, 9]  # unigram 8 at 3
    assert p.propose([5, 6, 7, 8, 5, 6, 9, 8, 5, 6]) == [7, 8, 5]  # the earliest, not the latest
    p.start([], None)  # a new response forgets the old index
    assert p.propose([1, 2, 1]) == [2, 1]
    latest = PromptLookupProposer(3, 2, occurrence="latest")
    latest.start([], None)
    assert latest.propose([5, 6, 7, 8, 5, 6, 9, 8, 5, 6]) == [9, 8, 5]
    in_prompt = PromptLookupProposer(3, 2, occurrence="latest", search="prompt")
    in_prompt.start([5, 6, 7, 8], None)
    assert in_prompt.propose([5, 6, 7, 8, 5, 6, 9, 8, 5, 6]) == [7, 8, 5, 6][:3]


def test_bad_configurations_are_refused_by_name():
    for kwargs, match in (
        ({"num_drafts": 0}, "num_drafts 0"),
        ({"max_ngram_size": 0}, "max_ngram_size 0"),
        ({"occurrence": "first"}, "occurrence must be one of"),
        ({"search": "output"}, "search must be one of"),
    ):
        with pytest.raises(ValueError, match=match):
            LookupConfig(**kwargs)


def test_grid_covers_the_issues_sweep():
    assert len(GRID) == len({c.name for c in GRID}) == 48
    assert {(c.occurrence, c.search) for c in GRID} == {
        (o, s) for o in ("earliest", "latest") for s in ("all", "prompt")
    }
    assert {c.max_ngram_size for c in GRID} == {1, 2, 3, 4}
    assert {c.num_drafts for c in GRID} == {5, 10, 16}


def test_replay_counts_acceptances_on_a_known_output():
    """Every step's drafts checked against the output's next tokens by hand."""
    prompt, output = [1, 2, 3, 4], [1, 2, 3, 9, 1, 2]
    got = replay(PromptLookupProposer(3, 1), prompt, output, 6, set())
    # tokens 1 2 3 4 1: unigram 1 at 0 -> drafts 2 3 4; output says 2 3 9: 2 accepted + bonus 9
    # tokens ... 1 2 3 9: 9 unseen -> no drafts, bonus 1
    # tokens ... 9 1: earliest 1 -> 2 3 4 vs output 2 (then its end): the step delivers 2 only
    assert got.output_ids == output and got.finish_reason == "length"
    assert (got.accepted_lengths, got.drafted) == ([3, 1, 1], [3, 0, 3])
    stopped = replay(PromptLookupProposer(3, 1), prompt, [1, 2, 3, 0], 6, {0})
    assert stopped.output_ids == [1, 2, 3, 0] and stopped.finish_reason == "stop"
    assert stopped.accepted_lengths == [3]  # drafts 2 3 4 vs 2 3 0: two accepted, bonus 0 stops


def test_sweep_replays_every_configuration_on_every_prompt():
    prompts, outputs = [[1, 2, 3], [4, 4, 4]], [[1, 2, 3, 1], [4, 4, 4, 4, 4]]
    grid = GRID[:3]
    got = sweep(prompts, outputs, 8, set(), grid)
    assert list(got) == [c.name for c in grid]
    for responses in got.values():
        assert [r.output_ids for r in responses] == outputs
