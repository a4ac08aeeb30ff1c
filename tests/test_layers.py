"""decoding/layers.py and packs.py, the layer set every engine runs: a refill pack's layers
against each prompt's own forward, the pack's placement and block mask, flex's KV blocks
against the dense length mask. The engines' exactness over every family is test_families.py's."""

import pytest
import torch
from test_engine import MAX_LEN, PROMPTS, runs_llama

from dflashpipe.decoding.layers import pack_masks
from dflashpipe.decoding.packs import MIN_PACK, default_pack, fill_pack, pack_lengths
from dflashpipe.decoding.static_models import StaticTarget

P_MAX = max(len(p) for p in PROMPTS)


def test_a_pack_places_whole_prompts_in_the_shortest_length_that_holds_them():
    """Prompts one after another at slots 0..P-1 of their rows, padding written to the scratch
    row with prompt number -1; the shortest of the lengths that holds them; each prompt's last
    place (where its first new token is read)."""
    pack, ends = fill_pack([(2, [5, 6, 7]), (0, [8, 9])], [4, 8, 32], scratch=3)
    assert pack.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0],
                             [2, 2, 2, 0, 0, 3, 3, 3],
                             [0, 1, 2, 0, 1, 0, 0, 0],
                             [0, 0, 0, 1, 1, -1, -1, -1]]  # fmt: skip
    assert ends == [2, 4]
    with pytest.raises(StopIteration):  # nothing holds 9 tokens
        fill_pack([(0, list(range(9)))], [4, 8], scratch=1)
    assert pack_lengths(2048) == [128, 512, 2048] and pack_lengths(MIN_PACK) == [MIN_PACK]
    # the tiny Llama: 2 layers of 36,992 weights; attention costs its linear layers at
    # 73,984 / (2 x 4 heads x 16 dims x 2 layers) = 289 tokens, rounded down to a power of two
    assert default_pack(runs_llama()) == 256


@pytest.mark.parametrize("window", [None, 2])
def test_a_pack_token_sees_its_own_prompt_up_to_itself(window):
    """The pack's block mask: each token its own prompt's tokens at or before its position
    (within the window); never another prompt's, never the padding (another prompt number)."""
    pack, _ = fill_pack([(0, [1, 2, 3]), (1, [4, 5])], [6], scratch=2)
    (mask,) = pack_masks(torch.from_numpy(pack), [window], groups=1)
    seg, pos = pack[3], pack[2]
    want = [[seg[i] == seg[j] and pos[j] <= pos[i] and (window is None or pos[i] - pos[j] < window)
             for j in range(6)] for i in range(6)]  # fmt: skip
    assert mask.mask[0, 0].tolist() == want


def test_a_pack_writes_each_prompts_cache_as_its_own_forward():
    """Three prompts in one pack into rows 2, 0, 1 of a 4-row buffer: every layer's K/V at
    slots 0..P-1 of each prompt's row and the last layer's rows of each prompt equal the c = 1
    forward of that prompt alone (float32)."""
    model = runs_llama()
    rows = StaticTarget(model, MAX_LEN, rows=4)
    jobs = list(zip([2, 0, 1], PROMPTS, strict=True))
    pack, ends = fill_pack(jobs, [64], scratch=3)
    with torch.no_grad():
        x, _ = rows.pack(torch.from_numpy(pack), rows.k, rows.v)
    one = StaticTarget(model, MAX_LEN)
    start = 0
    for (row, ids), end in zip(jobs, ends, strict=True):
        P = len(ids)
        slots = torch.arange(P)
        logits, _ = one.forward(torch.tensor(ids), slots, slots, torch.zeros(1, dtype=torch.long))
        torch.testing.assert_close(rows.kv[:, row, :, :P], one.kv[:, 0, :, :P], atol=1e-5,
                                   rtol=1e-4)  # fmt: skip
        with torch.no_grad():
            mine = model.lm_head(model.model.norm(x[0, start : end + 1]))
        torch.testing.assert_close(mine, logits, atol=1e-5, rtol=1e-4)
        start = end + 1
    assert rows.kv[:, :3, :, P_MAX:].abs().sum() == 0  # nothing past the longest prompt


@pytest.mark.parametrize("window", [None, 100])
def test_flex_blocks_attend_as_the_dense_length_mask(window):
    """Attention "flex" over 3 KV blocks: rows at the start, inside and at the end of a block,
    with and without a window reaching back across a block boundary, equal the dense step's
    masked attention over the whole cache (GQA: 6 query heads over 2 KV heads)."""
    from torch.nn.attention.flex_attention import flex_attention

    from dflashpipe.decoding.families import windowed
    from dflashpipe.decoding.layers import FLEX_BLOCK, flex_blocks, flex_mask

    g = torch.Generator().manual_seed(0)
    C, length = 3 * FLEX_BLOCK, torch.tensor([0, 5, 127, 128, 200, 383])
    q = torch.randn(6, 6, 1, 16, generator=g)
    k, v = (torch.randn(6, 2, C, 16, generator=g) for _ in range(2))
    blocks = flex_blocks(length, C, window)
    assert blocks[2] == window and blocks[0].flatten().tolist() == (
        [1, 1, 1, 2, 2, 3] if window is None else [1, 1, 1, 2, 2, 1])  # fmt: skip
    mask = flex_mask(blocks, length, C)
    got = flex_attention(q, k, v, block_mask=mask, scale=0.25, enable_gqa=True)
    cols = torch.arange(C)
    full = (cols[None] <= length[:, None])[:, None]  # (R, 1, C), as rows_inputs builds it
    dense = windowed(full, length[:, None], cols[None], window)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=dense[:, None],
        scale=0.25)  # fmt: skip
    torch.testing.assert_close(got, want)
