"""Training data: feature shards -> packed micro-batches of fixed shape.

    shards (memory-mapped) ─► per-epoch plan: seeded shuffle, pack into `tokens` budget bins,
    bins dealt round-robin to ranks (equal count per rank) ─► DataLoader workers decode and
    pack one bin each ─► pinned tensors, prefetched

Every micro-batch has the same shapes: `tokens` stream positions (padding has document id -1)
and `anchors` anchor slots with a keep mask, so a compiled step never recompiles. The plan is a
pure function of (seed, epoch, lengths, rank, world size), so a run resumes mid-epoch from
(epoch, micro-batch index) alone. Where the loss reads the target's distribution from the top-k
soft targets (features.TargetSource) each position also carries the target's top-k next-token
ids and log-probs (`topk_ids`, `topk_logprobs`: (tokens, k)); every shard must have them. Shards
with the target's final hidden states (extract.final_hidden) decode them as one more block of
`target_hidden`, and `to_device` splits it off as `target_final` (tokens, H) where asked.

`quantized=True` (the train stage on a GPU): a pack whose samples all come from shards of one
quantized codec carries the arrays as stored instead of `target_hidden`: fp8-zstd's e4m3 bytes and
scales (`target_fp8` (tokens, n_layers*H) uint8, `target_scales` (tokens, n_layers) float32),
fp4-zstd's packed codes, group scales, layer scales and kept outliers (`target_fp4` (tokens,
n_layers*H/2) uint8, `target_group_scales` (tokens, n_layers*H/G) uint8, `target_scales`,
`target_outlier_channels` and `target_outlier_values` (tokens, n_layers*4) int16, the values bf16
bits), and `to_device`
dequantizes them on the device: the workers only decompress, and a half (fp8) or about a quarter
(fp4) of bf16's bytes cross to the GPU. The result is bit for bit the bf16 a worker would have
made.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from dflashpipe.anchors import sample_anchors
from dflashpipe.codecs import QUANTIZED, STORED, dequantize, stored_parts
from dflashpipe.errors import DataError
from dflashpipe.shards import FeatureShard

MAX_DOCS = 256


@dataclass
class Sample:
    shard: int
    row: int
    length: int  # tokens used (a longer sequence is cut to the micro-batch budget)
    prompt: str | None = None  # the answered prompt (sample id `{prompt}-{answer}`); None: its own
    answer: int = 0  # the answer's index among its prompt's answers (0: the greedy one)

    @property
    def group(self) -> str:
        return self.prompt if self.prompt is not None else f"{self.shard}/{self.row}"


def index_samples(shard_paths: list[Path], tokens: int, stats: dict, topk: int = 0,
                  final: bool = False) -> list[Sample]:  # fmt: skip
    """Every usable sample of the shards, from column data only (nothing is decoded). topk > 0:
    the soft targets training needs; a shard without them, or with another k, is refused; so is
    one without the final hidden states where `final` asks for them."""
    samples = []
    for s, path in enumerate(shard_paths):
        shard = FeatureShard(path)
        if final and not shard.info.final_hidden:
            raise DataError(
                f"{path} has no final hidden states (extract.final_hidden off), but the loss "
                "trains on the target's whole distribution from them, as its manifest promised; "
                "re-extract it with extract.final_hidden true"
            )
        if topk and shard.info.topk != topk:
            has = f"top-{shard.info.topk} soft targets" if shard.info.topk else "no soft targets"
            raise DataError(
                f"{path} has {has} (extract.topk {shard.info.topk}), but train.distill_weight > 0 "
                f"trains on the top-{topk} of its manifest; re-extract it with extract.topk {topk}"
            )
        lengths = shard.table.column("num_tokens").to_numpy()
        masks = shard.table.column("loss_mask").combine_chunks()
        flat = pc.list_flatten(masks).to_numpy(zero_copy_only=False).astype(np.int64)
        offsets = masks.offsets.to_numpy()
        ids = [i.rpartition("-") for i in shard.table.column("sample_id").to_pylist()]
        for row, n in enumerate(lengths.tolist()):
            n_used = min(n, tokens)
            if flat[offsets[row] : offsets[row] + n_used].sum() < 2:  # no anchor with a label
                stats["no_supervised_tokens"] = stats.get("no_supervised_tokens", 0) + 1
                continue
            prompt, _, answer = ids[row]
            samples.append(Sample(s, row, n_used, prompt, int(answer)))
    if not samples:
        raise DataError(
            f"no trainable samples in {[str(p) for p in shard_paths]} (skipped: {stats})"
        )
    return samples


def split_validation(samples: list[Sample], n: int, seed: int) -> tuple[list[Sample], list[Sample]]:
    """(train, held out): the first answer of n prompts chosen by a seeded shuffle of the prompts,
    the same on every rank and run; no answer to a held-out prompt is trained on (with several
    answers per prompt the others would leak it), and the held-out answers do not depend on how
    many answers per prompt the data has."""
    if n == 0:
        return samples, []
    groups = sorted({s.group for s in samples})
    if n >= len(groups):
        raise DataError(
            f"train.val_samples {n} would hold out all {len(groups)} trainable prompts' answers"
        )
    random.Random(f"{seed}/validation").shuffle(groups)
    chosen = set(groups[:n])
    train = [s for s in samples if s.group not in chosen]
    held: dict[str, Sample] = {}
    for s in samples:
        if s.group in chosen and (s.group not in held or s.answer < held[s.group].answer):
            held[s.group] = s
    return train, list(held.values())


def subset(samples: list[Sample], fraction: float, seed: int) -> list[Sample]:
    """A seeded choice of round(fraction x n) of the samples (at least one), in their order: the
    same on every rank and run (train.sample_fraction, for a data-scaling curve)."""
    if fraction >= 1:
        return samples
    keep = max(1, round(fraction * len(samples)))
    chosen = sorted(random.Random(f"{seed}/subset").sample(range(len(samples)), keep))
    return [samples[i] for i in chosen]


def first_answers(samples: list[Sample], n: int | None) -> list[Sample]:
    """The samples that are answer 0..n-1 of their prompt, in their order (train.answers_per_prompt,
    for a data-scaling curve over one feature set of several answers per prompt); None: all."""
    return samples if n is None else [s for s in samples if s.answer < n]


def epoch_plan(
    samples: list[Sample], tokens: int, seed: int, epoch: int, rank: int, world: int
) -> list[list[int]]:
    """This rank's micro-batches (lists of sample indices) for one epoch."""
    order = list(range(len(samples)))
    random.Random(f"{seed}/{epoch}").shuffle(order)
    bins: list[list[int]] = []
    used = tokens
    for i in order:  # sequential fill keeps the shuffle; bins are nearly full at these sizes
        if used + samples[i].length > tokens:
            bins.append([])
            used = 0
        bins[-1].append(i)
        used += samples[i].length
    per_rank = len(bins) // world  # equal step counts on every rank (DDP needs it)
    if per_rank == 0:
        raise DataError(f"{len(bins)} micro-batches of {tokens} tokens cannot feed {world} ranks")
    return bins[rank::world][:per_rank]


