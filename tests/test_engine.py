"""Static-cache engine (decoding: engine, static_models, ddtree): the same logits, tokens and
acceptances as the eager loop (float32)."""

import copy

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import dflashpipe.decoding.ddtree  # noqa: F401 (registers the engine's "ddtree" steps)
from dflashpipe.decoding.eager import (
    DFlashProposer,
    Target,
    greedy_decode,
    speculative_decode,
)
from dflashpipe.decoding.engine import Engine
from dflashpipe.decoding.families import attend_cache, fold_mask
from dflashpipe.decoding.lookup import PromptLookupProposer
from dflashpipe.decoding.static_models import StaticDrafter, StaticTarget
from dflashpipe.model import Drafter, DrafterConfig
from dflashpipe.taps import LayerTaps

BLOCK = 4
TAPS = [0, 1]
NEW = 24
MAX_LEN = 64
SIZES = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
_g = torch.Generator().manual_seed(0)
PROMPTS = [torch.randint(2, 320, (n,), generator=_g).tolist() for n in (5, 11, 19)]
# n-grams recur in the second (doubled: 22 + NEW + drafts fit MAX_LEN, the longest doubled not)
LOOKUP_PROMPTS = [PROMPTS[0], PROMPTS[1] * 2, PROMPTS[2]]


def tiny(config_cls, model_cls, **extra):
    torch.manual_seed(0)
    return model_cls(config_cls(**SIZES, **extra)).eval()


def runs_llama() -> LlamaForCausalLM:
    """A Llama that often falls into runs of token 7: every embedding carries a constant in
    dimension 0 and lm_head row 7 reads it, so a drafter drafting 7 gets runs accepted."""
    model = tiny(LlamaConfig, LlamaForCausalLM)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 0.05
        model.lm_head.weight[7, 0] = 0.25
    return model


@pytest.fixture(scope="module")
def qwen3() -> Qwen3ForCausalLM:
    return tiny(Qwen3Config, Qwen3ForCausalLM)


def make_drafter(target, num_layers=1, seed=1, **kw) -> Drafter:
    config = DrafterConfig.from_target(
        target.config,
        mask_token_id=1,
        num_layers=num_layers,
        block_size=BLOCK,
        target_layer_ids=TAPS,
        **kw,
    )
    torch.manual_seed(seed)
    return Drafter.from_target_model(config, target).eval()


def runs_drafter(llama: LlamaForCausalLM) -> Drafter:
    """A final norm reading only dimension 0 drafts token 7 in every slot: accepted lengths then
    range from 1 to the block size with the target's output."""
    d = make_drafter(llama)
    with torch.no_grad():
        d.norm.weight.zero_()
        d.norm.weight[0] = 1.0
    return d


@pytest.fixture(scope="module")
def llama() -> LlamaForCausalLM:
    return runs_llama()


@pytest.fixture(scope="module")
def drafter(llama) -> Drafter:
    return runs_drafter(llama)


@pytest.fixture(scope="module")
def engine(llama, drafter) -> Engine:
    return Engine(llama, MAX_LEN, drafter)


