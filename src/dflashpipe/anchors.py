"""Anchor sampling: where the training blocks of one packed micro-batch start.

Each document contributes up to `num_anchors` anchors, drawn uniformly without replacement from
its candidate positions: supervised positions a whose next position a+1 is in the same document
and supervised too (otherwise the block has no label at all). The draw depends only on
(seed, epoch, sample id), not on which documents share the pack, so a document gets the same
anchors wherever the packer puts it and new ones every epoch.

A micro-batch has a fixed anchor budget: anchors (budget,) padded with 0 and keep (budget,) bool,
so every step has the same shapes (no recompiles, no ragged block masks).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import Tensor


def anchor_candidates(loss_mask: Tensor, document_ids: Tensor) -> Tensor:
    """(T,) bool: a is supervised and a+1 is a supervised position of the same document."""
    supervised = loss_mask.bool()
    nxt = supervised[1:] & supervised[:-1] & (document_ids[1:] == document_ids[:-1])  # (T-1,)
    return torch.cat([nxt, torch.zeros(1, dtype=torch.bool, device=nxt.device)])


def sample_anchors(
    loss_mask: Tensor,
    document_ids: Tensor,
    sample_ids: Sequence[int | str],
    *,
    num_anchors: int,
    budget: int,
    seed: int,
    epoch: int,
) -> tuple[Tensor, Tensor]:
    """Anchors (budget,) int64 ascending stream indices and keep (budget,) bool, on the CPU.

    loss_mask, document_ids: (T,) of one packed stream; documents are contiguous runs of one id,
    negative ids mark padding. sample_ids: one stable id per non-padding document, in stream order.
    If the documents offer more than `budget` anchors, a uniform subset of them is kept.
    """
    if num_anchors < 1 or budget < 1:
        raise ValueError(f"num_anchors ({num_anchors}) and budget ({budget}) must be >= 1")
    loss_mask, document_ids = loss_mask.cpu(), document_ids.cpu()
    ids, counts = torch.unique_consecutive(document_ids, return_counts=True)
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"document ids {ids.tolist()} are not contiguous runs in the stream")
    real = ids >= 0
    if int(real.sum()) != len(sample_ids):
        raise ValueError(
            f"{len(sample_ids)} sample ids given for {int(real.sum())} documents in the stream"
        )
    candidates = anchor_candidates(loss_mask, document_ids)
    starts = torch.cumsum(counts, 0) - counts
    picked, names = [], iter(sample_ids)
    for doc_id, start, length in zip(ids.tolist(), starts.tolist(), counts.tolist(), strict=True):
        if doc_id < 0:
            continue
        positions = candidates[start : start + length].nonzero()[:, 0] + start  # (n,)
        order = torch.randperm(positions.numel(), generator=_generator(seed, epoch, next(names)))
        picked.append(positions[order[:num_anchors]])
    anchors = torch.cat(picked) if picked else torch.zeros(0, dtype=torch.long)
    if anchors.numel() > budget:
        # The pack itself is identified by its documents, so this draw is reproducible too.
        g = _generator(seed, epoch, tuple(sample_ids))
        anchors = anchors[torch.randperm(anchors.numel(), generator=g)[:budget]]
    anchors = anchors.sort().values
    keep = torch.arange(budget) < anchors.numel()
    return torch.nn.functional.pad(anchors, (0, budget - anchors.numel())), keep


def _generator(seed: int, epoch: int, sample_id: object) -> torch.Generator:
    # A hash rather than seed + epoch + id: nearby (epoch, id) pairs must not share streams.
    digest = hashlib.blake2b(repr((seed, epoch, sample_id)).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
