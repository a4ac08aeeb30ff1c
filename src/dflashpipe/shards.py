"""Feature shards: Arrow IPC files of target hidden states, and the manifest that vouches for them.

One row per sample: `sample_id`, `input_ids` (int32), `loss_mask` (uint8), `num_tokens`, the
encoded `hidden` block (T, n_layers * H) and its codec fields (`hidden_split`, `scales`); with
top-k soft targets (extract.topk = k > 0) also `topk_ids` and `topk_logprobs`: zstd frames of
(T, k) int32 / float16, row t the target's k most likely tokens at t + 1 (codecs.pack_topk). With
the target's final hidden states (extract.final_hidden) `hidden` holds one more block of H after
the taps' (T, (n_layers + 1) * H): row t the target's last hidden state after its final norm,
whose LM head output is its distribution over x_{t+1}; the codec treats it as one more layer
(its own scale per token). The schema metadata names the codec (and fp4-zstd's group size),
dtype, layer ids, hidden size, top-k, final_hidden, format version and the target, so a consumer
can refuse a shard it does not fit. Files are memory-mappable.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from dflashpipe.codecs import (
    CODECS,
    GROUPED,
    Encoded,
    decode,
    decode_stored,
    decode_topk,
)
from dflashpipe.errors import DataError, IntegrityError
from dflashpipe.storage import cached_sha256

FORMAT_VERSION = "1"

FEATURE_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("num_tokens", pa.int32()),
        ("hidden", pa.large_binary()),
        ("hidden_split", pa.int64()),
        ("scales", pa.binary()),
    ]
)
TOPK_COLUMNS = ("topk_ids", "topk_logprobs")


def feature_schema(topk: int = 0) -> pa.Schema:
    """The columns of a shard (without metadata): the top-k columns only where k > 0."""
    if not topk:
        return FEATURE_SCHEMA
    return pa.schema([*FEATURE_SCHEMA, *(pa.field(name, pa.binary()) for name in TOPK_COLUMNS)])


@dataclass(frozen=True)
class ShardInfo:
    """What a shard's schema metadata promises about its hidden states."""

    codec: str
    layer_ids: list[int]
    hidden_size: int
    target: dict
    topk: int = 0  # k of the top-k soft-target columns; 0: the shard has none
    group_size: int | None = None  # fp4-zstd's elements per scale; None for the other codecs
    final_hidden: bool = False  # `hidden` ends with the target's normed last hidden state

    @property
    def blocks(self) -> int:
        """Blocks of hidden_size in a row of `hidden`: the taps', and the final one if stored."""
        return len(self.layer_ids) + self.final_hidden

    def metadata(self) -> dict[str, str]:
        return {
            "format_version": FORMAT_VERSION,
            "codec": self.codec,
            "group_size": json.dumps(self.group_size),
            "dtype": "bfloat16",
            "layer_ids": json.dumps(self.layer_ids),
            "hidden_size": str(self.hidden_size),
            "target": json.dumps(self.target, sort_keys=True),
            "topk": str(self.topk),
            # only where stored: a shard without it stays byte for byte what it was before
        } | ({"final_hidden": "true"} if self.final_hidden else {})

    @classmethod
    def from_metadata(cls, meta: dict[bytes, bytes], path: Path) -> ShardInfo:
        try:
            m = {k.decode(): v.decode() for k, v in meta.items()}
            if m["format_version"] != FORMAT_VERSION:
                raise DataError(
                    f"{path}: format version {m['format_version']}, expected {FORMAT_VERSION}"
                )
            if m["codec"] not in CODECS:
                raise DataError(f"{path}: unknown codec {m['codec']!r}; known: {list(CODECS)}")
            group = json.loads(m.get("group_size", "null"))  # older shards: no grouped codec
            if (group is None) == (m["codec"] in GROUPED):
                raise DataError(f"{path}: codec {m['codec']} with group size {group}")
            return cls(
                m["codec"],
                json.loads(m["layer_ids"]),
                int(m["hidden_size"]),
                json.loads(m["target"]),
                int(m.get("topk", 0)),  # shards written before soft targets existed have none
                group,
                json.loads(m.get("final_hidden", "false")),  # older shards: none stored
            )
        except (KeyError, AttributeError, ValueError) as e:
            raise DataError(f"{path}: not a dflashpipe feature shard (metadata: {e})") from None


def stats_path(shard: Path) -> Path:
    return shard.with_name(shard.stem + ".stats.json")


