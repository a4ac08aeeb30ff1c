"""Stage 3, extract: target hidden states of one sequences shard into one feature shard.

    sequences/shard-i.parquet ─► length-sorted batches within a token budget
      ─► GPU: base-model forward up to the deepest tapped layer, taps gathered by hooks
          (extract.topk = k > 0: every layer, the final norm and the LM head, whose top-k
          next-token log-probs per position are kept beside the taps as soft targets;
          extract.final_hidden: every layer and the final norm, whose output is kept as one
          more block after the taps, for the target's whole distribution at train time)
      ─► pinned host buffers (non-blocking copy, one CUDA event per batch)
      ─► encoder threads (numpy + zstd, no CUDA) ─► writer thread ─► features/shard-i.arrow

The main thread is the only one that touches CUDA: it launches batch k+1 before it hands batch
k's host copy to the encoders, so the GPU never waits on compression. A bounded queue between
encoders and writer, and a fixed pool of pinned buffers, bound memory and give back-pressure.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn
from tqdm import tqdm

from dflashpipe import faults
from dflashpipe.codecs import check_group, group_of, pack, pack_topk, prepare
from dflashpipe.config import Config
from dflashpipe.devices import ANY_DEVICE, DeviceLease
from dflashpipe.errors import DataError
from dflashpipe.loss import logit_rows
from dflashpipe.shards import ShardInfo, feature_row, feature_schema, record_batch
from dflashpipe.storage import ChunkedFile, atomic_path
from dflashpipe.taps import LayerTaps

log = logging.getLogger(__name__)


def plan_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Indices in length-sorted batches whose padded size (rows x longest) fits the budget."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= token_budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def truncate_base(base: nn.Module, deepest: int) -> nn.Module:
    """Drop the decoder layers after `deepest` so they are never run (not just ignored)."""
    base.layers = base.layers[: deepest + 1]
    base.config.num_hidden_layers = deepest + 1
    if getattr(base.config, "layer_types", None):
        base.config.layer_types = base.config.layer_types[: deepest + 1]
    return base


@torch.inference_mode()
def forward_taps(
    base: nn.Module, taps: LayerTaps, ids: torch.Tensor, final: bool = False
) -> torch.Tensor:
    """(B, T, n_layers*H) hidden states of the tapped layers for right-padded `ids`; `final`:
    (B, T, (n_layers + 1)*H), the base model's output (the last layer's, after the final norm)
    appended, so that the codec stores it as one more layer.

    No attention mask: with causal attention and the padding on the right, a real token never
    sees a pad, and positions 0..len-1 are the defaults. Without a mask, sdpa takes its causal
    flash path and transformers never inspects the mask on the host (a GPU sync per batch)."""
    last = base(input_ids=ids, use_cache=False).last_hidden_state
    return with_final(taps.gather(), last if final else None)


def with_final(taps: torch.Tensor, last: torch.Tensor | None) -> torch.Tensor:
    """The taps in bf16 (shards hold bf16 whatever the compute dtype), the final hidden state
    after them where given."""
    if last is not None:
        taps = torch.cat([taps, last.to(taps.dtype)], -1)  # (B, T, (n_layers + 1)*H)
    return taps.to(torch.bfloat16)


@torch.inference_mode()
def forward_soft_targets(
    base: nn.Module, taps: LayerTaps, head: nn.Module, ids: torch.Tensor, k: int,
    chunk_tokens: int = 4096, final: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """forward_taps plus the soft targets: (B, T, n_layers*H) bf16 taps, and per position t the
    target's k most likely next tokens (B, T, k) int32 with their log-probabilities (B, T, k)
    float16, i.e. its distribution over x_{t+1}. Runs every layer, the final norm (in the base
    model's output) and the LM head; the head goes over at most `chunk_tokens` positions at a
    time (fewer for a large vocabulary: loss.logit_rows), so only (chunk, V) float32 logits
    exist, not (B, T, V). `final`: the normed last hidden state appended to the taps, as
    forward_taps does."""
    last = base(input_ids=ids, use_cache=False).last_hidden_state  # (B, T, H), normed
    hidden = with_final(taps.gather(), last if final else None)
    cap = getattr(base.config, "final_logit_softcapping", None)  # Gemma-2 style targets
    flat = last.flatten(0, 1)  # (B*T, H)
    chunk = logit_rows(head.weight.shape[0], chunk_tokens)
    top_ids, top_logprobs = [], []
    for s in range(0, flat.shape[0], chunk):
        logits = head(flat[s : s + chunk]).float()  # (c, V)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        top = logits.topk(k, dim=-1)  # sorted, most likely first
        logprobs = top.values - logits.logsumexp(-1, keepdim=True)  # (c, k)
        top_ids.append(top.indices.to(torch.int32))
        # float16's lowest finite value: an -inf log-prob would make the loss's p log p NaN
        top_logprobs.append(logprobs.clamp_min(torch.finfo(torch.float16).min).half())
    shape = (*ids.shape, k)
    return hidden, torch.cat(top_ids).view(shape), torch.cat(top_logprobs).view(shape)


def read_sequences(
    path: Path, identity: dict, max_length: int, overflow: str, stats: Counter
) -> list[dict]:
    """Rows of a sequences shard made with this target's tokenizer, fitted to max_length."""
    if not path.is_file():
        raise DataError(f"sequences shard not found: {path}")
    table = pq.read_table(path)
    made_by = json.loads((table.schema.metadata or {}).get(b"target", b"{}"))
    for key in ("tokenizer_sha256", "weights_sha256"):
        if made_by.get(key) != identity[key]:
            raise DataError(
                f"{path} was made by target {made_by.get('name')!r} ({key} {made_by.get(key)}), "
                f"but the configured target {identity['name']!r} has {identity[key]}"
            )
    rows = []
    for r in table.to_pylist():
        if len(r["input_ids"]) > max_length:
            if overflow == "skip" or sum(r["loss_mask"][:max_length]) == 0:
                stats["too_long"] += 1
                continue
            stats["truncated"] += 1
            r["input_ids"], r["loss_mask"] = (
                r["input_ids"][:max_length],
                r["loss_mask"][:max_length],
            )
        rows.append(r)
    return rows


class ShardWriter(threading.Thread):
    """Writes encoded batches, in the order they were submitted, to an Arrow IPC file."""

    def __init__(self, path: Path, schema: pa.Schema, depth: int, direct_io: bool = False):
        super().__init__(daemon=True)
        self.direct_io = direct_io
        self.queue: queue.Queue = queue.Queue(maxsize=depth)  # back-pressure on the GPU loop
        self.path, self.schema = path, schema
        self.error: BaseException | None = None
        self.raw_bytes = self.encoded_bytes = 0

    def run(self) -> None:
        ended = False  # the producer's end mark was taken off the queue
        try:
            # chunks written back as soon as they are full: a shard of tens of GB left dirty in
            # the page cache made the disk lag behind the GPU (benchmarks/RESULTS.md)
            sink = pa.PythonFile(ChunkedFile(self.path, direct=self.direct_io), mode="w")
            with sink, pa.ipc.new_file(sink, self.schema) as w:
                while (item := self.queue.get()) is not None:
                    rows = [f.result() for f in item]
                    w.write_batch(record_batch(rows, self.schema))
                    faults.point("extract.written")
                    self.encoded_bytes += sum(
                        len(r["hidden"]) + len(r["scales"] or b"") for r in rows
                    )
                    self.raw_bytes += sum(r["raw_bytes"] for r in rows)
                ended = True
        except BaseException as e:  # surfaced by the main thread
            self.error = e
            # keep draining so the producer never blocks; a write error can also surface only
            # when the file is closed, after the end mark (the chunks are written in the
            # background), and then there is nothing left to drain
            while not ended and self.queue.get() is not None:
                pass


class Extractor:
    """The stage's pipeline for one shard (see the module docstring)."""

    def __init__(self, cfg: Config, base: nn.Module, layer_ids: list[int], device: torch.device,
                 head: nn.Module | None = None):  # fmt: skip
        ex = cfg.extract
        self.codec, self.level, self.budget = ex.codec, ex.zstd_level, ex.token_budget
        self.group = group_of(ex.codec, ex.group_size)  # fp4-zstd's; None for the others
        if self.group is not None:
            check_group(self.group, base.config.hidden_size)
        self.direct_io, self.topk, self.final = ex.direct_io, ex.topk, ex.final_hidden
        if self.topk and head is None:
            raise ValueError("extract.topk > 0 needs the target's LM head")
        self.base, self.head, self.device, self.layer_ids = base, head, device, layer_ids
        self.taps = LayerTaps(base, layer_ids)
        self.blocks = len(layer_ids) + self.final  # the final hidden state: one more layer
        self.width = self.blocks * base.config.hidden_size
        workers = ex.encode_workers or max(1, min(16, (os.cpu_count() or 2) - 1))
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="encode")
        self.pinned = device.type == "cuda"
        # seconds: the launching thread blocked on the GPU (copy not done yet) and on the writer's
        # full queue (host side behind), and until the last batch was handed over (the rest of
        # a run is the writer draining); the benchmark reports them
        self.timing: Counter = Counter()

    def _encode_row(self, row: dict, parts: tuple[torch.Tensor, ...], soft: tuple | None) -> dict:
        enc = pack(parts, self.codec, self.level)
        topk = pack_topk(*soft, self.level) if soft is not None else None
        out = feature_row(row["sample_id"], row["input_ids"], row["loss_mask"], enc, topk)
        return out | {"raw_bytes": len(row["input_ids"]) * self.width * 2}

    def _launch(self, rows: list[dict]):
        """Forward one batch and start its device-to-host copy; returns what the host needs."""
        lengths = [len(r["input_ids"]) for r in rows]
        ids = torch.zeros((len(rows), max(lengths)), dtype=torch.long, pin_memory=self.pinned)
        for b, r in enumerate(rows):
            ids[b, : lengths[b]] = torch.tensor(r["input_ids"])
        ids_d = ids.to(self.device, non_blocking=True)
        # from pinned memory, asynchronously: `new_tensor(lengths)` copied from pageable memory,
        # which waited for the forward to finish, so the host and the GPU took turns
        lengths_d = torch.tensor(lengths, pin_memory=self.pinned).to(self.device, non_blocking=True)
        soft: list[torch.Tensor] = []
        if self.topk:
            hidden, *soft = forward_soft_targets(
                self.base, self.taps, self.head, ids_d, self.topk, final=self.final
            )
        else:
            hidden = forward_taps(self.base, self.taps, ids_d, self.final)
        positions = torch.arange(ids.shape[1], device=self.device)
        pad = positions >= lengths_d.unsqueeze(1)  # (B, T)
        finite = torch.isfinite(hidden).logical_or(pad[..., None]).flatten(1).all(1)  # (B,)
        if soft:  # NaN logits give NaN log-probs (the clamp to float16's range keeps NaN)
            finite &= torch.isfinite(soft[1]).logical_or(pad[..., None]).flatten(1).all(1)
        parts = prepare(hidden, self.codec, self.blocks, self.group)
        host = [self._to_host(p) for p in parts]
        soft_host = [self._to_host(p) for p in soft]  # top-k ids, log-probs
        finite_host = finite.to("cpu", non_blocking=True)
        event = torch.cuda.Event() if self.pinned else None
        if event is not None:
            event.record()
        return rows, host, soft_host, finite_host, event

    def _to_host(self, part: torch.Tensor) -> torch.Tensor:
        """A non-blocking copy into a (pinned, on GPU) host buffer (planes / fp8 are prepared on
        the GPU, so only what gets compressed crosses)."""
        buf = torch.empty(part.shape, dtype=part.dtype, pin_memory=self.pinned)
        return buf.copy_(part, non_blocking=True)

    def _hand_over(self, launched, writer: ShardWriter, stats: Counter) -> None:
        rows, host, soft_host, finite, event = launched
        t = time.perf_counter()
        if event is not None:
            event.synchronize()  # the copy of this batch is complete (the next batch is running)
        self.timing["blocked_on_gpu"] += time.perf_counter() - t
        futures: list[Future] = []
        for b, r in enumerate(rows):
            if not bool(finite[b]):
                stats["nan_or_inf"] += 1
                continue
            n = len(r["input_ids"])
            parts = tuple(h[b, :n] for h in host)
            soft = tuple(h[b, :n] for h in soft_host) or None
            futures.append(self.pool.submit(self._encode_row, r, parts, soft))
        faults.point("extract.batch")
        t = time.perf_counter()
        writer.queue.put(futures)
        self.timing["blocked_on_host"] += time.perf_counter() - t

    def run(self, rows: list[dict], out: Path, info: ShardInfo, stats: Counter,
            before_rename: Callable[[], None] | None = None) -> None:  # fmt: skip
        batches = plan_batches([len(r["input_ids"]) for r in rows], self.budget)
        bar = tqdm(
            total=sum(len(r["input_ids"]) for r in rows), desc="extract", unit=" tok", mininterval=2
        )
        start, pending = time.perf_counter(), None
        try:
            with atomic_path(out) as tmp:
                schema = feature_schema(info.topk).with_metadata(info.metadata())
                writer = ShardWriter(tmp, schema, depth=4, direct_io=self.direct_io)
                writer.start()
                try:
                    for batch in batches:
                        launched = self._launch([rows[i] for i in batch])
                        if pending is not None:
                            self._hand_over(pending, writer, stats)
                            self._progress(bar, pending[0], writer, start)
                        pending = launched
                    if pending is not None:
                        self._hand_over(pending, writer, stats)
                        self._progress(bar, pending[0], writer, start)
                    self.timing["loop"] += time.perf_counter() - start
                finally:
                    writer.queue.put(None)
                    writer.join()
                if writer.error is not None:
                    raise writer.error
                if before_rename is not None:
                    before_rename()
        finally:
            bar.close()

    def _progress(self, bar: tqdm, rows: list[dict], writer: ShardWriter, start: float) -> None:
        tokens = sum(len(r["input_ids"]) for r in rows)
        bar.update(tokens)
        mb_s = writer.encoded_bytes / 1e6 / (time.perf_counter() - start)
        ratio = writer.raw_bytes / max(1, writer.encoded_bytes)
        bar.set_postfix(written_mb_s=f"{mb_s:.1f}", ratio=f"{ratio:.2f}x")

    def close(self) -> None:
        self.taps.remove()
        self.pool.shutdown()


