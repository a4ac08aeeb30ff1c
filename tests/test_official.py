"""The official `dflash` package (PyPI 0.1.0: the publisher's reference loader and speculative
loop) as the test of an export, in float32 on the CPU:

    Drafter --save_drafter--> <dir> --DFlash[2]DraftModel.from_pretrained--> every tensor taken
    official dflash_generate (temperature 0)  ==  the target's greedy output
    its acceptance lengths, prompt by prompt  ==  the project's Engine.dflash (DFlash)
                                              ==  `reference_decode`, an eager loop over the
                                                  project's Drafter and selector (DFlash2; the
                                                  engine has no selector yet)

`official_decode` and `reference_decode` are the helpers a decoding test reuses to compare an
engine with the reference. Where the drafter would accept nothing the comparison is vacuous, so
the target falls into runs of token 7 and the drafter is biased to draft it (as test_engine's
`runs_drafter`); `test_the_official_forward_matches_the_drafter` checks the layers themselves on
random weights.
"""

import time
from unittest import mock

import dflash.model as official
import pytest
import torch
from dflash import DFlash2DraftModel, DFlashDraftModel
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dflashpipe.decoding.engine import Engine
from dflashpipe.export import save_drafter
from dflashpipe.model import Drafter, DrafterConfig, target_context

BLOCK, TAPS, MASK, NEW = 4, [0, 1], 1, 24
SIZES = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256)  # fmt: skip
DFLASH2 = dict(architecture="dflash2", conv_group_size=16, selector_rank=8, selector_top_k=4)
_g = torch.Generator().manual_seed(0)
PROMPTS = [torch.randint(2, 320, (n,), generator=_g).tolist() for n in (5, 11, 19)]
OFFICIAL = {"dflash": DFlashDraftModel, "dflash2": DFlash2DraftModel}
# dflash_generate passes past_key_values=, which newer transformers rename (cache=) with a warning
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")


def runs_target(family: str) -> torch.nn.Module:
    """A 3-layer target (taps [0, 1] leave out its last layer) that falls into runs of token 7:
    every embedding carries a constant in dimension 0 and lm_head row 7 reads it."""
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                             "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[family]  # fmt: skip
    torch.manual_seed(0)
    model = model_cls(config_cls(**SIZES)).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 0.05
        model.lm_head.weight[7, 0] = 0.5
    return model


def make_drafter(target, architecture: str = "dflash", runs: bool = True) -> Drafter:
    """Two layers, the first with a window (6) shorter than the sequences. `runs`: the final
    norm leans on dimension 0, so drafts lean to token 7 and runs of it are accepted; else
    random norms. DFlash2's convolutions and selector get random weights (not the identity)."""
    extra = DFLASH2 if architecture == "dflash2" else {}
    config = DrafterConfig.from_target(
        target.config, mask_token_id=MASK, num_layers=2, block_size=BLOCK,
        target_layer_ids=TAPS, sliding_window=6, **extra,
    )  # fmt: skip
    torch.manual_seed(1)
    d = Drafter.from_target_model(config, target).eval()
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.0 if runs and name == "norm.weight" else 0.5, 1.0 if runs else 1.5)
            elif "_conv." in name:
                p.add_(torch.randn_like(p) * 0.2)  # no longer the identity
            elif name.startswith("candidate_selector."):
                p.normal_(0.0, 0.5 if "codebook" in name else 0.2)  # edges near the logit gaps
        if runs:
            d.norm.weight[0] = 2.0
    return d


