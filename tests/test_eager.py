"""Speculative decoding: lossless against target-only greedy, tau, cache trimming, proposers."""

import pytest
import torch

from dflashpipe.chat import encode_prompt
from dflashpipe.config import TargetConfig
from dflashpipe.decoding.eager import (
    DFlashProposer,
    Target,
    greedy_decode,
    speculative_decode,
    trim_cache,
)
from dflashpipe.decoding.lookup import PromptLookupProposer, replay
from dflashpipe.decoding.types import Decoded
from dflashpipe.model import Drafter, DrafterConfig
from dflashpipe.taps import LayerTaps
from dflashpipe.target import load_target

BLOCK = 4
QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.", "Count to ten."]


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    model, tok = load_target(TargetConfig(model=str(tiny_target_dir)), torch.device("cpu"))
    prompts = [encode_prompt(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    return model, prompts


@pytest.fixture(scope="module")
def drafter(tiny) -> Drafter:
    model, _ = tiny
    config = DrafterConfig.from_target(
        model.config, mask_token_id=0, num_layers=1, block_size=BLOCK, target_layer_ids=[0, 1]
    )
    torch.manual_seed(1)
    return Drafter.from_target_model(config, model).eval()


class ReferenceProposer:
    """A perfect drafter stand-in: proposes the target's own greedy continuation."""

    layer_ids = ()
    num_drafts = BLOCK - 1

    def __init__(self, reference: list[int]):
        self.reference = reference

    def start(self, prompt_ids, hidden):
        self.prompt_length = len(prompt_ids)

    def propose(self, tokens):
        done = len(tokens) - self.prompt_length
        return self.reference[done : done + self.num_drafts]

    def advance(self, hidden):
        pass


def test_trim_keeps_outputs_identical_to_a_fresh_prefill(tiny):
    model, prompts = tiny
    target = Target(model)
    ids = prompts[0]
    cache = target.new_cache()
    target.forward(ids[:10], cache)
    length = 10
    for step, (extra, keep) in enumerate([(5, 2), (4, 0), (6, 3), (1, 1)]):
        target.forward(ids[length : length + extra], cache)
        trim_cache(cache, length + keep)
        length += keep
        assert cache.get_seq_length() == length, f"step {step}"
        probe, _ = target.forward(ids[length : length + 1], cache)
        trim_cache(cache, length)  # the probe is not part of the prefix
        fresh = target.new_cache()
        expected, _ = target.forward(ids[: length + 1], fresh)
        torch.testing.assert_close(probe[-1], expected[-1], atol=1e-5, rtol=1e-5)
    trim_cache(cache, length)  # nothing to remove is fine
    with pytest.raises(ValueError, match="cannot trim"):
        trim_cache(cache, length + 1)


def test_random_drafter_is_lossless_even_when_nothing_is_accepted(tiny, drafter):
    model, prompts = tiny
    target = Target(model, drafter.config.target_layer_ids)
    taus = []
    for ids in prompts[:2]:
        ref = greedy_decode(target, ids, 16, stop_ids=set())
        out = speculative_decode(target, DFlashProposer(drafter), ids, 16, stop_ids=set())
        assert out.output_ids == ref.output_ids
        assert len(out.output_ids) == 16 and out.finish_reason == "length"
        assert all(1 <= a <= BLOCK for a in out.accepted_lengths)
        assert out.drafted == [BLOCK - 1] * len(out.accepted_lengths)
        taus.append(out.acceptance_length)
    assert sum(taus) / len(taus) < 1.3  # a random drafter guesses (almost) nothing


def test_perfect_proposer_reaches_the_block_size(tiny):
    model, prompts = tiny
    target = Target(model)
    steps = 5
    for ids in prompts:
        ref = greedy_decode(target, ids, 1 + steps * BLOCK, stop_ids=set())
        out = speculative_decode(
            target, ReferenceProposer(ref.output_ids), ids, 1 + steps * BLOCK, stop_ids=set()
        )
        assert out.output_ids == ref.output_ids
        assert out.accepted_lengths == [BLOCK] * steps
        assert out.acceptance_length == BLOCK
        assert out.per_position_acceptance(BLOCK - 1) == [1.0] * (BLOCK - 1)


def test_context_holds_target_states_of_accepted_tokens(tiny, drafter):
    """The drafter's context is appended from verify forwards, never recomputed, and must equal
    the tapped states of one forward over the accepted sequence."""
    model, prompts = tiny
    target = Target(model, drafter.config.target_layer_ids)
    ids = prompts[1]
    proposer = DFlashProposer(drafter)
    out = speculative_decode(target, proposer, ids, 16, stop_ids=set())
    rows = min(proposer.context.shape[0], len(ids) + len(out.output_ids))
    taps = LayerTaps(model.get_decoder(), drafter.config.target_layer_ids)
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([(ids + out.output_ids)[:rows]]), use_cache=False)
        expected = taps.gather()[0]  # (rows, 2*H)
    finally:
        taps.remove()
    target.taps.outputs.clear()
    with torch.inference_mode():
        expected = drafter.hidden_norm(drafter.fc(expected))  # (rows, H)
    torch.testing.assert_close(proposer.context[:rows], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("sliding", [False, True])
def test_proposer_block_equals_the_trained_forward(tiny, sliding):
    """The proposer's cached-context block is Drafter.forward on the one-document stream."""
    model, prompts = tiny
    kw = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5}
    config = DrafterConfig.from_target(
        model.config,
        mask_token_id=0,
        num_layers=2,
        block_size=BLOCK,
        target_layer_ids=[0, 1],
        **(kw if sliding else {}),
    )
    torch.manual_seed(2)
    drafter = Drafter.from_target_model(config, model).eval()
    g = torch.Generator().manual_seed(0)
    ids = prompts[0][:12]
    states = torch.randn(11, 2 * model.config.hidden_size, generator=g)
    proposer = DFlashProposer(drafter)
    proposer.start(ids[:6], states[:6])
    proposer.advance(states[6:9])  # appended in steps, as the decoding loop does
    proposer.advance(states[9:])
    got = proposer.block_states(ids[11])
    with torch.inference_mode():
        expected = drafter(
            torch.tensor(ids),
            torch.cat([states, torch.zeros(1, states.shape[1])]),
            torch.arange(12),
            torch.zeros(12, dtype=torch.long),
            torch.tensor([11]),
            torch.ones(1, dtype=torch.bool),
            backend="sdpa",
        )[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_stops_at_the_first_end_of_turn_token(tiny, drafter):
    model, prompts = tiny
    target = Target(model, drafter.config.target_layer_ids)
    ids = prompts[2]
    free = greedy_decode(target, ids, 12, stop_ids=set()).output_ids
    stop = free[6]
    first = free.index(stop)
    for out in (
        greedy_decode(target, ids, 12, {stop}),
        speculative_decode(target, DFlashProposer(drafter), ids, 12, {stop}),
        speculative_decode(target, ReferenceProposer(free), ids, 12, {stop}),
    ):
        assert out.output_ids == free[: first + 1]
        assert out.finish_reason == "stop"


def test_prompt_lookup_is_lossless_in_the_same_loop(tiny):
    model, prompts = tiny
    target = Target(model)
    for ids in prompts:
        ref = greedy_decode(target, ids, 24, stop_ids=set())
        out = speculative_decode(target, PromptLookupProposer(5), ids, 24, stop_ids=set())
        assert out.output_ids == ref.output_ids
        assert all(1 <= a <= d + 1 for a, d in zip(out.accepted_lengths, out.drafted, strict=True))


@pytest.mark.parametrize("occurrence", ["earliest", "latest"])
def test_replay_gives_the_decoding_loops_acceptances(tiny, occurrence):
    """lookup.replay on the target-only output against real speculative decoding with the same
    proposer: same tokens, same acceptances and draft counts at every step, the last included
    (decoding may verify tokens past the response's end there; they are not counted); prompts
    doubled so n-grams recur."""
    model, prompts = tiny
    target = Target(model)
    steps = 0
    for ids in [p + p for p in prompts]:
        ref = greedy_decode(target, ids, 24, stop_ids=set())
        for n, k in ((1, 3), (3, 10)):
            decoded = speculative_decode(
                target, PromptLookupProposer(k, n, occurrence), ids, 24, stop_ids=set()
            )
            got = replay(PromptLookupProposer(k, n, occurrence), ids, ref.output_ids, 24, set())
            assert got.output_ids == decoded.output_ids == ref.output_ids
            assert got.accepted_lengths == decoded.accepted_lengths
            assert got.drafted == decoded.drafted
            assert sum(decoded.accepted_lengths) == len(decoded.output_ids) - 1
            steps += sum(a > 1 for a in got.accepted_lengths)
    assert steps > 0  # drafts were accepted: the comparison covered more than bonus tokens


def test_proposer_and_target_must_tap_the_same_layers(tiny, drafter):
    model, prompts = tiny
    target = Target(model, [1])
    try:
        with pytest.raises(ValueError, match=r"layers \[0, 1\].*taps \[1\]"):
            speculative_decode(target, DFlashProposer(drafter), prompts[0], 4, set())
    finally:
        target.close()


def test_response_statistics():
    d = Decoded([1, 2, 3, 4, 5, 6, 7, 8], "length", 0.5, 2.0, [4, 1, 2], [3, 3, 1])
    assert d.acceptance_length == pytest.approx(7 / 3)
    assert d.per_position_acceptance(3) == [2 / 3, 1 / 2, 1 / 2]
    assert d.decode_tokens_per_s == pytest.approx(7 / 2.0)
    assert d.tokens_per_s == pytest.approx(8 / 2.5)
    assert Decoded([1], "stop", 0.1, 0.0).acceptance_length is None
