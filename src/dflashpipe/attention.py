"""The target's SDPA attention, with the query heads that share a KV head folded into the query
length instead of the KV heads copied per query head.

transformers' SDPA attention copies each KV head once per query head it serves (`repeat_kv`)
whenever it is given a mask on CUDA, as every padded batch is; its own fold (`pack_gqa`, newer
versions) is skipped under torch.compile. Regenerate's decoding step is compiled over a static
cache with a padding mask, so each step copied the whole cache of every layer, twice (K and V):
on the H200 at the recipe's shapes (batch 1,024, 576 cache slots, SmolLM2: 9 query heads over
3 KV heads) those copies took a third of the step's GPU time and the attention kernel then read
three times the bytes (benchmarks/RESULTS.md, "Regenerate").

`sdpa_folded` computes the same attention as (B, Hkv, g*Q, D) queries over the (B, Hkv, L, D)
cache: query head h = kv*g + r, as `repeat_kv` orders them, so each query row meets the K/V
rows it would have met, under the same mask row (repeated g times along the query length,
which costs g*Q*L mask bytes per batch row against the 2*Hq*L*D*itemsize bytes of the copies).
Where that trade is not cheaper (long queries, as extract's whole sequences) or does not apply
(no mask, a per-head mask, dropout, a position bias, softcapping), it hands the call to
transformers' own SDPA attention unchanged.

`implementation("sdpa")` registers it with transformers (attention and mask interfaces) and
returns its name; the config's `target.attn_implementation: sdpa` means this. Any other name
goes to transformers as given (`hf_sdpa` is transformers' own SDPA attention, for comparison).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FOLDED = "sdpa_gqa_folded"  # its registered name (transformers takes any name with "flash" in it
# for a flash-attention kernel)
HF_SDPA = "hf_sdpa"  # transformers' own, unfolded


def folds(groups: int, heads: int, q_len: int, head_dim: int, itemsize: int) -> bool:
    """Whether folding a GQA group into the query length moves fewer bytes than copying K/V:
    the mask repeated g times (g*Q*L bools per batch row) against K and V expanded per query
    head (2*Hq*L*D*itemsize)."""
    return groups > 1 and groups * q_len < 2 * heads * head_dim * itemsize


def sdpa_folded(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (B, Hq, Q, D), key/value (B, Hkv, L, D)
    -> (B, Q, Hq, D), no weights."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, Hq, Q, D = query.shape
    Hkv = key.shape[1]
    g = Hq // Hkv
    plain = (
        attention_mask is None
        or attention_mask.dim() != 4
        or attention_mask.shape[1] != 1
        or dropout != 0.0
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
        or Hq % Hkv != 0
        or not folds(g, Hq, Q, D, query.element_size())
    )
    if plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    mask = attention_mask.expand(-1, -1, Q, -1).repeat(1, 1, g, 1)  # row r*Q + i = row i
    y = F.scaled_dot_product_attention(
        query.reshape(B, Hkv, g * Q, D), key, value, attn_mask=mask, scale=scaling
    )
    return y.reshape(B, Hq, Q, D).transpose(1, 2).contiguous(), None


def implementation(name: str) -> str:
    """The attn_implementation to hand transformers for the config's `name`: "sdpa" -> the
    folded SDPA (registered on first use), "hf_sdpa" -> transformers' "sdpa", others as given."""
    if name == HF_SDPA:
        return "sdpa"
    if name != "sdpa":
        return name
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FOLDED, sdpa_folded)
    AttentionMaskInterface.register(FOLDED, sdpa_mask)  # the same masks as SDPA's
    return FOLDED
