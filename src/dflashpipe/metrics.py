"""Training metrics: the FLOPs a step does, and the log that turns device-side sums into JSONL
rows, the rank-0 progress bar and TensorBoard scalars at log intervals (no host sync between).

    RunFacts (once, from the trainer) ─► MetricsLog ◄─ add(loss, metrics) every micro-batch
                                            └─ maybe_write(step, epoch, lr) ─► metrics.jsonl,
                                               progress bar, TensorBoard (log intervals)

The log is told the run's facts and each step's values; it reads nothing of the trainer and
keeps its own clock (`paused()` leaves validation out of the tokens/s and MFU).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from dflashpipe.cards import card
from dflashpipe.data import Sample
from dflashpipe.model import DrafterConfig

log = logging.getLogger("dflashpipe.train")


def step_flops(
    cfg: DrafterConfig, tokens: int, n_taps: int, anchors_pos: torch.Tensor
) -> torch.Tensor:
    """Training FLOPs of one micro-batch (a device tensor: no sync). Counted: drafter layer
    matmuls on block tokens, k/v projections on context + block tokens, fc on context tokens,
    attention over the keys each query sees, LM head forward + input gradient. Trainable
    matmuls count 3x their forward (input and weight gradients), fc 2x (its input is data),
    the frozen LM head 2x. anchors_pos: (A,) in-document position of kept anchors, -1 if dropped."""
    H, B, V, ff = cfg.hidden_size, cfg.block_size, cfg.vocab_size, cfg.intermediate_size
    q_dim, kv_dim = (
        cfg.num_attention_heads * cfg.head_dim,
        2 * cfg.num_key_value_heads * cfg.head_dim,
    )
    kept = (anchors_pos >= 0).sum()
    Q = kept * B
    per_layer = (
        2 * Q * H * q_dim + 2 * (tokens + Q) * H * kv_dim + 2 * Q * q_dim * H + 6 * Q * H * ff
    )
    keys = B * (anchors_pos.clamp_min(0) + B).sum()  # context before the anchor + own block
    attention = 4 * q_dim * keys
    fc = 2 * tokens * n_taps * H * H
    head = 2 * kept * (B - 1) * H * V
    return 3 * cfg.num_layers * (per_layer + attention) + 2 * fc + 2 * head


def expected_acceptance(slot_accuracy: list[float]) -> float:
    """Acceptance length a drafter with these per-slot accuracies would reach if slots were
    right independently: 1 (the bonus token) + sum over k of P(slots 1..k all right)."""
    return float(1 + sum(np.cumprod(slot_accuracy)))


def chain_acceptance(chain: list[float], labels: list[float]) -> float:
    """Acceptance length measured along each block's chain, not assumed from per-slot accuracy:
    1 + sum over k of (blocks whose slots 1..k are all right, loss.chain_counts) / (blocks with
    slot k labelled). Right where misses cluster (a hard block misses several slots) or a slot
    depends on the one before (the selector's walk: after its own miss, its next choice follows
    a wrong token, which expected_acceptance's product of per-slot rates counts again)."""
    return float(1 + sum(c / max(n, 1) for c, n in zip(chain, labels, strict=True)))


def slot_width(block_size: int) -> int:
    """Length of slot_sums: the right, labelled and chain counts, (B-1) each."""
    return 3 * (block_size - 1)


def slot_sums(m: dict) -> torch.Tensor:
    """One micro-batch's unary slot sums (loss.slot_metrics'): the right, labelled and chain
    counts, (B-1,) each, as one device vector (slot_row reads a sum of them)."""
    return torch.cat([m["slot_accuracy"] * m["slot_labels"], m["slot_labels"],
                      m["slot_chain"]]).float()  # fmt: skip


def slot_row(sums: torch.Tensor, prefix: str = "") -> dict:
    """The metrics row keys of summed slot_sums: per-slot accuracy, the expected acceptance it
    implies, and the acceptance measured along the chains."""
    correct, labels, chain = sums.view(3, -1)
    acc = (correct / labels.clamp_min(1)).tolist()
    row = {"slot_accuracy": [round(a, 4) for a in acc], "expected_acceptance": expected_acceptance(acc),
           "chain_acceptance": chain_acceptance(chain.tolist(), labels.tolist())}  # fmt: skip
    return {prefix + k: v for k, v in row.items()}


def selector_width(block_size: int) -> int:
    """Length of a DFlash2 drafter's selector sums: top-K hits, teacher-forced selector hits,
    hits along the selector's path and its chain, (B-1) each, the unary loss and the selector
    loss."""
    return 4 * (block_size - 1) + 2


def selector_sums(m: dict) -> torch.Tensor:
    """One micro-batch's selector sums (selector_loss.selector_loss's metrics) as one device vector."""
    return torch.cat([m["top_k_hits"], m["selector_correct"], m["path_correct"], m["path_chain"],
                      m["unary_loss"][None], m["selector_loss"][None]]).float()  # fmt: skip


def selector_row(sums: torch.Tensor, slots: torch.Tensor, batches: int, prefix: str = "") -> dict:
    """A DFlash2 drafter's metrics row keys, from summed selector_sums and the unary slot_sums:
    unary top-1 accuracy, top-K recall (gold among the unary top K),
    selector accuracy (teacher-forced: the true previous token), the selector path's per-slot
    accuracy (its greedy walk on its own choices) and the expected tau along it, by the formula
    of the unary figure (expected_acceptance) and measured along its chains
    (chain_acceptance), and per micro-batch the unary loss (train.loss's alone: `loss` adds
    alpha x the selector's) and the selector's K-way cross-entropy."""
    correct, labels, _ = slots.view(3, -1)
    S = len(labels)
    total = labels.sum().clamp_min(1)
    path = (sums[2 * S : 3 * S] / labels.clamp_min(1)).tolist()
    row = {"unary_accuracy": correct.sum() / total, "top_k_recall": sums[:S].sum() / total,
           "selector_accuracy": sums[S : 2 * S].sum() / total}  # fmt: skip
    row = {k: round(v.item(), 4) for k, v in row.items()}
    row |= {"selector_slot_accuracy": [round(a, 4) for a in path],
            "selector_expected_acceptance": expected_acceptance(path),
            "selector_chain_acceptance": chain_acceptance(sums[3 * S : 4 * S].tolist(),
                                                          labels.tolist()),
            "unary_loss": sums[-2].item() / batches,
            "selector_loss": sums[-1].item() / batches}  # fmt: skip
    return {prefix + k: v for k, v in row.items()}


@dataclass(frozen=True)
class RunFacts:
    """What the log knows of the run, fixed for its length (the trainer gives them once)."""

    run_dir: Path  # metrics.jsonl goes here, TensorBoard beside it
    rank: int
    world: int
    device: torch.device
    block_size: int
    start_step: int  # the step training starts (or resumes) from
    total_steps: int
    micro_batch_tokens: int  # tokens of one micro-batch on one rank (tokens/s)
    samples: Sequence[Sample]  # the training samples (a non-finite loss names its own)
    train_tokens: int  # their tokens, per epoch
    shard_names: Sequence[str]  # file name of each shard a Sample's `shard` indexes


class MetricsLog:
    """Device-side sums of loss and slot metrics, reduced across ranks and written (JSONL, rank 0
    progress bar, TensorBoard if installed) every `every` optimizer steps."""

    def __init__(self, facts: RunFacts, every: int):
        self.facts, self.every = facts, every
        self.path = facts.run_dir / "metrics.jsonl"  # beside the checkpoints: survives retries
        if facts.rank == 0:
            _truncate_metrics(self.path, facts.start_step)
        self.bar = tqdm(
            total=facts.total_steps, initial=facts.start_step, desc="train", disable=facts.rank != 0
        )
        self.tb = _tensorboard(facts.run_dir.parent / "tensorboard") if facts.rank == 0 else None
        self._reset()
        self.bad_samples: torch.Tensor | None = None

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside is not training time: left out of tokens/s and MFU (validation)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._paused_s += time.perf_counter() - t0

    def _reset(self) -> None:
        dev, B = self.facts.device, self.facts.block_size
        self.loss = torch.zeros((), device=dev)
        self.slots = torch.zeros(slot_width(B), device=dev)  # slot_sums
        self.flops = torch.zeros((), device=dev, dtype=torch.float64)
        self.selector: torch.Tensor | None = None  # a DFlash2 drafter's selector_sums
        self.n = 0
        self.start, self._paused_s = time.perf_counter(), 0.0

    def add(self, loss: torch.Tensor, m: dict) -> None:
        self.loss += loss
        self.slots += slot_sums(m)
        self.flops += m["flops"].double()
        if "top_k_hits" in m:
            sums = selector_sums(m)
            self.selector = sums if self.selector is None else self.selector + sums
        self.n += 1
        if self.bad_samples is None:
            self.bad_samples = torch.full_like(m["sample_index"], -1)
        bad = ~torch.isfinite(loss) & (self.bad_samples[0] < 0)  # keep the first NaN pack
        self.bad_samples = torch.where(bad, m["sample_index"], self.bad_samples)

    def check_finite(self, step: int) -> None:
        if self.bad_samples is not None and int(self.bad_samples[0]) >= 0:
            f = self.facts
            ids = [f.samples[i] for i in self.bad_samples.tolist() if i >= 0]
            raise FloatingPointError(
                f"non-finite loss before step {step}; samples (shard, row): "
                f"{[(f.shard_names[s.shard], s.row) for s in ids]}; "
                "the last good checkpoint is kept"
            )

    def maybe_write(self, step: int, epoch: int, lr: float, validation: dict | None = None) -> None:
        """The metrics row of `step` (in `epoch`, at learning rate `lr`) at log intervals, the
        last step and steps with a held-out measurement (`validation`: Trainer.validate's keys,
        added to the row)."""
        f = self.facts
        self.bar.update(1)
        if step % self.every and step < f.total_steps and validation is None:
            return
        self.check_finite(step)
        vec = torch.cat([self.loss[None], self.slots, self.flops.float()[None]])
        if f.world > 1:
            dist.all_reduce(vec)
            if self.selector is not None:
                dist.all_reduce(self.selector)
        elapsed = time.perf_counter() - self.start - self._paused_s
        slots = vec[1:-1]
        row = {"step": step, "epoch": epoch, "loss": vec[0].item() / (self.n * f.world),
               **slot_row(slots), "lr": lr, "tokens_per_s": self.n * f.micro_batch_tokens * f.world / elapsed,
               "train_samples": len(f.samples), "train_tokens": f.train_tokens,
               **(validation or {})}  # fmt: skip
        if self.selector is not None:  # dflash2: beside the unary figures, the selector's
            row |= selector_row(self.selector, slots, self.n * f.world)
        peak = _peak_flops(f.device)
        if peak:
            row["mfu"] = vec[-1].item() / elapsed / (peak * f.world)
        if f.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
            self.bar.set_postfix(loss=f"{row['loss']:.3f}", tau=f"{row['expected_acceptance']:.2f}",
                                 tok_s=f"{row['tokens_per_s']:.0f}", **({"mfu": f"{row['mfu']:.2f}"} if peak else {}))  # fmt: skip
            if self.tb is not None:
                for k in ("loss", "expected_acceptance", "tokens_per_s", "lr", "val_loss",
                          "val_expected_acceptance", "selector_expected_acceptance",
                          "val_selector_expected_acceptance", "val_chain_acceptance",
                          "val_selector_chain_acceptance"):  # fmt: skip
                    if k in row:
                        self.tb.add_scalar(k, row[k], step)
        self._reset()

    def close(self) -> None:
        self.bar.close()
        if self.tb is not None:
            self.tb.close()


def _truncate_metrics(path: Path, step: int) -> None:
    """Keep the rows up to the step training resumes from (none for a fresh run): rows logged
    after the last checkpoint of a killed run are logged again, so the curve has no repeats."""
    if not path.is_file():
        return
    rows = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
    path.write_text("".join(r + "\n" for r in rows))


def _peak_flops(device: torch.device) -> float | None:
    return card(device).bf16_flops if device.type == "cuda" else None


def _tensorboard(path: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.info("tensorboard is not installed; metrics go to metrics.jsonl only")
        return None
    return SummaryWriter(str(path))
