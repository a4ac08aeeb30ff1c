"""The drafter: config derived from the target, no leaks, published layer math, gradients."""

import math
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from dflashpipe.errors import ConfigError
from dflashpipe.loss import block_labels, dflash_loss
from dflashpipe.model import Drafter, DrafterConfig, default_target_layer_ids, target_context

V, H, MASK = 128, 64, 127
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def tiny_target(**overrides) -> LlamaConfig:
    kw = dict(num_hidden_layers=6, hidden_size=H, num_attention_heads=4, num_key_value_heads=2)
    kw.update(vocab_size=V, intermediate_size=96, max_position_embeddings=256, rms_norm_eps=1e-5)
    kw.update(rope_parameters=dict(LLAMA3_ROPE))
    return LlamaConfig(**(kw | overrides))


def tiny_drafter(learned_mask: bool = False, seed: int = 0) -> Drafter:
    config = DrafterConfig.from_target(
        tiny_target(),
        mask_token_id=MASK,
        num_layers=2,
        block_size=4,
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=3,
        learned_mask_embedding=learned_mask,
    )
    g = torch.Generator().manual_seed(seed)
    embed, head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 0.2
    torch.manual_seed(seed)
    return Drafter(config, embed, head)


def packed(seed: int = 0) -> dict:
    """Two documents (10 and 14 tokens) in one stream; the first 3 tokens of each are prompt."""
    g = torch.Generator().manual_seed(seed)
    docs = torch.tensor([0] * 10 + [1] * 14)
    positions = torch.cat([torch.arange(10), torch.arange(14)])
    return {
        "input_ids": torch.randint(0, MASK, (24,), generator=g),
        "target_hidden": torch.randn(24, 2 * H, generator=g),
        "position_ids": positions,
        "document_ids": docs,
        "loss_mask": (positions >= 3).long(),
    }


def run(drafter: Drafter, batch: dict, anchors: list[int], **kw) -> torch.Tensor:
    anchors_t = torch.tensor(anchors)
    keep = torch.ones(len(anchors), dtype=torch.bool)
    inputs = {k: v for k, v in batch.items() if k != "loss_mask"}
    return drafter(**inputs, anchors=anchors_t, keep=keep, **kw)


def test_default_target_layer_ids_follow_the_published_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    qwen3_8b = Qwen3Config(  # Qwen3-8B's layer count, tiny widths
        num_hidden_layers=36, hidden_size=64, num_attention_heads=4, num_key_value_heads=2
    )
    assert DrafterConfig.from_target(qwen3_8b, mask_token_id=3).target_layer_ids == [
        1,
        9,
        17,
        25,
        33,
    ]
    assert default_target_layer_ids(30, 1) == [15]


def test_config_takes_sizes_and_rope_scaling_from_the_target():
    c = DrafterConfig.from_target(tiny_target(), mask_token_id=MASK, num_layers=3, block_size=8)
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        64,
        4,
        2,
        16,
    )
    assert (c.intermediate_size, c.rms_norm_eps, c.max_position_embeddings) == (96, 1e-5, 256)
    assert c.rope_parameters == LLAMA3_ROPE
    assert c.target_layer_ids == [1, 2, 3] and c.layer_types == ["full_attention"] * 3
    assert c.to_qwen3_config().rope_parameters == LLAMA3_ROPE


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"target_layer_ids": [1, 6]}, r"target_layer_ids \[1, 6\]"),
        ({"layer_types": ["sliding_attention"] * 5}, "sliding_window > 0, got None"),
        ({"layer_types": ["full_attention"]}, "layer_types has 1 entries"),
        ({"mask_token_id": 128}, "mask_token_id 128"),
        ({"architecture": "eagle3"}, "architecture 'eagle3' is not one of"),
        ({"architecture": "dflash2", "conv_group_size": 24}, "conv_group_size 24 does not divide"),
        ({"architecture": "dflash2", "selector_top_k": 129}, "selector_top_k 129 is above"),
        ({"architecture": "dflash2", "selector_rank": 0}, "selector_rank must be >= 1"),
    ],
)
def test_config_errors_name_the_value(kw, message):
    with pytest.raises(ConfigError, match=message):
        DrafterConfig.from_target(tiny_target(), **({"mask_token_id": MASK} | kw))


