"""Training metrics: the FLOPs a step does, and the log that turns device-side sums into JSONL
rows, the rank-0 progress bar and TensorBoard scalars at log intervals (no host sync between)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from dflashpipe.model import DrafterConfig

if TYPE_CHECKING:
    from dflashpipe.train import Trainer

log = logging.getLogger("dflashpipe.train")
PEAK_TFLOPS_BF16 = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


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


class MetricsLog:
    """Device-side sums of loss and slot metrics, reduced across ranks and written (JSONL, rank 0
    progress bar, TensorBoard if installed) every `every` optimizer steps."""

    def __init__(self, trainer: Trainer, every: int):
        self.t, self.every = trainer, every
        self.path = trainer.run_dir / "metrics.jsonl"  # beside the checkpoints: survives retries
        if trainer.rank == 0:
            _truncate_metrics(self.path, trainer.step)
        self.bar = tqdm(
            total=trainer.total_steps, initial=trainer.step, desc="train", disable=trainer.rank != 0
        )
        self.tb = (
            _tensorboard(trainer.run_dir.parent / "tensorboard") if trainer.rank == 0 else None
        )
        self._reset()
        self.start = time.perf_counter()
        self.bad_samples: torch.Tensor | None = None

    def _reset(self) -> None:
        dev, B = self.t.device, self.t.dcfg.block_size
        self.loss = torch.zeros((), device=dev)
        self.correct = torch.zeros(B - 1, device=dev)
        self.labels = torch.zeros(B - 1, device=dev)
        self.flops = torch.zeros((), device=dev, dtype=torch.float64)
        self.n = 0

    def add(self, loss: torch.Tensor, m: dict) -> None:
        self.loss += loss
        self.correct += m["slot_accuracy"] * m["slot_labels"]
        self.labels += m["slot_labels"]
        self.flops += m["flops"].double()
        self.n += 1
        if self.bad_samples is None:
            self.bad_samples = torch.full_like(m["sample_index"], -1)
        bad = ~torch.isfinite(loss) & (self.bad_samples[0] < 0)  # keep the first NaN pack
        self.bad_samples = torch.where(bad, m["sample_index"], self.bad_samples)

    def check_finite(self, step: int) -> None:
        if self.bad_samples is not None and int(self.bad_samples[0]) >= 0:
            ids = [self.t.samples[i] for i in self.bad_samples.tolist() if i >= 0]
            raise FloatingPointError(
                f"non-finite loss before step {step}; samples (shard, row): "
                f"{[(self.t.shards[s.shard].name, s.row) for s in ids]}; the last good checkpoint is kept"
            )

    def maybe_write(self, step: int, validation: dict | None = None) -> None:
        """The metrics row of `step` at log intervals, the last step and steps with a held-out
        measurement (`validation`: Trainer.validate's keys, added to the row)."""
        self.bar.update(1)
        if step % self.every and step < self.t.total_steps and validation is None:
            return
        self.check_finite(step)
        vec = torch.cat([self.loss[None], self.correct, self.labels, self.flops.float()[None]])
        if self.t.world > 1:
            dist.all_reduce(vec)
        elapsed = time.perf_counter() - self.start
        B = self.t.dcfg.block_size
        acc = (vec[1:B] / vec[B : 2 * B - 1].clamp_min(1)).tolist()
        row = {"step": step, "epoch": self.t.epoch, "loss": vec[0].item() / (self.n * self.t.world),
               "slot_accuracy": [round(a, 4) for a in acc], "expected_acceptance": expected_acceptance(acc),
               "lr": self.t.scheduler.get_last_lr()[0],
               "tokens_per_s": self.n * self.t.tokens * self.t.world / elapsed,
               "train_samples": len(self.t.samples), "train_tokens": self.t.train_tokens,
               **(validation or {})}  # fmt: skip
        peak = _peak_flops(self.t.device)
        if peak:
            row["mfu"] = vec[-1].item() / elapsed / (peak * self.t.world)
        if self.t.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
            self.bar.set_postfix(loss=f"{row['loss']:.3f}", tau=f"{row['expected_acceptance']:.2f}",
                                 tok_s=f"{row['tokens_per_s']:.0f}", **({"mfu": f"{row['mfu']:.2f}"} if peak else {}))  # fmt: skip
            if self.tb is not None:
                for k in ("loss", "expected_acceptance", "tokens_per_s", "lr", "val_loss",
                          "val_expected_acceptance"):  # fmt: skip
                    if k in row:
                        self.tb.add_scalar(k, row[k], step)
        self._reset()
        self.start = time.perf_counter()

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
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v * 1e12 for k, v in PEAK_TFLOPS_BF16.items() if k in name), None)


def _tensorboard(path: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.info("tensorboard is not installed; metrics go to metrics.jsonl only")
        return None
    return SummaryWriter(str(path))
