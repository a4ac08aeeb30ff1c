"""Codecs for a sample's hidden-state block, a (T, n_layers * H) bf16 tensor on the CPU.

- `raw`:       the bf16 bytes.
- `bf16-zstd`: lossless. The high bytes of bf16 (sign + 7 exponent bits) repeat a lot, the
               low bytes (last exponent bit + mantissa) are nearly random; zstd'ing each byte plane on its own lets the
               first compress well instead of being diluted by the second.
- `fp8-zstd`:  float8 e4m3 with one float32 scale per token and layer (amax / 448), then zstd.

`encode` = `prepare` (element-wise, on whatever device holds the block: the GPU in extract) then
`pack` (zstd, on the CPU, in worker threads that never touch CUDA; zstd releases the GIL).
`decode` gives the bf16 tensor back.

A sample's top-k soft targets (extract.topk > 0), a (T, k) int32 id tensor and a (T, k) float16
log-prob tensor, are stored losslessly whatever the hidden-state codec: one zstd frame each
(`pack_topk` / `decode_topk`); at k = 8 that is under 50 bytes a token beside a hidden block of
kilobytes.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from dflashpipe.errors import DataError

CODECS = ("bf16-zstd", "fp8-zstd", "raw")
FP8_MAX = 448.0  # largest finite float8 e4m3fn
_local = threading.local()  # zstd contexts are not thread-safe: one per thread


@dataclass
class Encoded:
    hidden: bytes | np.ndarray  # the encoded block (pack gives a uint8 array, shards give bytes)
    split: int | None = None  # bf16-zstd: byte length of the first (high-byte) frame
    scales: bytes | None = None  # fp8-zstd: float32 (T, n_layers)


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


def prepare(block: torch.Tensor, codec: str, n_layers: int) -> tuple[torch.Tensor, ...]:
    """The element-wise half of encoding, done wherever `block` lives (the GPU, in extract):
    bf16 (..., n_layers * H) -> the tensors `pack` compresses. Splitting byte planes or
    quantizing here leaves only zstd for the CPU, and fp8 halves the device-to-host copy."""
    if block.dtype != torch.bfloat16:
        raise ValueError(f"expected a bfloat16 block, got {block.dtype} {tuple(block.shape)}")
    if codec == "raw":
        return (block.view(torch.int16),)
    if codec == "bf16-zstd":
        bits = block.view(torch.int16)
        # high byte: sign + 7 exponent bits (repetitive); low byte: 1 exponent + 7 mantissa bits
        return ((bits >> 8).to(torch.uint8), (bits & 0xFF).to(torch.uint8))
    if codec == "fp8-zstd":
        x = block.float().unflatten(-1, (n_layers, -1))  # (..., L, H)
        scales = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)  # (..., L, 1)
        q = (x / scales).to(torch.float8_e4m3fn).view(torch.uint8).flatten(-2)  # (..., L*H)
        return (q, scales.squeeze(-1))
    raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")


def pack(parts: tuple[torch.Tensor, ...], codec: str, level: int = 1) -> Encoded:
    """The compressing half of encoding, on CPU tensors from `prepare` (one sample)."""
    # Copies go through numpy, which releases the GIL (bytes concatenation does not): extract
    # runs this in many threads beside the thread that launches the GPU work.
    z = _compressor(level)
    if codec == "raw":
        return Encoded(parts[0].contiguous().numpy().view(np.uint8).reshape(-1).copy())
    if codec == "bf16-zstd":
        high = z.compress(parts[0].contiguous().numpy())
        low = z.compress(parts[1].contiguous().numpy())
        joined = np.concatenate([np.frombuffer(high, np.uint8), np.frombuffer(low, np.uint8)])
        return Encoded(joined, split=len(high))
    if codec == "fp8-zstd":
        return Encoded(
            z.compress(parts[0].contiguous().numpy()),
            scales=parts[1].contiguous().numpy().tobytes(),
        )
    raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")


def encode(block: torch.Tensor, codec: str, n_layers: int, level: int = 1) -> Encoded:
    """Encode a (T, n_layers * H) bf16 CPU tensor."""
    if block.dim() != 2:
        raise ValueError(f"expected a 2-D bfloat16 block, got {block.dtype} {tuple(block.shape)}")
    return pack(prepare(block, codec, n_layers), codec, level)


def _planes(n: int) -> tuple[np.ndarray, np.ndarray]:
    """This thread's two n-byte scratch planes, reused across blocks: a fresh 60 MB buffer per
    block costs as much in page faults as decompressing into it."""
    planes = getattr(_local, "planes", None)
    if planes is None or planes[0].size < n:
        planes = _local.planes = (np.empty(n, np.uint8), np.empty(n, np.uint8))
    return planes[0][:n], planes[1][:n]


def _decompress_into(frame, dst: np.ndarray) -> None:
    """Decompress one zstd frame into dst, which it must fill exactly."""
    reader = _decompressor().stream_reader(frame)
    view, got = memoryview(dst), 0
    while got < dst.size and (k := reader.readinto(view[got:])):
        got += k
    if got != dst.size:
        raise ValueError(f"a plane holds {got} bytes, expected {dst.size}")
    if reader.read(1):
        raise ValueError(f"a plane holds more than the expected {dst.size} bytes")


def _fp8_parts(
    enc: Encoded, num_tokens: int, width: int, n_layers: int
) -> tuple[np.ndarray, np.ndarray]:
    """An fp8-zstd block's e4m3 bytes (num_tokens, width) uint8 and scales (num_tokens,
    n_layers) float32, read-only views, checked for size (ValueError)."""
    raw = np.frombuffer(_decompressor().decompress(enc.hidden), dtype=np.uint8)
    if raw.size != num_tokens * width:
        raise ValueError(f"the block holds {raw.size} bytes, expected {num_tokens * width}")
    scales = np.frombuffer(enc.scales, dtype=np.float32)
    if scales.size != num_tokens * n_layers:
        raise ValueError(f"{scales.size} scales, expected {num_tokens}x{n_layers}")
    return raw.reshape(num_tokens, width), scales.reshape(num_tokens, n_layers)


def decode_fp8_undequantized(
    enc: Encoded, num_tokens: int, width: int, n_layers: int, q: torch.Tensor, scales: torch.Tensor
) -> None:
    """An fp8-zstd block's first m tokens as stored, into q (m, width) uint8 and scales
    (m, n_layers) float32 (m <= num_tokens; slices of a packed batch, say), for
    `dequantize_fp8` to finish where the batch goes (the GPU): a CPU loader then only
    decompresses."""
    try:
        raw, s = _fp8_parts(enc, num_tokens, width, n_layers)
    except (zstandard.ZstdError, ValueError, TypeError) as e:
        raise DataError(f"cannot decode a fp8-zstd block of {num_tokens}x{width}: {e}") from None
    m = q.shape[0]
    if (
        q.dtype != torch.uint8
        or q.shape != (m, width)
        or scales.shape != (m, n_layers)
        or m > num_tokens
    ):
        raise ValueError(
            f"q {q.dtype} {tuple(q.shape)} and scales {tuple(scales.shape)}; expected uint8 "
            f"(<= {num_tokens}, {width}) and float32 (same, {n_layers})"
        )
    q.numpy()[:] = raw[:m]
    scales.numpy()[:] = s[:m]


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """bf16 (..., width) of e4m3 bytes q (..., width) uint8 and float32 scales (..., n_layers),
    on whatever device holds them: float32(q) * scale rounded to bf16, bit for bit what
    `decode` gives."""
    x = q.view(torch.float8_e4m3fn).float().unflatten(-1, (scales.shape[-1], -1))
    return (x * scales[..., None]).flatten(-2).to(torch.bfloat16)


@functools.cache
def _fp8_tables() -> tuple[np.ndarray, np.ndarray]:
    """float32 values of the 256 e4m3 bytes (256,), and of every byte pair read as a
    little-endian uint16 (65536, 2). Exact: every e4m3 value is a float32, so a lookup equals
    torch's cast (NaN bytes included)."""
    single = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    pairs = np.arange(65536, dtype=np.uint32)
    return single, np.stack([single[pairs & 0xFF], single[pairs >> 8]], axis=1)