def test_rope_matches_transformers_and_stays_float32():
    d = tiny_drafter()
    positions = torch.arange(200)
    ref_cos, ref_sin = Qwen3RotaryEmbedding(d.config.to_qwen3_config())(
        torch.zeros(1, dtype=torch.float32), positions[None]
    )
    cos, sin = d.rotary_emb(positions)
    torch.testing.assert_close(cos, ref_cos[0])
    torch.testing.assert_close(sin, ref_sin[0])
    d.to(torch.bfloat16)
    assert d.rotary_emb.inv_freq.dtype == torch.float32
    torch.testing.assert_close(d.rotary_emb(positions)[0], cos)


def reference_block(d: Drafter, ids, hidden, a: int) -> torch.Tensor:
    """The published single-sequence computation: context = the target states before a, RoPE
    positions 0..a+B-1 from transformers' own class, full layers bidirectional, sliding layers
    causal over [context ; block] within the window."""
    B, nh, nkv, hd = 4, 4, 2, 16
    ctx = d.hidden_norm(d.fc(hidden[:a]))  # (a, H)
    x = d.embed_tokens(torch.tensor([int(ids[a])] + [MASK] * (B - 1)))  # (B, H)
    pos = torch.arange(a + B)
    cos, sin = Qwen3RotaryEmbedding(d.config.to_qwen3_config())(x[None], pos[None])
    cos, sin = cos[0], sin[0]

    def rot(t, c, s):
        half = t.shape[-1] // 2
        return t * c + torch.cat([-t[..., half:], t[..., :half]], -1) * s

    for layer in d.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        kv = torch.cat([ctx, h])
        q = rot(attn.q_norm(attn.q_proj(h).view(B, nh, hd)).transpose(0, 1), cos[a:], sin[a:])
        k = rot(attn.k_norm(attn.k_proj(kv).view(a + B, nkv, hd)).transpose(0, 1), cos, sin)
        v = attn.v_proj(kv).view(a + B, nkv, hd).transpose(0, 1)
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        scores = q @ k.transpose(1, 2) / math.sqrt(hd)  # (nh, B, a+B)
        if attn.sliding_window is not None:
            qpos, kpos = pos[a:, None], pos[None, :]
            scores = scores.masked_fill(~((kpos <= qpos) & (qpos - kpos < 3)), float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(0, 1).reshape(B, nh * hd)
        x = x + attn.o_proj(y)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return d.norm(x)


def test_packed_blocks_match_the_published_single_sequence_form():
    d, batch = tiny_drafter(), packed()
    anchors = [5, 8, 13, 19]  # two blocks per document; 13 is position 3 of document 1
    out = run(d, batch, anchors)
    doc1 = slice(10, 24)
    for b, a in enumerate(anchors):
        if a < 10:
            ref = reference_block(d, batch["input_ids"], batch["target_hidden"], a)
        else:
            ref = reference_block(d, batch["input_ids"][doc1], batch["target_hidden"][doc1], a - 10)
        torch.testing.assert_close(out[b], ref, atol=2e-5, rtol=1e-4)


def test_no_leak_from_the_future_or_other_documents():
    d, batch = tiny_drafter(), packed()
    anchors = [5, 8, 13, 19]
    base = d.lm_head(run(d, batch, anchors))  # (A, B, V)
    stream = torch.arange(24)
    g = torch.Generator().manual_seed(1)
    for b, a in enumerate(anchors):
        doc = batch["document_ids"][a]
        other = batch["document_ids"] != doc
        changed = dict(batch)
        ids = batch["input_ids"].clone()
        later_ids = (stream > a) | other  # x_a itself is the block's given first token
        ids[later_ids] = torch.randint(0, MASK, (int(later_ids.sum()),), generator=g)
        hidden = batch["target_hidden"].clone()
        later_states = (stream >= a) | other  # the state at a already encodes x_{a+1}
        hidden[later_states] = torch.randn(int(later_states.sum()), 2 * H, generator=g)
        changed.update(input_ids=ids, target_hidden=hidden)
        out = d.lm_head(run(d, changed, anchors))
        torch.testing.assert_close(out[b], base[b], atol=1e-5, rtol=0)

        # The control: the state just before the anchor is context and must matter.
        hidden = batch["target_hidden"].clone()
        hidden[a - 1] += 1.0
        changed.update(input_ids=batch["input_ids"], target_hidden=hidden)
        assert (d.lm_head(run(d, changed, anchors))[b] - base[b]).abs().max() > 1e-3


def test_flex_and_sdpa_paths_agree():
    d, batch = tiny_drafter(), packed()
    anchors = [3, 5, 8, 13, 16, 19]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex on CPU warns that it is unfused
        flex = run(d, batch, anchors, backend="flex")
        sdpa = run(d, batch, anchors, backend="sdpa")
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=1e-5)