class PackedBatches(Dataset):
    """Map-style: item k = micro-batch k of this rank's plan, decoded and packed (in workers)."""

    def __init__(self, shard_paths: list[Path], samples: list[Sample], plan: list[list[int]],
                 tokens: int, anchors: int, seed: int, epoch: int, topk: int = 0,
                 quantized: bool = False):  # fmt: skip
        self.paths, self.samples, self.plan = shard_paths, samples, plan
        self.tokens, self.anchors, self.seed, self.epoch = tokens, anchors, seed, epoch
        self.topk = topk  # 0: soft targets are not read
        self.quantized = quantized  # fp8 / fp4 packs stay as stored (module docstring)
        self._shards: dict[int, FeatureShard] = {}  # opened lazily, once per worker process

    def __len__(self) -> int:
        return len(self.plan)

    def _shard(self, s: int) -> FeatureShard:
        if s not in self._shards:
            self._shards[s] = FeatureShard(self.paths[s])
        return self._shards[s]

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        T = self.tokens
        ids = torch.zeros(T, dtype=torch.long)
        pos = torch.zeros(T, dtype=torch.long)
        docs = torch.full((T,), -1, dtype=torch.long)
        mask = torch.zeros(T, dtype=torch.long)
        first = self._shard(self.samples[self.plan[k][0]].shard).info
        n_layers = first.blocks  # the target's final hidden state, if stored, is one more
        width = n_layers * first.hidden_size
        infos = [self._shard(self.samples[i].shard).info for i in self.plan[k]]
        (codec, group), *more = {(info.codec, info.group_size) for info in infos}
        quantized = self.quantized and not more and codec in QUANTIZED
        # each sample decodes straight into its rows of the batch; only the padding is zeroed
        if quantized:
            layout = stored_parts(codec, width, n_layers, group)
            stored = {f"target_{name}": _batch_tensor((T, n), dtype) for name, n, dtype in layout}
        else:
            hidden = _batch_tensor((T, width), torch.bfloat16)
        soft = {}
        if self.topk:  # padding's soft targets are never read (no label there); zeros are finite
            soft = {"topk_ids": torch.zeros(T, self.topk, dtype=torch.int32),
                    "topk_logprobs": torch.zeros(T, self.topk, dtype=torch.float16)}  # fmt: skip
        names, at = [], 0
        for d, i in enumerate(self.plan[k]):
            sample = self.samples[i]
            n = sample.length
            shard = self._shard(sample.shard)
            if quantized:
                row = shard.sample_stored(
                    sample.row, tuple(t[at : at + n] for t in stored.values())
                )
            else:
                row = shard.sample(sample.row, out=hidden[at : at + n])
            ids[at : at + n] = row["input_ids"][:n]
            mask[at : at + n] = row["loss_mask"][:n]
            pos[at : at + n] = torch.arange(n)
            docs[at : at + n] = d
            for key, t in soft.items():
                t[at : at + n] = row[key][:n]
            names.append(row["sample_id"])
            at += n
        if quantized:
            for t in stored.values():
                t[at:] = 0
            states = stored
        else:
            hidden[at:] = 0
            states = {"target_hidden": hidden}
        anchors, keep = sample_anchors(mask, docs, names, num_anchors=self.anchors,
                                       budget=self.anchors, seed=self.seed, epoch=self.epoch)  # fmt: skip
        # which samples are in the pack (fixed length, for naming them if the loss turns NaN)
        sample_index = torch.full((MAX_DOCS,), -1, dtype=torch.long)
        sample_index[: min(MAX_DOCS, len(self.plan[k]))] = torch.tensor(self.plan[k][:MAX_DOCS])
        return {"input_ids": ids, "position_ids": pos, "document_ids": docs, "loss_mask": mask,
                **states, "anchors": anchors, "keep": keep, "sample_index": sample_index,
                **soft}  # fmt: skip


