"""Codecs for a sample's hidden-state block, a (T, n_layers * H) bf16 tensor on the CPU.

- `raw`:       the bf16 bytes.
- `bf16-zstd`: lossless. The high bytes of bf16 (sign + exponent + 1 mantissa bit) repeat a lot,
               the low bytes are nearly random; zstd'ing each byte plane on its own lets the
               first compress well instead of being diluted by the second.
- `fp8-zstd`:  float8 e4m3 with one float32 scale per token and layer (amax / 448), then zstd.

`encode` returns the fields stored in the shard row; `decode` gives the bf16 tensor back. Both
run in worker threads/processes and never touch CUDA (zstd and numpy release the GIL).
"""

from __future__ import annotations

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
    hidden: bytes  # the encoded block
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


def encode(block: torch.Tensor, codec: str, n_layers: int, level: int = 3) -> Encoded:
    """Encode a (T, n_layers * H) bf16 CPU tensor."""
    if block.dtype != torch.bfloat16 or block.dim() != 2:
        raise ValueError(f"expected a 2-D bfloat16 block, got {block.dtype} {tuple(block.shape)}")
    if codec == "raw":
        return Encoded(block.contiguous().view(torch.int16).numpy().tobytes())
    if codec == "bf16-zstd":
        planes = block.contiguous().view(torch.int16).numpy().view(np.uint8).reshape(-1, 2)
        # little endian: column 1 holds sign + exponent, column 0 the low mantissa bits
        high = _compressor(level).compress(np.ascontiguousarray(planes[:, 1]))
        low = _compressor(level).compress(np.ascontiguousarray(planes[:, 0]))
        return Encoded(high + low, split=len(high))
    if codec == "fp8-zstd":
        T = block.shape[0]
        x = block.float().view(T, n_layers, -1)  # (T, L, H)
        scales = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)  # (T, L, 1)
        q = (x / scales).to(torch.float8_e4m3fn)
        payload = _compressor(level).compress(q.view(torch.uint8).numpy().tobytes())
        return Encoded(payload, scales=scales.squeeze(-1).numpy().tobytes())
    raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")


def decode(enc: Encoded, codec: str, num_tokens: int, width: int, n_layers: int) -> torch.Tensor:
    """The (num_tokens, width) bf16 tensor of an encoded block."""
    n = num_tokens * width
    try:
        if codec == "raw":
            data = np.frombuffer(enc.hidden, dtype=np.int16, count=n)
            return torch.from_numpy(data.copy()).view(torch.bfloat16).view(num_tokens, width)
        if codec == "bf16-zstd":
            planes = np.empty((n, 2), dtype=np.uint8)
            d = _decompressor()
            planes[:, 1] = np.frombuffer(d.decompress(enc.hidden[: enc.split]), dtype=np.uint8)
            planes[:, 0] = np.frombuffer(d.decompress(enc.hidden[enc.split :]), dtype=np.uint8)
            return torch.from_numpy(planes.view(np.int16).reshape(num_tokens, width)).view(
                torch.bfloat16
            )
        if codec == "fp8-zstd":
            raw = np.frombuffer(_decompressor().decompress(enc.hidden), dtype=np.uint8).copy()
            q = torch.from_numpy(raw).view(torch.float8_e4m3fn).view(num_tokens, n_layers, -1)
            scales = torch.from_numpy(np.frombuffer(enc.scales, dtype=np.float32).copy())
            x = q.float() * scales.view(num_tokens, n_layers, 1)
            return x.view(num_tokens, width).to(torch.bfloat16)
    except (zstandard.ZstdError, ValueError, TypeError) as e:
        raise DataError(f"cannot decode a {codec} block of {num_tokens}x{width}: {e}") from None
    raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")
