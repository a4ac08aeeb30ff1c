"""The target's folded SDPA attention (dflashpipe.attention) against K/V copied per query head."""

import pytest
import torch
import torch.nn.functional as F
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from dflashpipe import attention


def reference(q, k, v, mask):
    """The attention as transformers' eager path computes it: each KV head repeated for the
    query heads it serves (head h uses KV head h // g), then plain SDPA."""
    g = q.shape[1] // k.shape[1]
    y = F.scaled_dot_product_attention(
        q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask
    )
    return y.transpose(1, 2)


@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("mask_batch", [3, 1])
def test_folded_equals_repeated_heads(q_len, mask_batch):
    torch.manual_seed(0)
    B, Hq, Hkv, L, D = 3, 6, 2, 11, 8
    q, k, v = torch.randn(B, Hq, q_len, D), torch.randn(B, Hkv, L, D), torch.randn(B, Hkv, L, D)
    mask = torch.rand(mask_batch, 1, q_len, L) > 0.3
    mask[..., -1] = True  # every row sees at least one key
    assert attention.folds(Hq // Hkv, Hq, q_len, D, q.element_size())
    module = torch.nn.Module()
    module.num_key_value_groups = Hq // Hkv
    out, weights = attention.sdpa_folded(module, q, k, v, mask)
    assert weights is None and out.shape == (B, q_len, Hq, D)
    torch.testing.assert_close(out, reference(q, k, v, mask))
    # heads in the other order (h = r*Hkv + kv) would be another attention: the test can tell
    wrong = reference(
        q.view(B, Hq // Hkv, Hkv, q_len, D).transpose(1, 2).reshape(q.shape), k, v, mask
    )
    assert not torch.allclose(out, wrong, atol=1e-3)


def test_long_queries_are_not_folded():
    """Folding repeats the mask g times; past 2*Hq*D*itemsize query rows that costs more than the
    K/V copies it saves, so those calls stay transformers' own (same result either way)."""
    assert not attention.folds(3, 9, 2048, 64, 2)  # extract's whole sequences at SmolLM2's shape
    assert attention.folds(3, 9, 1, 64, 2) and attention.folds(3, 9, 512, 64, 2)
    assert not attention.folds(1, 8, 1, 64, 2)  # no GQA: nothing to fold


def test_names():
    assert attention.implementation("sdpa") == attention.FOLDED
    assert attention.implementation("hf_sdpa") == "sdpa"
    assert attention.implementation("eager") == "eager"
    assert "flash" not in attention.FOLDED  # transformers treats such names as flash kernels


def test_static_cache_generation_is_unchanged(monkeypatch):
    """A GQA Llama with a left-padded batch: the folded attention's logits and greedy static-cache
    answers are the eager attention's, and its decoding steps do take the folded path."""
    models = {}
    for name in ("sdpa", "eager"):
        cfg = LlamaConfig(
            vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2,
            attn_implementation=attention.implementation(name),
        )  # fmt: skip
        torch.manual_seed(0)
        models[name] = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(3, 97, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = mask[1, :2] = 0
    gen = GenerationConfig(max_new_tokens=8, do_sample=False, cache_implementation="static",
                           pad_token_id=0)  # fmt: skip
    shapes = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda q, *a, **kw: shapes.append(tuple(q.shape)) or sdpa(q, *a, **kw))  # fmt: skip
    out = {}
    with torch.no_grad():
        for name, model in models.items():
            logits = model(input_ids=ids, attention_mask=mask).logits
            out[name] = (
                logits,
                model.generate(input_ids=ids, attention_mask=mask, generation_config=gen),
            )
    valid = mask.bool()
    torch.testing.assert_close(out["sdpa"][0][valid], out["eager"][0][valid], atol=1e-5, rtol=1e-5)
    assert torch.equal(out["sdpa"][1], out["eager"][1])
    assert (3, 2, 2, 16) in shapes  # a decoding step: 2 KV heads x (2 query heads x 1 row)