def _batch_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor; in a DataLoader worker it is born in shared memory, so handing
    it to the main process moves no bytes (a private-memory tensor is copied into a new shared
    segment there: one more pass over the largest array of the batch)."""
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)  # torch's own, for workers
    if get_worker_info() is None or new_shared is None:
        return torch.empty(shape, dtype=dtype)
    storage = new_shared(math.prod(shape) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


def to_device(
    batch: dict[str, torch.Tensor], device: torch.device, final: int = 0
) -> dict[str, torch.Tensor]:
    """A micro-batch on `device` with `target_hidden` in bf16 (a quantized pack's stored arrays
    dequantized there). final = H > 0: the packs' rows end with the target's final hidden
    state, split off as `target_final` (tokens, H); both are views of the one decoded block."""
    b = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    for codec, names in STORED.items():
        if f"target_{names[0]}" in b:
            parts = tuple(b.pop(f"target_{name}") for name in names)
            b["target_hidden"] = dequantize(parts, codec)
    if final:
        hidden = b["target_hidden"]
        b["target_hidden"], b["target_final"] = hidden[:, :-final], hidden[:, -final:]
    return b


def make_loader(dataset: PackedBatches, start: int, workers: int, pin: bool) -> DataLoader:
    """Batches from micro-batch `start` on (resume), decoded in `workers` processes."""
    indices = list(range(start, len(dataset)))
    return DataLoader(
        torch.utils.data.Subset(dataset, indices),
        batch_size=None,
        num_workers=workers,
        pin_memory=pin,
        prefetch_factor=4 if workers else None,
        persistent_workers=False,
    )