def record_batch(rows: list[dict], schema: pa.Schema = FEATURE_SCHEMA) -> pa.RecordBatch:
    """Rows -> one record batch of `schema` (feature_schema's), building the big `hidden` column
    from buffers: converting Python bytes objects one by one runs at ~250 MB/s under the GIL, a
    numpy concatenation at memcpy speed without the GIL (zero-copy for a single row)."""
    n = len(rows)
    hidden = [r["hidden"] for r in rows]
    offsets = np.zeros(n + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(h) for h in hidden])
    planes = [np.frombuffer(h, np.uint8) for h in hidden] or [np.empty(0, np.uint8)]
    data = pa.py_buffer(hidden[0] if n == 1 else np.concatenate(planes))
    columns = {
        "sample_id": pa.array([r["sample_id"] for r in rows], pa.string()),
        "input_ids": pa.array([r["input_ids"] for r in rows], pa.list_(pa.int32())),
        "loss_mask": pa.array([r["loss_mask"] for r in rows], pa.list_(pa.uint8())),
        "num_tokens": pa.array([r["num_tokens"] for r in rows], pa.int32()),
        "hidden": pa.LargeBinaryArray.from_buffers(
            pa.large_binary(), n, [None, pa.py_buffer(offsets), data]
        ),
        "hidden_split": pa.array([r["hidden_split"] for r in rows], pa.int64()),
        "scales": pa.array([r["scales"] for r in rows], pa.binary()),
    }
    for name in TOPK_COLUMNS:
        if name in schema.names:
            columns[name] = pa.array([r[name] for r in rows], pa.binary())
    return pa.RecordBatch.from_arrays(list(columns.values()), schema=schema.remove_metadata())


def feature_row(
    sample_id: str,
    input_ids: list[int],
    loss_mask: list[int],
    enc: Encoded,
    topk: tuple[bytes, bytes] | None = None,
) -> dict:
    """One shard row; `topk`: the sample's (ids, log-probs) frames from codecs.pack_topk."""
    row = {
        "sample_id": sample_id,
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "num_tokens": len(input_ids),
        "hidden": enc.hidden,
        "hidden_split": enc.split,
        "scales": enc.scales,
    }
    if topk is not None:
        row.update(zip(TOPK_COLUMNS, topk, strict=True))
    return row


def write_shard(path: Path, rows: list[dict], info: ShardInfo) -> Path:
    """A feature shard file of `rows` (feature_row's), a record batch per row, `info` in its
    schema metadata; what extract's writer makes, in one call (benchmarks' and tests' shards)."""
    schema = feature_schema(info.topk).with_metadata(info.metadata())
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as w:
        for r in rows:
            w.write_batch(record_batch([r], schema))
    return path


class FeatureShard:
    """A memory-mapped feature shard: random access to decoded samples."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"feature shard not found: {self.path}")
        try:
            self._reader = pa.ipc.open_file(pa.memory_map(str(self.path), "r"))
        except pa.ArrowInvalid as e:
            raise DataError(f"{self.path}: not an Arrow IPC file ({e})") from None
        self.info = ShardInfo.from_metadata(self._reader.schema.metadata or {}, self.path)
        columns = feature_schema(self.info.topk).names
        missing = [n for n in columns if n not in self._reader.schema.names]
        if missing:
            raise DataError(
                f"{self.path}: columns {missing} are missing; a shard of topk {self.info.topk} "
                f"has {columns}"
            )
        self.table = self._reader.read_all()
        self._small = [n for n in columns if n != "hidden"]
        self._chunk_starts: np.ndarray | None = None

    def __len__(self) -> int:
        return self.table.num_rows

    @property
    def stats(self) -> dict:
        """The extract job's counts, from the `.stats.json` written beside the shard."""
        path = stats_path(self.path)
        return json.loads(path.read_text()) if path.is_file() else {}

    def sample(self, i: int, out: torch.Tensor | None = None) -> dict:
        """Row i with `hidden` decoded to a (T, blocks * H) bf16 tensor (ShardInfo.blocks); with
        `out` (a contiguous bf16 (m, blocks * H), m <= T, e.g. a slice of a packed batch) its first m
        tokens are decoded into `out`, which becomes `hidden`. The encoded block is read straight
        from the memory-mapped file. A shard with soft targets gives `topk_ids` (T, k) int32 and
        `topk_logprobs` (T, k) float16 too."""
        row, enc = self._row(i)
        n_layers = self.info.blocks  # the final hidden state, if stored, is one more layer
        try:
            row["hidden"] = decode(
                enc, self.info.codec, row["num_tokens"], n_layers * self.info.hidden_size,
                n_layers, out=out, group_size=self.info.group_size,
            )  # fmt: skip
        except DataError as e:
            raise DataError(f"{self.path}, row {i}: {e}") from None
        return row

    def sample_stored(self, i: int, parts: tuple[torch.Tensor, ...]) -> dict:
        """Row i of a quantized shard (fp8-zstd, fp4-zstd) with its first m tokens' arrays as
        stored written into `parts` ((m, length) each, codecs.stored_parts' order), not
        dequantized (codecs.dequantize finishes them on the training device); `hidden` is
        None."""
        row, enc = self._row(i)
        n_layers = self.info.blocks  # the final hidden state, if stored, is one more layer
        try:
            decode_stored(enc, self.info.codec, row["num_tokens"],
                          n_layers * self.info.hidden_size, n_layers, parts,
                          self.info.group_size)  # fmt: skip
        except DataError as e:
            raise DataError(f"{self.path}, row {i}: {e}") from None
        row["hidden"] = None
        return row

    def _row(self, i: int) -> tuple[dict, Encoded]:
        """Row i's small columns (input_ids, loss_mask as tensors; soft targets decoded) and its
        encoded hidden block."""
        row = self.table.select(self._small).slice(i, 1).to_pylist()[0]
        enc = Encoded(self._hidden_buffer(i), row["hidden_split"], row["scales"])
        row["input_ids"] = torch.tensor(row["input_ids"], dtype=torch.int32)
        row["loss_mask"] = torch.tensor(row["loss_mask"], dtype=torch.uint8)
        if self.info.topk:
            try:
                row["topk_ids"], row["topk_logprobs"] = decode_topk(
                    row["topk_ids"], row["topk_logprobs"], row["num_tokens"], self.info.topk
                )
            except DataError as e:
                raise DataError(f"{self.path}, row {i}: {e}") from None
        return row, enc

    def _hidden_buffer(self, i: int) -> pa.Buffer:
        """Row i's encoded block as a zero-copy slice of the mapped file (to_pylist would copy
        the whole block into a Python bytes object first)."""
        column = self.table.column("hidden")
        if self._chunk_starts is None:
            self._chunk_starts = np.cumsum([0] + [len(c) for c in column.chunks])
        c = int(np.searchsorted(self._chunk_starts, i, side="right")) - 1
        chunk, j = column.chunk(c), i - int(self._chunk_starts[c])
        _, offsets, data = chunk.buffers()
        kind = np.int64 if pa.types.is_large_binary(chunk.type) else np.int32
        at = (chunk.offset + j) * np.dtype(kind).itemsize
        start, end = np.frombuffer(offsets, kind, count=2, offset=at)
        return data.slice(int(start), int(end - start))

    def __iter__(self) -> Iterator[dict]:
        for i in range(len(self)):
            yield self.sample(i)


