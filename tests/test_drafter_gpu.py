"""CUDA checks of the drafter: a step at Qwen3-8B shapes compiles once and never again, and
flex attention agrees with SDPA. Skipped where no GPU exists."""

import time

import pytest
import torch
from torch._dynamo.utils import counters

from dflashpipe.anchors import sample_anchors
from dflashpipe.loss import block_labels, dflash_loss
from dflashpipe.model import Drafter, DrafterConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
ROPE = {"rope_type": "default", "rope_theta": 1_000_000.0}


def config(**sizes) -> DrafterConfig:
    return DrafterConfig(
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        rope_parameters=dict(ROPE),
        num_target_layers=36,
        **sizes,
    )


def batch(doc_lengths: list[int], n_taps: int, hidden_size: int, num_anchors: int, epoch: int):
    """One packed stream on the GPU; the first 64 tokens of each document are prompt."""
    g = torch.Generator().manual_seed(epoch)
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(doc_lengths)])
    positions = torch.cat([torch.arange(n) for n in doc_lengths])
    loss_mask = (positions >= 64).long()
    anchors, keep = sample_anchors(
        loss_mask,
        docs,
        list(range(len(doc_lengths))),
        num_anchors=num_anchors,
        budget=num_anchors,
        seed=0,
        epoch=epoch,
    )
    T = docs.shape[0]
    cpu = {
        "input_ids": torch.randint(0, 1000, (T,), generator=g),
        "target_hidden": torch.randn(T, n_taps * hidden_size, generator=g),
        "position_ids": positions,
        "document_ids": docs,
        "anchors": anchors,
        "keep": keep,
    }
    return {k: v.cuda() for k, v in cpu.items()}, loss_mask.cuda()


def test_qwen3_8b_shaped_step_compiles_once():
    """The Qwen3-8B drafter (5 full-attention layers, B=16, 512 anchors over 3072 tokens, bf16,
    vocab 151936): the first step compiles, later steps with new anchors and tokens must not."""
    H, V = 4096, 151936
    cfg = config(
        hidden_size=H,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=V,
        mask_token_id=151669,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        embed = torch.randn(V, H, dtype=torch.bfloat16) * 0.02
        d = Drafter(cfg, embed, torch.randn(V, H, dtype=torch.bfloat16) * 0.02)
    d.to(torch.bfloat16)

    def step(inputs: dict, loss_mask: torch.Tensor) -> torch.Tensor:
        hidden = d(**inputs)  # flex on CUDA
        labels, valid = block_labels(
            inputs["input_ids"],
            inputs["document_ids"],
            loss_mask,
            inputs["anchors"],
            inputs["keep"],
            16,
        )
        loss, _ = dflash_loss(hidden, d.lm_head.weight, labels, valid, gamma=7.0)
        loss.backward()
        d.zero_grad(set_to_none=True)
        return loss.detach()

    # New anchors, tokens and states every step (epochs), the same shapes.
    batches = [batch([1100, 900, 1072], 5, H, 512, epoch) for epoch in range(3)]
    for inputs, _ in batches:
        inputs["target_hidden"] = inputs["target_hidden"].to(torch.bfloat16)
    assert torch.isfinite(step(*batches[0]))
    torch.cuda.synchronize()
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0  # flex attention, the block mask and the loss chunk were compiled
    with torch._dynamo.config.patch(error_on_recompile=True):
        start = time.perf_counter()
        for inputs, loss_mask in batches[1:]:
            assert torch.isfinite(step(inputs, loss_mask))
        torch.cuda.synchronize()
    per_step = (time.perf_counter() - start) / 2
    assert counters["stats"]["unique_graphs"] == graphs
    print(
        f"\nQwen3-8B-shaped drafter step: {per_step * 1e3:.0f} ms, "
        f"{3072 / per_step:.0f} stream tokens/s, "
        f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB, {graphs} compiled graphs"
    )


def test_flex_and_sdpa_agree_and_each_layer_kind_compiles_once():
    cfg = config(
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=1024,
        mask_token_id=1023,
        num_layers=2,
        block_size=8,
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=100,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        d = Drafter(cfg, torch.randn(1024, 256), torch.randn(1024, 256))
    inputs, _ = batch([300, 200, 140], len(cfg.target_layer_ids), 256, 48, epoch=0)
    probe = torch.randn(48, 8, 256, device="cuda")
    results = {}
    for backend in ("flex", "sdpa"):
        d.zero_grad()
        out = d(**inputs, backend=backend)
        (out * probe).sum().backward()
        grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.requires_grad}
        results[backend] = (out.detach(), grads)
    # A second step with new anchors: each layer kind (full, sliding) keeps its compiled kernel.
    with torch._dynamo.config.patch(error_on_recompile=True):
        inputs, _ = batch([300, 200, 140], len(cfg.target_layer_ids), 256, 48, epoch=1)
        (d(**inputs) * probe).sum().backward()
    # Relative to the whole tensor: TF32 or reordered sums move single elements a little, a
    # wrong mask moves everything by order one.
    assert rel_err(results["flex"][0], results["sdpa"][0]) < 1e-3
    for name, g in results["sdpa"][1].items():
        assert rel_err(results["flex"][1][name], g) < 1e-3, name


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


@pytest.mark.parametrize("distill_weight", [0.0, 0.5])
def test_compiled_chunked_loss_matches_eager_on_cuda(distill_weight):
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(32, 16, 128, device="cuda", generator=g, requires_grad=True)
    weight = torch.randn(5000, 128, device="cuda", generator=g)
    labels = torch.randint(0, 5000, (32, 16), device="cuda", generator=g)
    valid = torch.rand(32, 16, device="cuda", generator=g) > 0.2
    # soft targets as extract stores them: 8 distinct ids per slot, float16 log-probs
    soft_ids = torch.rand(32, 16, 5000, device="cuda", generator=g).topk(8).indices.int()
    soft_lp = torch.randn(32, 16, 8, device="cuda", generator=g).log_softmax(-1).half()
    losses, grads = [], []
    for compile in (True, False):
        loss, _ = dflash_loss(hidden, weight, labels, valid, 7.0, chunk_rows=96, compile=compile,
                              soft=(soft_ids, soft_lp), distill_weight=distill_weight)  # fmt: skip
        losses.append(loss)
        grads.append(torch.autograd.grad(loss, hidden)[0])
    torch.testing.assert_close(losses[0], losses[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-3)