def _fp8_to_float32(raw: np.ndarray) -> np.ndarray:
    """e4m3 bytes (k,) -> a new float32 array (k,) by table lookup: on one CPU core about 3x
    torch's fp8 -> float32 cast; two bytes per lookup where k is even (a 512 KB table)."""
    single, pairs = _fp8_tables()
    if raw.size % 2:
        return np.take(single, raw)
    return np.take(pairs, raw.view("<u2"), axis=0).reshape(-1)


def decode(
    enc: Encoded,
    codec: str,
    num_tokens: int,
    width: int,
    n_layers: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The (num_tokens, width) bf16 tensor of an encoded block. With `out`, a contiguous
    (m, width) bf16 CPU tensor with m <= num_tokens (a slice of a packed batch, say), the first m
    tokens are written there, with no intermediate copy of the block, and `out` is returned."""
    n = num_tokens * width
    if out is None:
        out = torch.empty(num_tokens, width, dtype=torch.bfloat16)
    elif (
        out.dtype != torch.bfloat16
        or out.shape[1:] != (width,)
        or out.shape[0] > num_tokens
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"out is {out.dtype} {tuple(out.shape)}; expected a contiguous bfloat16 "
            f"(<= {num_tokens}, {width})"
        )
    m = out.shape[0] * width
    dst = out.view(torch.int16).numpy().reshape(-1).view(np.uint16)  # shares out's memory
    try:
        if codec == "raw":
            data = np.frombuffer(enc.hidden, dtype=np.uint16, count=n)
            dst[:] = data[:m]
            return out
        if codec == "bf16-zstd":
            high, low = _planes(n)
            _decompress_into(enc.hidden[: enc.split], high)
            _decompress_into(enc.hidden[enc.split :], low)
            np.left_shift(high[:m], 8, out=dst, dtype=np.uint16)
            np.bitwise_or(dst, low[:m], out=dst)
            return out
        if codec == "fp8-zstd":
            raw, scales = _fp8_parts(enc, num_tokens, width, n_layers)
            rows = out.shape[0]  # only the tokens asked for are dequantized
            x = _fp8_to_float32(raw[:rows].reshape(-1)).reshape(rows, n_layers, -1)
            np.multiply(x, scales[:rows, :, None], out=x)
            out.copy_(torch.from_numpy(x).view(rows, width))  # float32 -> bf16, rounded
            return out
    except (zstandard.ZstdError, ValueError, TypeError) as e:
        raise DataError(f"cannot decode a {codec} block of {num_tokens}x{width}: {e}") from None
    raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")


TOPK_DTYPES = (torch.int32, torch.float16)  # ids, log-probs


def pack_topk(ids: torch.Tensor, logprobs: torch.Tensor, level: int = 1) -> tuple[bytes, bytes]:
    """One sample's top-k soft targets, (T, k) int32 ids and (T, k) float16 log-probs on the
    CPU, as two zstd frames."""
    if (ids.dtype, logprobs.dtype) != TOPK_DTYPES or ids.dim() != 2 or ids.shape != logprobs.shape:
        raise ValueError(
            f"expected (T, k) int32 ids and float16 log-probs, got {ids.dtype} "
            f"{tuple(ids.shape)} and {logprobs.dtype} {tuple(logprobs.shape)}"
        )
    z = _compressor(level)
    return z.compress(ids.contiguous().numpy()), z.compress(logprobs.contiguous().numpy())


def decode_topk(
    ids: bytes, logprobs: bytes, num_tokens: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_tokens, k) int32 ids and float16 log-probs of two frames from `pack_topk`."""
    out = []
    for name, frame, dtype in (("ids", ids, np.int32), ("log-probs", logprobs, np.float16)):
        try:
            raw = _decompressor().decompress(frame)
        except (zstandard.ZstdError, TypeError) as e:
            raise DataError(f"cannot decode the top-k {name} of {num_tokens}x{k}: {e}") from None
        want = num_tokens * k * np.dtype(dtype).itemsize
        if len(raw) != want:
            raise DataError(
                f"the top-k {name} hold {len(raw)} bytes, expected {want} ({num_tokens}x{k})"
            )
        out.append(torch.from_numpy(np.frombuffer(raw, dtype).copy()).view(num_tokens, k))
    return out[0], out[1]