def six_blocks_loss(d: Drafter, batch: dict) -> tuple:
    """The drafter over six blocks of `batch` (block size 4): anchors, hidden, labels and the
    decay-weighted loss (gamma 4), for the gradient tests."""
    anchors = torch.tensor([3, 5, 8, 13, 16, 19])
    keep = torch.ones(6, dtype=torch.bool)
    hidden = run(d, batch, anchors.tolist())
    labels, valid = block_labels(
        batch["input_ids"], batch["document_ids"], batch["loss_mask"], anchors, keep, 4
    )
    loss, _ = dflash_loss(hidden, d.lm_head.weight, labels, valid, gamma=4.0)
    return anchors, hidden, labels, loss


@pytest.mark.parametrize("learned_mask", [False, True])
def test_gradients_reach_every_trainable_parameter_and_no_frozen_one(learned_mask):
    d, batch = tiny_drafter(learned_mask=learned_mask), packed()
    loss = six_blocks_loss(d, batch)[-1]
    loss.backward()
    frozen = {"embed_tokens.weight", "lm_head.weight"}
    params = dict(d.named_parameters())
    assert ("mask_embedding" in params) == learned_mask
    for name, p in params.items():
        if name in frozen:
            assert not p.requires_grad and p.grad is None, name
        else:
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_drafter_takes_the_target_embedding_and_head_without_copying():
    target = Qwen3ForCausalLM(
        Qwen3Config(
            num_hidden_layers=4,
            hidden_size=H,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=V,
            intermediate_size=96,
        )
    )
    config = DrafterConfig.from_target(target.config, mask_token_id=MASK, num_layers=1)
    d = Drafter.from_target_model(config, target)
    assert d.embed_tokens.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    assert d.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    assert not d.embed_tokens.weight.requires_grad and not d.lm_head.weight.requires_grad
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in d.trainable_state_dict())


def test_wrong_embedding_shape_is_named():
    config = DrafterConfig.from_target(tiny_target(), mask_token_id=MASK, num_layers=1)
    with pytest.raises(ValueError, match=r"embed_weight has shape \(100, 64\)"):
        Drafter(config, torch.zeros(100, H), torch.zeros(V, H))