def layer_ids_for(cfg: Config, num_target_layers: int) -> list[int]:
    from dflashpipe.layout import check_taps, default_target_layer_ids
    from dflashpipe.preflight import target_name

    ids = cfg.drafter.target_layer_ids or default_target_layer_ids(
        num_target_layers, cfg.drafter.num_target_layers
    )
    check_taps(ids, num_target_layers, "drafter.target_layer_ids", target_name(cfg.target))
    return list(ids)


@dataclass(frozen=True)
class ExtractPaths:
    """What one extract job reads and writes: a sequences shard, its index, and the feature
    shard (its .stats.json beside it)."""

    sequences: Path
    shard: int
    out: Path


def run(cfg: Config, paths: ExtractPaths, lease: DeviceLease = ANY_DEVICE) -> None:
    """Write one feature shard (and its .stats.json) from one sequences shard; the device is
    held from the target's loading to the shard's rename."""
    from dflashpipe.preflight import check_before_loading
    from dflashpipe.shards import stats_path
    from dflashpipe.storage import write_json
    from dflashpipe.target import load_target, target_identity

    out_path, shard = Path(paths.out), paths.shard
    if out_path.is_file() and stats_path(out_path).is_file():
        log.info("%s is complete; not redone", out_path)
        return
    ex = cfg.extract
    check_before_loading(cfg)  # taps, topk, mask id: before a device is taken or weights load
    with lease.hold() as device:
        # soft targets come out of the LM head: the whole causal LM, not just the base model
        model, tok = load_target(cfg.target, device, base_only=not ex.topk)
        base, head = (
            (model.get_decoder(), model.get_output_embeddings()) if ex.topk else (model, None)
        )
        identity = json.loads(target_identity(cfg.target, tok).to_json())
        stats: Counter = Counter()
        rows = read_sequences(Path(paths.sequences), identity, ex.max_length, ex.overflow, stats)
        layer_ids = layer_ids_for(cfg, base.config.num_hidden_layers)
        group = group_of(ex.codec, ex.group_size)  # checked against the hidden size by Extractor
        info = ShardInfo(ex.codec, layer_ids, base.config.hidden_size, identity, ex.topk, group,
                         ex.final_hidden)  # fmt: skip
        if not (ex.topk or ex.final_hidden):  # else every layer runs: the final norm reads the last
            truncate_base(base, max(layer_ids))
        log.info(
            "shard %d: %d samples on %s, layers %s, codec %s%s, %s",
            shard,
            len(rows),
            device,
            layer_ids,
            info.codec,
            f" (groups of {group})" if group else "",
            f"top-{ex.topk} soft targets (all {len(base.layers)} layers and the LM head run)"
            if ex.topk
            else f"no soft targets (layers 0-{len(base.layers) - 1} run)",
        )
        if ex.final_hidden:
            log.info("the target's final hidden state (after its last norm) stored after the taps")
        tokens = sum(len(r["input_ids"]) for r in rows)

        def write_stats() -> None:  # before the shard's rename: a shard in place has its stats
            kept = len(rows) - stats["nan_or_inf"]
            write_json(
                stats_path(out_path), {"samples": kept, "tokens": tokens, "skipped": dict(stats)}
            )

        extractor = Extractor(cfg, base, layer_ids, device, head)
        start = time.perf_counter()
        try:
            extractor.run(rows, out_path, info, stats, before_rename=write_stats)
        finally:
            extractor.close()
        t, elapsed = extractor.timing, time.perf_counter() - start
        log.info(
            "shard %d: %.0f tok/s; %.1f s in all, GPU loop %.1f s (waited on the GPU %.1f s, on "
            "the encoders and writer %.1f s)",
            shard,
            tokens / elapsed,
            elapsed,
            t["loop"],
            t["blocked_on_gpu"],
            t["blocked_on_host"],
        )
    kept = len(rows) - stats["nan_or_inf"]
    log.info(
        "shard %d: %d samples, %d bytes, skipped %s",
        shard,
        kept,
        out_path.stat().st_size,
        dict(stats),
    )