def build_manifest(shard_paths: list[Path]) -> dict:
    """Gather every shard's promises, counts and checksum into one manifest."""
    shards, first = [], None
    for path in shard_paths:
        shard = FeatureShard(path)
        info, stats = shard.info, shard.stats
        if first is None:
            first = info
        elif info != first:
            raise DataError(
                f"{path}: codec/group size/layers/hidden size/target/topk/final_hidden differ from "
                f"{shard_paths[0]}"
            )
        tokens = int(pc.sum(shard.table.column("num_tokens")).as_py() or 0)
        shards.append(
            {"path": str(path), "samples": len(shard), "tokens": tokens, "bytes": path.stat().st_size,
             "sha256": cached_sha256(path), "skipped": stats.get("skipped", {})}
        )  # fmt: skip
    if first is None:
        raise DataError("no feature shards to gather into a manifest")
    skipped: dict[str, int] = {}
    for s in shards:
        for reason, n in s["skipped"].items():
            skipped[reason] = skipped.get(reason, 0) + n
    return {
        "format_version": FORMAT_VERSION,
        "target": first.target,
        "layer_ids": first.layer_ids,
        "hidden_size": first.hidden_size,
        "codec": first.codec,
        "group_size": first.group_size,
        "topk": first.topk,
        **({"final_hidden": True} if first.final_hidden else {}),  # absent: none (as before)
        "totals": {
            "samples": sum(s["samples"] for s in shards),
            "tokens": sum(s["tokens"] for s in shards),
            "bytes": sum(s["bytes"] for s in shards),
            "skipped": skipped,
        },
        "shards": shards,
    }


def check_manifest(manifest: dict, expected: dict) -> None:
    """Refuse features that do not fit a consumer: `expected` maps manifest keys (layer_ids,
    hidden_size, codec, group_size, topk, or target.<field>) to the values the consumer needs."""
    for key, want in expected.items():
        have = manifest
        for part in key.split("."):
            have = have.get(part) if isinstance(have, dict) else None
        if have != want:
            raise DataError(f"feature manifest {key} is {have!r}, but the consumer needs {want!r}")


def verify_shard(path: Path, manifest: dict) -> None:
    """Raise IntegrityError when a shard's bytes are not those the manifest recorded."""
    entry = next((s for s in manifest["shards"] if Path(s["path"]).name == path.name), None)
    if entry is None:
        raise DataError(f"{path} is not listed in the feature manifest")
    if not path.is_file():
        raise DataError(f"feature shard not found: {path} (listed in the manifest)")
    got = cached_sha256(path)  # once per shard, not again on every restart of training
    if got != entry["sha256"]:
        raise IntegrityError(
            f"{path}: sha256 {got} does not match the manifest's {entry['sha256']}"
        )
    info = FeatureShard(path).info
    # manifests written before soft targets / grouped codecs / final hidden states existed lack
    # topk / group_size / final_hidden
    recorded = {"topk": 0, "group_size": None, "final_hidden": False} | manifest
    for key in ("codec", "group_size", "layer_ids", "hidden_size", "topk", "final_hidden"):
        if getattr(info, key) != recorded.get(key):
            raise DataError(
                f"{path}: {key} {getattr(info, key)!r} differs from the manifest's {recorded.get(key)!r}"
            )