def test_target_context_takes_the_outputs_of_the_tapped_layers_in_order():
    torch.manual_seed(0)
    target = LlamaForCausalLM(tiny_target()).eval()
    outputs = {}
    for i, layer in enumerate(target.model.layers):
        layer.register_forward_hook(
            lambda m, args, out, i=i: outputs.__setitem__(
                i, out[0] if isinstance(out, tuple) else out
            )
        )
    with torch.no_grad():
        hs = target(torch.randint(0, V, (1, 9)), output_hidden_states=True).hidden_states
    ctx = target_context(hs, [3, 1])
    assert ctx.shape == (1, 9, 2 * H)
    torch.testing.assert_close(ctx[..., :H], outputs[3])
    torch.testing.assert_close(ctx[..., H:], outputs[1])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_init_from_target_layers_copies_the_last_layers(family):
    from dflashpipe.model import init_from_target_layers

    torch.manual_seed(1)
    if family == "llama":
        target = LlamaForCausalLM(tiny_target())
    else:
        tc = tiny_target()
        target = Qwen3ForCausalLM(Qwen3Config(**{k: getattr(tc, k) for k in (
            "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "intermediate_size", "max_position_embeddings", "rms_norm_eps")}))  # fmt: skip
    with torch.no_grad():  # norms start as ones in HF: make them tell layers apart
        for name, p in target.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    config = DrafterConfig.from_target(target.config, mask_token_id=MASK, num_layers=2)
    drafter = Drafter.from_target_model(config, target)
    fc_before = drafter.fc.weight.clone()
    assert init_from_target_layers(drafter, target) == [4, 5]
    for i, j in ((0, 4), (1, 5)):
        mine, theirs = drafter.layers[i].state_dict(), target.model.layers[j].state_dict()
        for name in ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight",
                     "input_layernorm.weight", "post_attention_layernorm.weight"):  # fmt: skip
            assert torch.equal(mine[name], theirs[name]), (i, name)
        q_norm = mine["self_attn.q_norm.weight"]
        if family == "llama":  # no per-head norms there: they stay ones
            assert torch.equal(q_norm, torch.ones_like(q_norm))
        else:
            assert torch.equal(q_norm, theirs["self_attn.q_norm.weight"])
    assert torch.equal(drafter.norm.weight, target.model.norm.weight)
    assert torch.equal(drafter.fc.weight, fc_before)
    too_many = DrafterConfig.from_target(target.config, mask_token_id=MASK, num_layers=7)
    with pytest.raises(ConfigError, match="num_layers <= the target's 6 layers, got 7"):
        init_from_target_layers(Drafter.from_target_model(too_many, target), target)


def windowed(window: int | None, seed: int = 0) -> Drafter:
    """A 3-layer drafter with `window` (by the rule: every layer but the last) and the weights
    of `seed`, the same for every window."""
    config = DrafterConfig.from_target(
        tiny_target(),
        mask_token_id=MASK,
        num_layers=3,
        block_size=4,
        target_layer_ids=[1, 3],
        sliding_window=window,
    )
    g = torch.Generator().manual_seed(seed)
    embed, head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 0.2
    torch.manual_seed(seed)
    return Drafter(config, embed, head)


def test_the_window_cuts_context_only_where_it_is_longer():
    """Same weights, windows 6 and 1000: a block whose context fits in 6 positions gets the same
    output, one with 30 positions of context does not; full attention differs from both (its
    blocks are also bidirectional, not causal)."""
    assert windowed(6).config.layer_types == ["sliding_attention"] * 2 + ["full_attention"]
    assert windowed(None).config.layer_types == ["full_attention"] * 3
    g = torch.Generator().manual_seed(1)
    stream = {
        "input_ids": torch.randint(0, MASK, (40,), generator=g),
        "target_hidden": torch.randn(40, 2 * H, generator=g),
        "position_ids": torch.arange(40),
        "document_ids": torch.zeros(40, dtype=torch.long),
    }
    outs = {}
    for window in (6, 1000, None):
        with torch.no_grad():
            outs[window] = run(windowed(window), stream, [2, 30])  # (2 blocks, B, H)
    torch.testing.assert_close(outs[6][0], outs[1000][0])  # context 0..1: inside both windows
    assert (outs[6][1] - outs[1000][1]).abs().max() > 1e-3  # context 0..29: cut at 6
    assert (outs[None][0] - outs[1000][0]).abs().max() > 1e-3


def dflash2_drafter(identity: bool = True, seed: int = 0) -> Drafter:
    """tiny_drafter's shape and seed as DFlash2 (groups of 16, rank 8, top 4); `identity`: as
    initialised, else random convolutions (tap 1 reads the slot before) and selector."""
    d = tiny_drafter(seed=seed)
    config = d.config.__class__(**{**d.config.__dict__, "architecture": "dflash2",
                                   "selector_rank": 8, "selector_top_k": 4})  # fmt: skip
    torch.manual_seed(seed)
    d2 = Drafter(config, d.embed_tokens.weight, d.lm_head.weight)
    if not identity:
        with torch.no_grad():
            for name, p in d2.named_parameters():
                if "_conv." in name or name.startswith("candidate_selector."):
                    p.normal_(0.0, 0.3)
    return d2


def test_dflash2_at_step_0_is_the_dflash_drafter():
    d, d2, batch = tiny_drafter(), dflash2_drafter(), packed()
    mine = d2.state_dict()
    for name, tensor in d.state_dict().items():  # the same backbone from the same seed
        assert torch.equal(mine[name], tensor), name
    names = {
        n.split(".", 2)[-1] if n.startswith("layers.") else n
        for n in set(mine) - set(d.state_dict())
    }
    assert names == {
        "attention_conv.base_kernel", "attention_conv.kernel_projection.weight",
        "mlp_conv.base_kernel", "mlp_conv.kernel_projection.weight",
        "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
        "candidate_selector.hidden_projection.weight",
    }  # fmt: skip
    anchors = [3, 5, 8, 13, 16, 19]
    with torch.no_grad():
        hidden = run(d2, batch, anchors)
        assert torch.equal(hidden, run(d, batch, anchors))  # identity convolutions, exactly
        logits = d2.lm_head(hidden[:, 1:])
        anchor_ids = batch["input_ids"][torch.tensor(anchors)]
        path, _, scores = d2.candidate_selector.walk(hidden[:, 1:], logits, anchor_ids)
    assert torch.equal(path, logits.argmax(-1))  # zero successor codebook: the unary argmax
    assert torch.equal(scores, logits.topk(4, dim=-1).values)


def test_selector_walk_is_the_slot_by_slot_greedy_path():
    """walk computes every edge it can take before it starts (fewer kernels in the decoding
    step); its path and scores are still the greedy walk slot by slot: each slot's unary top K plus the edges from
    the token chosen before (edge_scores), the anchor before slot 1."""
    from dflashpipe.dflash2 import CandidateSelector

    torch.manual_seed(0)
    sel = CandidateSelector(hidden_size=24, vocab_size=50, rank=8, top_k=5)
    with torch.no_grad():
        for p in sel.parameters():
            p.normal_(0, 1.0)  # edges as large as the logits' gaps: the path leaves the argmax
        hidden, logits = torch.randn(3, 6, 24), torch.randn(3, 6, 50)
        anchor = torch.randint(0, 50, (3,))
        path, candidates, scores = sel.walk(hidden, logits, anchor)
        previous = anchor
        for p in range(6):
            unary, ids = logits[:, p].topk(5, dim=-1)
            s = unary + sel.edge_scores(hidden[:, p], previous, ids)
            torch.testing.assert_close(scores[:, p], s)
            previous = ids.gather(-1, s.argmax(-1, keepdim=True))[:, 0]
            assert torch.equal(path[:, p], previous)
    assert not torch.equal(path, logits.argmax(-1))


def test_dflash2_convolutions_never_read_across_a_block():
    """Packed blocks side by side in one forward, each block alone: the same states. A tap that
    read the slot before across a boundary would feed block b's last slot into block b+1."""
    d, batch = dflash2_drafter(identity=False), packed()
    anchors = [3, 5, 8, 13, 16, 19]
    with torch.no_grad():
        together = run(d, batch, anchors)
        for b, a in enumerate(anchors):
            torch.testing.assert_close(together[b], run(d, batch, [a])[0], atol=1e-5, rtol=1e-5)
        # the control: the taps act inside a block (the slot before matters)
        without = dflash2_drafter(identity=False)
        for layer in without.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel[:, 1:] = 0
                conv.kernel_projection.weight.view(2, 2, -1, H)[:, 1:] = 0
        assert (run(without, batch, anchors) - together).abs().max() > 1e-2


def test_dflash2_gradients_reach_the_convolutions_and_the_successor_codebook():
    """From the identity start: the unary loss trains every convolution weight, and a
    selector term the successor codebook (the other two factors start with a zero gradient,
    as the successor codebook is zero)."""
    d, batch = dflash2_drafter(), packed()
    anchors, hidden, labels, loss = six_blocks_loss(d, batch)
    previous = torch.cat([batch["input_ids"][anchors][:, None], labels[:, 1:-1]], 1)  # (A, B-1)
    candidates = d.lm_head(hidden[:, 1:]).topk(4, dim=-1).indices  # (A, B-1, K)
    edges = d.candidate_selector.edge_scores(hidden[:, 1:], previous.clamp(min=0), candidates)
    (loss + edges.square().sum() + edges.sum()).backward()
    for name, p in d.named_parameters():
        if "_conv." in name or name.endswith("successor_codebook"):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