def reference_taps(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF forward logits (S, V) and tapped layer outputs (S, n_taps*H), as extract taps them."""
    taps = LayerTaps(model.get_decoder(), TAPS)
    try:
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
        return logits, taps.gather()[0]
    finally:
        taps.remove()


def biased(name: str):
    """Targets whose projections carry biases (Qwen2's q/k/v; Llama with attention_bias and
    mlp_bias), so the fused q/k/v and gate/up linears must carry them too; a Qwen3 with a
    sliding-window layer (tests/test_families.py covers the other families)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if name == "qwen2":
        return tiny(Qwen2Config, Qwen2ForCausalLM)
    if name == "qwen3-sliding":  # layer 1 of 2 windowed, the window shorter than the prompt
        return tiny(Qwen3Config, Qwen3ForCausalLM, use_sliding_window=True, sliding_window=4,
                    max_window_layers=1)  # fmt: skip
    return tiny(LlamaConfig, LlamaForCausalLM, attention_bias=True, mlp_bias=True)


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen2", "llama-biased", "qwen3-sliding"])
def test_static_target_matches_the_hf_forward(request, name):
    model = request.getfixturevalue(name) if name in ("llama", "qwen3") else biased(name)
    target = StaticTarget(model, 32, TAPS)
    first = model.model.layers[0]
    qkv, qkv_bias, gate_up, _ = target.fused[0]

    # the modules' weights are views of the fused ones: no second copy of the model
    def storage(t):
        return t.untyped_storage().data_ptr()

    attn = first.self_attn
    assert {storage(attn.q_proj.weight), storage(attn.k_proj.weight)} == {storage(qkv)}
    assert storage(first.mlp.up_proj.weight) == storage(gate_up)
    assert (qkv_bias is not None) == (name in ("qwen2", "llama-biased"))
    ids = PROMPTS[1] + [3, 9, 27]
    ref_logits, ref_taps = reference_taps(model, ids)
    P = len(PROMPTS[1])
    slots = torch.arange(P)
    logits, taps = target.forward(torch.tensor(ids[:P]), slots, slots, torch.zeros(1), taps=True)
    torch.testing.assert_close(logits, ref_logits[:P], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(taps, ref_taps[:P], atol=1e-5, rtol=1e-4)
    for t in range(P, len(ids)):  # one token per step, the committed length = its slot
        slot = torch.tensor([t])
        logits, taps = target.forward(torch.tensor(ids[t : t + 1]), slot, slot, slot, taps=True)
        torch.testing.assert_close(logits[0], ref_logits[t], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(taps[0], ref_taps[t], atol=1e-5, rtol=1e-4)


def test_tree_mask_and_commit_keep_the_chosen_branch(llama):
    """Three new tokens a, b, c with b and c both children of a (same position, own slots);
    committing the path a, c leaves the cache of prefix + [a, c]."""
    target = StaticTarget(llama, 32)
    prefix, (a, b, c, x) = PROMPTS[0], (40, 41, 42, 43)
    P = len(prefix)
    slots = torch.arange(P)
    target.forward(torch.tensor(prefix), slots, slots, torch.zeros(1))
    visible = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    logits, _ = target.forward(
        torch.tensor([a, b, c]),
        torch.tensor([P, P + 1, P + 1]),  # positions: b and c are siblings
        torch.tensor([P, P + 1, P + 2]),  # slots
        torch.tensor([P]),
        visible,
    )
    for row, path in ((1, [a, b]), (2, [a, c])):
        expected, _ = reference_taps(llama, prefix + path)
        torch.testing.assert_close(logits[row], expected[-1], atol=1e-5, rtol=1e-4)
    target.commit(torch.tensor([P, P + 2]), torch.tensor([P]))  # keep a, c at P, P+1
    slot = torch.tensor([P + 2])
    logits, _ = target.forward(torch.tensor([x]), slot, slot, slot)
    expected, _ = reference_taps(llama, prefix + [a, c, x])
    torch.testing.assert_close(logits[0], expected[-1], atol=1e-5, rtol=1e-4)


def test_greedy_matches_the_eager_loop(llama, qwen3, engine):
    reference = Target(llama)
    for ids in PROMPTS:
        expected = greedy_decode(reference, ids, NEW, set())
        got = engine.greedy(ids, NEW, set())
        assert got.output_ids == expected.output_ids
        assert got.finish_reason == "length" and got.accepted_lengths == []
    stop = expected.output_ids[10]
    got = engine.greedy(ids, NEW, {stop})
    assert got.output_ids == greedy_decode(reference, ids, NEW, {stop}).output_ids
    assert got.finish_reason == "stop"
    ids = PROMPTS[2]
    got = Engine(qwen3, MAX_LEN).greedy(ids, NEW, set())
    assert got.output_ids == greedy_decode(Target(qwen3), ids, NEW, set()).output_ids


def test_dflash_matches_the_eager_loop(llama, drafter, engine):
    reference = Target(llama, TAPS)
    seen = set()
    for ids in PROMPTS:
        expected = speculative_decode(reference, DFlashProposer(drafter), ids, NEW, set())
        got = engine.dflash(ids, NEW, set())
        assert got.output_ids == expected.output_ids
        assert got.accepted_lengths == expected.accepted_lengths
        assert got.drafted == expected.drafted == [BLOCK - 1] * len(got.accepted_lengths)
        assert got.finish_reason == expected.finish_reason
        seen |= set(got.accepted_lengths)
    assert {1, BLOCK} <= seen and len(seen) > 2  # rejections, full blocks and partial ones
    stop = expected.output_ids[-5]
    expected = speculative_decode(reference, DFlashProposer(drafter), ids, NEW, {stop})
    got = engine.dflash(ids, NEW, {stop})
    assert (got.output_ids, got.accepted_lengths) == (
        expected.output_ids,
        expected.accepted_lengths,
    )
    assert got.finish_reason == "stop"


@pytest.mark.parametrize("num_drafts", [3, 10])
def test_prompt_lookup_matches_the_eager_loop(llama, engine, num_drafts):
    """Fixed-shape verify of padded host drafts: the eager loop's tokens, acceptances and
    proposal counts (empty proposals included), on prompts whose n-grams recur."""
    reference = Target(llama)
    seen = set()
    for ids in LOOKUP_PROMPTS:
        expected = speculative_decode(reference, PromptLookupProposer(num_drafts), ids, NEW, set())
        got = engine.lookup(ids, NEW, set(), PromptLookupProposer(num_drafts))
        assert (got.output_ids, got.accepted_lengths, got.drafted) == (
            expected.output_ids,
            expected.accepted_lengths,
            expected.drafted,
        )
        seen |= set(got.drafted)
    assert 0 in seen and max(seen) == num_drafts  # target-only steps and full proposals
    assert engine.captures == {}  # no graphs on the CPU
    with pytest.raises(ValueError, match="max_len 64"):
        engine.lookup(PROMPTS[2], MAX_LEN - 20, set(), PromptLookupProposer(num_drafts))


@pytest.fixture(scope="module")
def greedy_outputs(llama) -> list[list[int]]:
    return [greedy_decode(Target(llama), ids, NEW, set()).output_ids for ids in PROMPTS]


@pytest.mark.parametrize("budget", [1, 4, 16])
def test_ddtree_matches_greedy_decoding(llama, engine, greedy_outputs, budget):
    reference = Target(llama)
    for ids, expected in zip(PROMPTS, greedy_outputs, strict=True):
        got = engine.ddtree(ids, NEW, set(), budget, 8)
        assert got.output_ids == expected and got.finish_reason == "length"
        assert sum(got.accepted_lengths) >= NEW - 1  # the prefill made the first token
        assert all(1 <= n <= min(budget, BLOCK - 1) + 1 for n in got.accepted_lengths)
        assert got.drafted == [budget] * len(got.accepted_lengths)  # 8 + 8^2 + 8^3 >= 16
    stop = expected[-5]
    got = engine.ddtree(ids, NEW, {stop}, budget, 8)
    assert got.output_ids == greedy_decode(reference, ids, NEW, {stop}).output_ids
    assert got.finish_reason == "stop"


def test_ddtree_chain_accepts_as_dflash_and_a_wider_tree_no_less(llama, drafter, engine):
    """top_k 1 and budget B-1: the tree is the DFlash chain. With a confident drafter (the same
    drafts, sharper log-probs) the chain is inside the budget-16 tree, so tau does not drop."""
    for ids in PROMPTS:
        chain = engine.ddtree(ids, NEW, set(), BLOCK - 1, 1)
        assert chain.accepted_lengths == engine.dflash(ids, NEW, set()).accepted_lengths
    sure = copy.deepcopy(drafter)
    with torch.no_grad():
        sure.norm.weight[0] = 30.0
    confident = Engine(llama, MAX_LEN, sure)
    for ids in PROMPTS:
        dflash = confident.dflash(ids, NEW, set())
        trees = {b: confident.ddtree(ids, NEW, set(), b, 8) for b in (1, 16)}
        assert trees[16].acceptance_length >= dflash.acceptance_length - 1e-9
        assert trees[16].acceptance_length >= trees[1].acceptance_length - 1e-9
        assert trees[16].output_ids == dflash.output_ids


def test_ddtree_refuses_what_does_not_fit(llama, drafter):
    small = Engine(llama, 24, drafter)
    with pytest.raises(ValueError, match=r"prompt length 12 .* budget 8 \(evaluate.tree_nodes\)"):
        small.ddtree(list(range(2, 14)), 4, set(), 8, 4)
    with pytest.raises(ValueError, match="budget 0 .*evaluate.tree_nodes.* >= 1"):
        small.ddtree([2, 3], 4, set(), 0, 4)
    with pytest.raises(ValueError, match="evaluate.tree_top_k"):
        small.ddtree([2, 3], 4, set(), 4, 0)
    assert len(small.ddtree(list(range(2, 14)), 3, set(), 8, 4).output_ids) == 3  # 12+3+9 fits
    with pytest.raises(ValueError, match="without a drafter"):
        Engine(llama, 16).ddtree([2, 3], 4, set(), 4, 2)


@pytest.mark.parametrize("sliding", [False, True])
def test_drafter_slot_logits_match_the_proposer(llama, sliding):
    kw = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5}
    drafter = make_drafter(llama, num_layers=2, seed=2, **(kw if sliding else {}))
    g = torch.Generator().manual_seed(0)
    states = torch.randn(11, 2 * SIZES["hidden_size"], generator=g)
    anchor = 77
    proposer = DFlashProposer(drafter)
    proposer.start([0] * 6, states[:6])
    proposer.advance(states[6:9])
    proposer.advance(states[9:])
    with torch.inference_mode():
        expected = drafter.lm_head(proposer.block_states(anchor))[1:]  # (B-1, V)
    static = StaticDrafter(drafter, 32)
    static.append(states[:6], 0)
    # A verify appends all B rows; the unaccepted ones past the length must not matter.
    static.append(torch.cat([states[6:9], torch.randn(1, states.shape[1], generator=g)]), 6)
    static.append(torch.cat([states[9:], torch.randn(2, states.shape[1], generator=g)]), 9)
    length, anchor_t = torch.tensor([11]), torch.tensor([anchor])
    got = drafter.lm_head(drafter.norm(static.block_rows(anchor_t, length))[1:])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    assert static.propose(anchor_t, length).tolist() == expected.argmax(-1).tolist()
    logprobs, ids, _ = static.top_k(anchor_t, length, 3)
    ref_logprobs, ref_ids = torch.log_softmax(expected, -1).topk(3, dim=-1)
    assert ids.tolist() == ref_ids.tolist()
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=1e-4)


def test_refuses_what_does_not_fit(llama, drafter):
    small = Engine(llama, 16, drafter)
    with pytest.raises(ValueError, match="prompt length 12 .* block_size 4 = 20 .* max_len 16"):
        small.dflash(list(range(2, 14)), 4, set())
    with pytest.raises(ValueError, match="prompt length 17 .* max_len 16"):
        small.greedy(list(range(2, 19)), 1, set())
    assert len(small.greedy(list(range(2, 14)), 4, set()).output_ids) == 4  # 12 + 4 fits
    with pytest.raises(ValueError, match="block_size 4 does not fit max_len 4"):
        Engine(llama, 4, drafter)
    with pytest.raises(ValueError, match="without a drafter"):
        Engine(llama, 16).dflash([2, 3], 4, set())


def test_refuses_unsupported_targets():
    dynamic = tiny(
        LlamaConfig, LlamaForCausalLM, rope_parameters={"rope_type": "dynamic", "factor": 2.0}
    )
    with pytest.raises(ValueError, match="llama target uses rope_type 'dynamic'"):
        StaticTarget(dynamic, 32)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="not 'gpt2'"):
        StaticTarget(gpt2, 32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_replay_the_eager_steps(llama, drafter):
    model = copy.deepcopy(llama).cuda()
    d = make_drafter(model)
    d.load_state_dict(drafter.state_dict())
    d = d.cuda()
    eager = Engine(model, MAX_LEN, d, graphs=False)
    graphed = Engine(model, MAX_LEN, d)
    assert graphed.graphs
    for k, ids in enumerate(PROMPTS):
        assert (
            graphed.greedy(ids, NEW, set()).output_ids == eager.greedy(ids, NEW, set()).output_ids
        )
        want, got = eager.dflash(ids, NEW, set()), graphed.dflash(ids, NEW, set())
        assert (got.output_ids, got.accepted_lengths) == (want.output_ids, want.accepted_lengths)
        want, got = (
            e.lookup(LOOKUP_PROMPTS[k], NEW, set(), PromptLookupProposer(3))
            for e in (eager, graphed)
        )
        assert (got.output_ids, got.drafted) == (want.output_ids, want.drafted)
        for budget in (4, 16):
            want, got = (e.ddtree(ids, NEW, set(), budget, 8) for e in (eager, graphed))
            assert (got.output_ids, got.accepted_lengths) == (
                want.output_ids,
                want.accepted_lengths,
            )
    assert graphed.captures == {
        "greedy": 1, "dflash": 1, "lookup@3": 1, "tree@4k8": 1, "tree@16k8": 1,
    }  # fmt: skip
    assert eager.captures == {}


def test_compiled_layers_decode_as_the_eager_ones(llama, drafter, engine):
    """The layer functions compiled (as on a GPU, where graphs capture them) give the same
    tokens and acceptances as the uncompiled engine; a prefill stays eager whatever its length."""
    compiled = Engine(llama, MAX_LEN, drafter, compile=True)
    assert compiled.compiled and not compiled.graphs and not engine.compiled
    for ids in PROMPTS[:2]:
        want, got = (e.greedy(ids, NEW, set()) for e in (engine, compiled))
        assert got.output_ids == want.output_ids
        for method, args in (("dflash", ()), ("ddtree", (4, 2))):
            want, got = (getattr(e, method)(ids, NEW, set(), *args) for e in (engine, compiled))
            assert (got.output_ids, got.accepted_lengths) == (
                want.output_ids,
                want.accepted_lengths,
            )
            assert max(got.accepted_lengths) > 1  # drafts were accepted: the verify path ran


def test_compiled_attention_equals_sdpa_under_a_folded_mask():
    """The compiled path's plain-op attention (families.attend_cache) against SDPA's, GQA
    folded, a causal-plus-prefix mask in which padding slots past the valid length stay hidden."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 6, 5, 16, generator=g)  # 6 query heads over 2 KV heads, 5 new rows
    k, v = (torch.randn(1, 2, 32, 16, generator=g) for _ in range(2))
    valid = torch.arange(32)[None, :] < 20 + torch.arange(5)[:, None] + 1  # row i sees 0..20+i
    mask = fold_mask(valid, 3)
    compiled = torch.compile(attend_cache, fullgraph=True)
    want = attend_cache(q, k, v, mask, 0.3)
    torch.testing.assert_close(compiled(q, k, v, mask, 0.3), want)
    k[:, :, 25:] = 1e4  # slots no row sees: a leak would move every output
    for fn in (attend_cache, compiled):
        torch.testing.assert_close(fn(q, k, v, mask, 0.3), want)


def test_a_windowed_drafter_proposes_as_the_eager_one_past_its_window(llama):
    """drafter.sliding_window alone (the window on every layer but the last) over 40 positions of
    context, 8 times its window: at every step the static engine's slot logits are the eager
    proposer's (float32)."""
    drafter = make_drafter(llama, num_layers=3, seed=3, sliding_window=5)
    assert [layer.self_attn.sliding_window for layer in drafter.layers] == [5, 5, None]
    g = torch.Generator().manual_seed(1)
    states = torch.randn(40, 2 * SIZES["hidden_size"], generator=g)
    proposer, static = DFlashProposer(drafter), StaticDrafter(drafter, 64)
    for start, end in [(0, 10), (10, 17), (17, 29), (29, 40)]:  # accepted runs of several lengths
        if start == 0:
            proposer.start([0] * end, states[:end])
        else:
            proposer.advance(states[start:end])
        static.append(states[start:end], start)
        anchor, length = torch.tensor([7 * end]), torch.tensor([end])
        with torch.inference_mode():
            expected = drafter.lm_head(proposer.block_states(7 * end))[1:]  # (B-1, V)
            got = drafter.lm_head(drafter.norm(static.block_rows(anchor, length))[1:])
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
        assert static.propose(anchor, length).tolist() == expected.argmax(-1).tolist()


def test_a_dflash2_drafter_decodes_as_the_official_loop_at_c_1_and_in_rows(tmp_path):
    """A DFlash2 drafter (random convolutions and selector, not the identity) exported and run
    by the official package's loop at temperature 0: the engine at c = 1 and the concurrent
    engine at 2 rows give the target's greedy tokens and, prompt by prompt, its acceptance
    lengths; the selector's walk left the unary argmax on some step (so the test would see a
    drafter that ignored it), and drafts were accepted."""
    import test_official as case

    from dflashpipe.decoding.concurrent import ConcurrentEngine
    from dflashpipe.export import save_drafter

    target = case.runs_target("llama")
    drafter = case.make_drafter(target, "dflash2")
    save_drafter(drafter, tmp_path)
    official = case.load_official(tmp_path, "dflash2")
    engine = Engine(target, 64, drafter)
    rows, _ = ConcurrentEngine(engine, 2).decode("dflash", case.PROMPTS, case.NEW, set())
    moved = 0
    for prompt, row in zip(case.PROMPTS, rows, strict=True):
        mine = engine.dflash(prompt, case.NEW, set())
        theirs, lengths = case.official_decode(official, target, prompt, case.NEW + case.BLOCK)
        assert mine.output_ids == theirs[: case.NEW] == row.output_ids
        steps = len(mine.accepted_lengths)
        assert mine.accepted_lengths == lengths[:steps] == row.accepted_lengths, prompt
        moved += case.reference_decode(drafter, target, prompt, case.NEW)[2]
    assert moved and max(n for d in rows for n in d.accepted_lengths) > 2


def test_a_dflash2_drafter_proposes_its_selectors_walk():
    """The static drafter's chain on a DFlash2 drafter (random convolutions and selector) is the
    selector's greedy walk from the anchor over the drafter's own forward (float32), for several
    anchors; and on some of them that walk is not the unary argmax, so a drafter that skipped
    the selector (or a convolution) would fail here."""
    import test_official as case

    target = case.runs_target("llama")
    drafter = case.make_drafter(target, "dflash2", runs=False)
    H = target.config.hidden_size
    g = torch.Generator().manual_seed(2)
    T = 12
    states = torch.randn(T - 1, len(case.TAPS) * H, generator=g)
    static = StaticDrafter(drafter, 64)
    static.append(states, 0)
    moved = 0
    for anchor in range(20, 320, 15):
        ids = torch.randint(2, 320, (T,), generator=g)
        ids[-1] = anchor
        with torch.no_grad():
            h = drafter(ids, torch.cat([states, states.new_zeros(1, states.shape[1])]),
                        torch.arange(T), torch.zeros(T, dtype=torch.long), torch.tensor([T - 1]),
                        torch.ones(1, dtype=torch.bool))[:, 1:]  # fmt: skip
            logits = drafter.lm_head(h)
            want = drafter.candidate_selector.walk(h, logits, torch.tensor([anchor]))[0][0]
        got = static.propose(torch.tensor([anchor]), torch.tensor([T - 1]))
        assert torch.equal(got, want), anchor
        moved += int(not torch.equal(want, logits[0].argmax(-1)))
    assert moved


def test_ddtree_on_a_dflash2_drafter_grows_its_selectors_tree_and_stays_lossless():
    """DDTree on a DFlash2 drafter (random convolutions and selector): the output is the target's
    greedy one at two budgets; every step's tree is grow_tree over the drafter's candidates with
    its selector scoring the edges (recorded where the step calls it), and on some step that
    tree is not the unary one, so a tree that ignored the selector would fail here."""
    import test_official as case

    from dflashpipe.decoding.tree_search import grow_tree

    target = case.runs_target("llama")
    drafter = case.make_drafter(target, "dflash2")
    engine = Engine(target, 64, drafter)
    steps = engine.family("ddtree")
    calls = []

    def recorded(*args):
        tree = grow_tree(*args)
        calls.append((args, tree))
        return tree

    steps.grow = recorded
    differs = 0
    for prompt in case.PROMPTS:
        want = engine.greedy(prompt, case.NEW, set()).output_ids
        for budget in (4, 12):
            calls.clear()
            got = engine.ddtree(prompt, case.NEW, set(), budget, 3)
            assert got.output_ids == want, (prompt, budget)
            for (lp, ids, n, selector, hidden, _anchor), tree in calls:
                assert selector is drafter.candidate_selector and hidden.shape[0] == lp.shape[0]
                unary = grow_tree(lp, ids, n)
                differs += any(not torch.equal(getattr(tree, f), getattr(unary, f))
                               for f in ("tokens", "parents"))  # fmt: skip
    assert differs


def test_evaluate_selector_false_decodes_a_dflash2_drafter_from_its_unary_logits():
    """evaluate.selector false (runner.Decoders): the DFlash2 drafter's chain drafts the unary
    argmax and its DDTree is the unary tree, both still the target's greedy output; unset (true),
    the selector walks the chain and scores the tree."""
    import test_official as case

    from dflashpipe.decoding.layers import selected
    from dflashpipe.decoding.runner import Decoders

    target = case.runs_target("llama")
    prompt = case.PROMPTS[1]
    for on in (True, False):
        drafter = case.make_drafter(target, "dflash2")
        walker = drafter.candidate_selector
        d = Decoders(target, drafter, ["dflash", "ddtree"], "auto", 64, [6], 3, selector=on)
        assert d.engine.family("ddtree").selector is (walker if on else None)
        assert (drafter.candidate_selector is not None) == on  # what the chain's step reads
        greedy = d.decode("target", prompt, case.NEW, set()).output_ids
        for method in ("dflash", "ddtree@6"):
            assert d.decode(method, prompt, case.NEW, set()).output_ids == greedy, (on, method)
    # the chain's drafts without it are the unary argmax, and they differ from the walk's
    torch.manual_seed(0)
    h, anchor = torch.randn(64, 3, drafter.config.hidden_size), torch.randint(0, 100, (64,))
    with torch.no_grad():
        unary = selected(drafter, h, anchor)
        assert torch.equal(unary, drafter.lm_head(h).argmax(-1))
        drafter.candidate_selector = walker
        assert not torch.equal(selected(drafter, h, anchor), unary)