def load_official(path, architecture: str) -> torch.nn.Module:
    """The official loader on an export: no missing, unexpected, mismatched or re-initialised
    weight (every tensor of the model equals the file's, bare codebooks included)."""
    model, info = OFFICIAL[architecture].from_pretrained(
        str(path), dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert not info["error_msgs"]
    saved = load_file(str(path / "model.safetensors"))
    state = {k.removesuffix(".weight") if "codebook" in k else k: v
             for k, v in model.state_dict().items()}  # fmt: skip
    assert state.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    return model.eval()


def official_decode(model, target, prompt: list[int], max_new_tokens: int):
    """The official `dflash_generate` at temperature 0: (new token ids, acceptance lengths).

    Shim: its `return_stats=True` (the only way to get the acceptance lengths) times with
    `torch.cuda.synchronize()`, which a CPU-only torch refuses; the clock becomes perf_counter.
    The loop shortens its last blocks to the budget (a block of fewer slots drafts other
    tokens, the block being bidirectional): compare the steps of a run given `len(block)` more
    tokens than the engine's."""
    with mock.patch.object(official, "_cuda_time", time.perf_counter):
        out = official.dflash_generate(
            model, target, torch.tensor([prompt]), max_new_tokens, None, return_stats=True
        )
    return out.output_ids[0, len(prompt) :].tolist(), out.acceptance_lengths


@torch.no_grad()
def greedy(target, prompt: list[int], n: int) -> list[int]:
    """The target's greedy continuation, one full forward per token (no cache to get wrong)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@torch.no_grad()
def reference_decode(drafter: Drafter, target, prompt: list[int], max_new_tokens: int):
    """Greedy speculative decoding the plainest way: each step one `Drafter.forward` over the
    whole sequence with one anchor at its last token (the selector's path on a DFlash2 drafter,
    else the unary argmax), verified by one full target forward. -> (new ids, acceptance lengths,
    steps where the selector's path left the unary argmax)."""
    out = greedy(target, prompt, 1)
    accepted, moved = [], 0
    while len(out) < max_new_tokens:
        seq = prompt + out  # the last token is the anchor, not yet seen by the target
        T = len(seq)
        hidden = target(torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states
        states = target_context(hidden, TAPS)[0]  # (T-1, n_taps*H)
        states = torch.cat([states, states.new_zeros(1, states.shape[1])])  # anchor's: unread
        h = drafter(torch.tensor(seq), states, torch.arange(T), torch.zeros(T, dtype=torch.long),
                    torch.tensor([T - 1]), torch.ones(1, dtype=torch.bool))[:, 1:]  # fmt: skip
        logits = drafter.lm_head(h)  # (1, B-1, V)
        drafts = logits.argmax(-1)[0]
        if drafter.config.dflash2:
            path = drafter.candidate_selector.walk(h, logits, torch.tensor(seq[-1:]))[0][0]
            moved += int(not torch.equal(path, drafts))
            drafts = path
        verify = target(torch.tensor([seq + drafts.tolist()])).logits[0, T - 1 :].argmax(-1)
        n = int((drafts == verify[:-1]).long().cumprod(0).sum())
        out += drafts[:n].tolist() + [int(verify[n])]
        accepted.append(n + 1)
    return out[:max_new_tokens], accepted, moved


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_dflash_export_decodes_in_the_official_loop_as_in_the_engine(family, tmp_path):
    target = runs_target(family)
    drafter = make_drafter(target)
    save_drafter(drafter, tmp_path)
    model = load_official(tmp_path, "dflash")
    engine = Engine(target, 64, drafter)
    longest = 1
    for prompt in PROMPTS:
        mine = engine.dflash(prompt, NEW, set())
        theirs, lengths = official_decode(model, target, prompt, NEW + BLOCK)
        assert theirs == greedy(target, prompt, NEW + BLOCK)
        assert mine.output_ids == theirs[:NEW]
        steps = len(mine.accepted_lengths)
        assert mine.accepted_lengths == lengths[:steps], prompt
        longest = max(longest, *lengths[:steps])
    assert longest == BLOCK  # drafts were accepted, up to whole blocks


def test_dflash2_export_decodes_in_the_official_loop_as_the_drafter_does(tmp_path):
    target = runs_target("llama")
    drafter = make_drafter(target, "dflash2")
    save_drafter(drafter, tmp_path)
    model = load_official(tmp_path, "dflash2")
    longest, moved = 1, 0
    for prompt in PROMPTS:
        theirs, lengths = official_decode(model, target, prompt, NEW + BLOCK)
        assert theirs == greedy(target, prompt, NEW + BLOCK)
        mine, accepted, m = reference_decode(drafter, target, prompt, NEW)
        assert mine == theirs[:NEW]
        assert accepted == lengths[: len(accepted)], prompt
        longest, moved = max(longest, *accepted), moved + m
    assert longest > 2 and moved  # drafts accepted; the selector's path left the argmax


@pytest.mark.parametrize("architecture", ["dflash", "dflash2"])
def test_the_official_forward_matches_the_drafter(architecture, tmp_path):
    """On random weights: the final states of a block after a prompt and, for DFlash2, the
    selector's path, the official model against `Drafter.forward` with one anchor."""
    target = runs_target("qwen3")
    drafter = make_drafter(target, architecture, runs=False)
    drafter.embed_scale = 8.0  # as a Gemma target's embedding module scales (sqrt(H))
    save_drafter(drafter, tmp_path)
    model = load_official(tmp_path, architecture)
    scale = official._draft_value(model.config, "input_embedding_scale", 1.0)  # its reading
    prompt = PROMPTS[2]
    P = len(prompt)
    with torch.no_grad():
        states = target_context(target(torch.tensor([prompt]), output_hidden_states=True)
                                .hidden_states, TAPS)  # fmt: skip
        block = torch.tensor([[prompt[-1]] + [MASK] * (BLOCK - 1)])
        theirs = model(position_ids=torch.arange(P - 1 + BLOCK)[None],
                       noise_embedding=official._raw_input_embeddings(target, block, scale),
                       target_hidden=states[:, : P - 1])  # fmt: skip
        mine = drafter(torch.tensor(prompt), states[0], torch.arange(P),
                       torch.zeros(P, dtype=torch.long), torch.tensor([P - 1]),
                       torch.ones(1, dtype=torch.bool))  # fmt: skip
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
        if architecture == "dflash2":
            h = mine[:, 1:]
            logits = drafter.lm_head(h)
            path, candidates, _ = drafter.candidate_selector.walk(h, logits, block[:, 0])
            their_path, their_candidates, _ = model.propose(h, block[:, 0], target.lm_head, 0.0)
            assert torch.equal(path, their_path)
            assert torch.equal(candidates.sort(-1).values, their_candidates.sort(-1).values)
