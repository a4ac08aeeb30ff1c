"""The drafter's attention mask on small hand-checked cases, and the two backends built from it."""

import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_mask

from dflashpipe.masks import attend, block_mask_mod, build_masks

# Stream of two adjacent documents: positions 0-2 are doc 0, 3-7 doc 1.
DOCS = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
# Anchor 0: a document start. Anchor 2: its block (2, 3, 4) runs past the end of doc 0.
# Anchor 3: the start of doc 1 right after doc 0. Anchor 6: ordinary, late in doc 1.
ANCHORS = torch.tensor([0, 2, 3, 6])
B = 3


def dense(mask_mod, q_len: int, kv_len: int) -> list[str]:
    m = create_mask(mask_mod, 1, 1, q_len, kv_len, device="cpu")[0, 0]
    return ["".join("x" if v else "." for v in row.tolist()) for row in m]


def table(rows: list[str]) -> list[str]:
    # Written as "context | block0 block1 ...", compared without the separators.
    return [r.replace(" ", "").replace("|", "") for r in rows]


def test_full_attention_truth_table():
    keep = torch.ones(4, dtype=torch.bool)
    got = dense(block_mask_mod(DOCS, ANCHORS, keep, B), 12, 8 + 12)
    assert got == table(
        [
            # ctx 0..7 | blk0 blk1 blk2 blk3
            "........ | xxx ... ... ...",  # a=0 doc start: no context at all
            "........ | xxx ... ... ...",
            "........ | xxx ... ... ...",
            "xx...... | ... xxx ... ...",  # a=2: 0,1 only; never 2 (= a) nor doc 1
            "xx...... | ... xxx ... ...",
            "xx...... | ... xxx ... ...",
            "........ | ... ... xxx ...",  # a=3 doc 1 start: doc 0 right before is hidden
            "........ | ... ... xxx ...",
            "........ | ... ... xxx ...",
            "...xxx.. | ... ... ... xxx",  # a=6: doc 1 positions 3,4,5
            "...xxx.. | ... ... ... xxx",
            "...xxx.. | ... ... ... xxx",
        ]
    )


def test_sliding_window_truth_table():
    # Window 2 from the query's own position a+k: context j needs a+k-j < 2, so slot 0 sees a-1
    # only and later slots see no context; inside the block it is causal, k-k' < 2.
    keep = torch.ones(4, dtype=torch.bool)
    got = dense(block_mask_mod(DOCS, ANCHORS, keep, B, sliding_window=2), 12, 8 + 12)
    assert got == table(
        [
            "........ | x.. ... ... ...",
            "........ | xx. ... ... ...",
            "........ | .xx ... ... ...",
            ".x...... | ... x.. ... ...",  # a=2, slot 0 at 2: j=1 in (2-1 < 2), j=0 out (2-0 = 2)
            "........ | ... xx. ... ...",
            "........ | ... .xx ... ...",
            "........ | ... ... x.. ...",
            "........ | ... ... xx. ...",
            "........ | ... ... .xx ...",
            ".....x.. | ... ... ... x..",
            "........ | ... ... ... xx.",
            "........ | ... ... ... .xx",
        ]
    )


def test_wide_window_equals_full_attention_on_context():
    # A window longer than the stream keeps all context; only the in-block causality remains.
    keep = torch.ones(4, dtype=torch.bool)
    wide = dense(block_mask_mod(DOCS, ANCHORS, keep, B, sliding_window=100), 12, 20)
    full = dense(block_mask_mod(DOCS, ANCHORS, keep, B), 12, 20)
    assert [w[:8] for w in wide] == [f[:8] for f in full]
    assert wide[0][8:11] == "x.." and wide[2][8:11] == "xxx"


def test_dropped_anchor_sees_only_its_own_block():
    keep = torch.tensor([True, False, True, True])
    got = dense(block_mask_mod(DOCS, ANCHORS, keep, B), 12, 20)
    assert got[3:6] == table(["........ | ... xxx ... ..."] * 3)


def test_sdpa_and_flex_masks_give_the_same_attention():
    torch.manual_seed(0)
    docs = torch.tensor([0] * 9 + [1] * 14 + [2] * 9)  # T = 32
    anchors = torch.tensor([1, 4, 7, 9, 15, 20, 25, 30])
    keep = torch.tensor([True] * 7 + [False])
    masks_sdpa = build_masks(docs, anchors, keep, 4, [None, 5], backend="sdpa")
    masks_flex = build_masks(docs, anchors, keep, 4, [None, 5], backend="flex")
    assert isinstance(masks_flex[None], BlockMask) and masks_sdpa[5].dtype == torch.bool
    q = torch.randn(1, 4, 32, 8)
    k, v = torch.randn(2, 1, 2, 64, 8)
    for window in (None, 5):
        ref = attend(q, k, v, masks_sdpa[window], window)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager flex warns that it is unfused
            out = attend(q, k, v, masks_flex[window], window)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="'xla'"):
        build_masks(DOCS, ANCHORS, torch.ones(4, dtype=torch.bool), B, [None], backend="xla")


@pytest.mark.parametrize("window", [None, 3])
def test_dense_sdpa_mask_equals_create_mask(window):
    """build_masks' SDPA form (broadcast indices) is exactly flex's create_mask (vmap)."""
    from dflashpipe.masks import dense_mask

    g = torch.Generator().manual_seed(0)
    docs = torch.cat(
        [torch.full((n,), i) for i, n in enumerate([7, 12, 5])] + [torch.full((4,), -1)]
    )
    anchors = torch.sort(torch.randperm(24, generator=g)[:6]).values
    keep = torch.tensor([1, 1, 0, 1, 1, 0], dtype=torch.bool)
    mask_mod = block_mask_mod(docs, anchors, keep, 4, window)
    q_len, kv_len = 6 * 4, docs.shape[0] + 6 * 4
    expected = create_mask(mask_mod, 1, 1, q_len, kv_len, device="cpu")
    assert torch.equal(dense_mask(mask_mod, q_len, kv_len, torch.device("cpu")), expected)
