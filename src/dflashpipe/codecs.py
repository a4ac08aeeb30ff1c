"""Codecs for a sample's hidden-state block, a (T, n_layers * H) bf16 tensor on the CPU.

- `raw`:       the bf16 bytes.
- `bf16-zstd`: lossless. The high bytes of bf16 (sign + 7 exponent bits) repeat a lot, the
               low bytes (last exponent bit + mantissa) are nearly random; zstd'ing each byte plane on its own lets the
               first compress well instead of being diluted by the second.
- `fp8-zstd`:  float8 e4m3 with one float32 scale per token and layer (amax / 448), then zstd.
- `fp4-zstd`:  e2m1 (FP4) values, 0, +-0.5, 1, 1.5, 2, 3, 4 and 6, times one scale per group of
               G elements along the hidden size (G = `extract.group_size`, 32 unless set),
               rounded to nearest, two codes a byte; each group's scale is an e4m3 byte
               relative to a float32 one per token and layer (amax / (6 * 448)). Each token's
               FP4_OUTLIERS largest |values| per layer are kept as they are (channel and bf16
               value) and quantized as 0: massive-activation channels would otherwise crush
               the rest of their groups. zstd on the codes, the group scales and the outliers,
               one frame each. On SmolLM2's real features (benchmarks/RESULTS.md, "A 4-bit
               feature codec"), the recipe's 5 taps of 576: 1,453 bytes per token at G 32,
               0.586x fp8-zstd's 2,479; relative error 0.012-0.068 per tapped layer (0.067-0.114
               on the channels that are not massive) against fp8's 0.005-0.022. Measured and not
               kept: the integer grid -7..7 (more error at the same bytes), stochastic rounding
               (0.099 in the worst layer), no outliers (0.113; 0.245 on layer 14's other
               channels).

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

from dflashpipe.errors import ConfigError, DataError

CODECS = ("bf16-zstd", "fp8-zstd", "fp4-zstd", "raw")
GROUPED = ("fp4-zstd",)  # codecs with a scale per group of `group_size` elements
FP8_MAX = 448.0  # largest finite float8 e4m3fn
# elements per scale where extract.group_size is unset (RESULTS.md, "A 4-bit feature codec")
FP4_GROUP = 32
# a grid's 15 values, ascending and symmetric (level 7 is 0): fp4-zstd's, and the integer one
# measured beside it and not kept (benchmarks/codecs.py)
E2M1_LEVELS = (-6.0, -4.0, -3.0, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
INT4_LEVELS = tuple(float(v) for v in range(-7, 8))
# each token's largest |values| per layer that fp4-zstd keeps as they are, beside the 4-bit
# codes (RESULTS.md, "A 4-bit feature codec": 4 take the worst layer's error from 0.113 to 0.068
# for 91 more bytes a token on the recipe)
FP4_OUTLIERS = 4
_local = threading.local()  # zstd contexts are not thread-safe: one per thread


@dataclass
class Encoded:
    hidden: bytes | np.ndarray  # the encoded block (pack gives a uint8 array, shards give bytes)
    split: int | None = None  # bf16-zstd, fp4-zstd: byte length of the first frame
    scales: bytes | None = None  # fp8-zstd, fp4-zstd: float32 (T, n_layers) (fp4: + outliers)


def group_of(codec: str, group_size: int | None) -> int | None:
    """The group size a codec quantizes with: fp4-zstd's (FP4_GROUP when unset); None for the
    codecs without groups, which refuse one (ValueError)."""
    if codec in GROUPED:
        return group_size or FP4_GROUP
    if group_size is not None:
        raise ValueError(f"codec {codec} has no scale groups, but a group size {group_size} is set")
    return None


def check_group(group: int, hidden_size: int, key: str = "extract.group_size") -> None:
    """Refuse a group size that does not split every tapped layer's hidden size evenly (a group
    would straddle two layers) or is odd (values are packed two a byte): ConfigError."""
    if group < 2 or group % 2 or hidden_size % group:
        raise ConfigError(
            f"{key} is {group}, which must be even and divide the target's hidden size "
            f"{hidden_size} (e.g. 16, 32 or 64 where they divide it)"
        )


def quantize_4bit(
    block: torch.Tensor,
    n_layers: int,
    group: int,
    levels: tuple[float, ...] = E2M1_LEVELS,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    outliers: int = FP4_OUTLIERS,
) -> tuple[torch.Tensor, ...]:
    """bf16 (..., n_layers * H) -> on block's device: codes packed two a byte (..., n_layers *
    H / 2) uint8 (the even element in the low nibble), the groups' e4m3 scale bytes (...,
    n_layers * H / group) uint8, the float32 scale of each token's layers (..., n_layers), and
    each token's `outliers` largest |values| per layer as they are, their channels (...,
    n_layers * k) int16 and bf16 values as int16 bits (..., n_layers * k), k = min(outliers,
    H). A value is the nearest of `levels` times its group's scale (`stochastic`: one of the two
    around it, with the probability that makes it unbiased); an outlier's own place codes 0."""
    x = block.float().unflatten(-1, (n_layers, -1))  # (..., L, H)
    k = min(outliers, x.shape[-1])
    where = x.abs().topk(k, dim=-1).indices  # (..., L, k)
    kept = x.gather(-1, where).to(torch.bfloat16).view(torch.int16)
    x = x.scatter(-1, where, 0.0).unflatten(-1, (-1, group))  # (..., L, H/G, G)
    grid = torch.tensor(levels, device=block.device)
    top = grid[-1]
    amax = x.abs().amax(-1)  # (..., L, H/G)
    outer = (amax.amax(-1) / (top * FP8_MAX)).clamp_min(1e-30)  # (..., L)
    inner = (amax / (top * outer[..., None])).to(torch.float8_e4m3fn)  # (..., L, H/G)
    scale = inner.float() * outer[..., None]
    y = torch.where(scale[..., None] > 0, x / scale[..., None].clamp_min(1e-38), 0.0)
    if stochastic:
        low = (torch.bucketize(y, grid, right=True) - 1).clamp(0, len(levels) - 2)
        step = grid[low + 1] - grid[low]
        p = ((y - grid[low]) / step).clamp(0, 1)
        u = torch.rand(p.shape, generator=generator, device=p.device)
        codes = low + (u < p)
    else:
        codes = torch.bucketize(y, (grid[1:] + grid[:-1]) / 2)  # nearest; out of range: the end
    # level i is code (i - 7) mod 16 (sign and magnitude rank; two's complement on the integer
    # grid): a zero byte is two zeros (a pack's padding, an all-zero token); code 8 is unused
    codes = (codes - len(levels) // 2).bitwise_and(0xF).to(torch.uint8).flatten(-3)  # (..., L*H)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return (packed, inner.view(torch.uint8).flatten(-2), outer,
            where.to(torch.int16).flatten(-2), kept.flatten(-2))  # fmt: skip


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


def prepare(
    block: torch.Tensor, codec: str, n_layers: int, group_size: int | None = None
) -> tuple[torch.Tensor, ...]:
    """The element-wise half of encoding, done wherever `block` lives (the GPU, in extract):
    bf16 (..., n_layers * H) -> the tensors `pack` compresses. Splitting byte planes or
    quantizing here leaves only zstd for the CPU, and fp8 halves the device-to-host copy (fp4
    quarters it). `group_size`: fp4-zstd's (None: FP4_GROUP); the other codecs refuse one."""
    if block.dtype != torch.bfloat16:
        raise ValueError(f"expected a bfloat16 block, got {block.dtype} {tuple(block.shape)}")
    group = group_of(codec, group_size) if codec in CODECS else None
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
    if codec == "fp4-zstd":
        return quantize_4bit(block, n_layers, group)
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
    if codec == "fp4-zstd":
        packed, inner, outer, where, kept = (p.contiguous().numpy() for p in parts)
        codes, inner = z.compress(packed), z.compress(inner)
        joined = np.concatenate([np.frombuffer(codes, np.uint8), np.frombuffer(inner, np.uint8)])
        # the layer scales as they are, then the outliers' channels and values in one frame (a
        # frame of their own: beside the group scales they compressed 18 bytes a token worse)
        kept = z.compress(np.concatenate([where.reshape(-1), kept.reshape(-1)]))
        return Encoded(joined, split=len(codes), scales=outer.tobytes() + kept)
    raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")


def encode(
    block: torch.Tensor, codec: str, n_layers: int, level: int = 1, group_size: int | None = None
) -> Encoded:
    """Encode a (T, n_layers * H) bf16 CPU tensor."""
    if block.dim() != 2:
        raise ValueError(f"expected a 2-D bfloat16 block, got {block.dtype} {tuple(block.shape)}")
    return pack(prepare(block, codec, n_layers, group_size), codec, level)


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


# the arrays a quantized codec stores, by name: what a pack carries to the device undecoded
STORED = {
    "fp8-zstd": ("fp8", "scales"),
    "fp4-zstd": ("fp4", "group_scales", "scales", "outlier_channels", "outlier_values"),
}
QUANTIZED = tuple(STORED)


def stored_parts(
    codec: str, width: int, n_layers: int, group_size: int | None = None
) -> tuple[tuple[str, int, torch.dtype], ...]:
    """A quantized codec's arrays as stored, per token: (name, length, dtype) each, in the
    order `decode_stored` fills them and `dequantize` takes them."""
    if codec == "fp8-zstd":
        lengths, dtypes = (width, n_layers), (torch.uint8, torch.float32)
    elif codec == "fp4-zstd":
        kept = n_layers * _outliers(width // n_layers)
        lengths = (width // 2, width // group_of(codec, group_size), n_layers, kept, kept)
        dtypes = (torch.uint8, torch.uint8, torch.float32, torch.int16, torch.int16)  # bf16 bits
    else:
        raise ValueError(
            f"codec {codec!r} has no stored form to dequantize later; {QUANTIZED} have"
        )
    return tuple(zip(STORED[codec], lengths, dtypes, strict=True))


def _outliers(hidden: int) -> int:
    """How many values per token and layer fp4-zstd keeps as they are."""
    return min(FP4_OUTLIERS, hidden)


def decode_stored(
    enc: Encoded,
    codec: str,
    num_tokens: int,
    width: int,
    n_layers: int,
    parts: tuple[torch.Tensor, ...],
    group_size: int | None = None,
) -> None:
    """A quantized block's first m tokens as stored (m <= num_tokens; slices of a packed batch,
    say) into `parts`, CPU tensors of (m, length) of `stored_parts`, for `dequantize` to finish
    where the batch goes (the GPU): a CPU loader then only decompresses."""
    want = stored_parts(codec, width, n_layers, group_size)
    m = parts[0].shape[0] if parts else 0
    if (
        len(parts) != len(want)
        or m > num_tokens
        or any(
            t.dtype != dtype or t.shape != (m, k)
            for t, (_, k, dtype) in zip(parts, want, strict=False)
        )
    ):
        raise ValueError(
            f"parts {[(t.dtype, tuple(t.shape)) for t in parts]}; expected "
            f"{[(dtype, ('m', k)) for _, k, dtype in want]} with m <= {num_tokens}"
        )
    try:
        if codec == "fp8-zstd":
            stored = _fp8_parts(enc, num_tokens, width, n_layers)
        else:
            stored = _fp4_parts(enc, num_tokens, width, n_layers, group_of(codec, group_size))
    except (zstandard.ZstdError, ValueError, TypeError) as e:
        raise DataError(f"cannot decode a {codec} block of {num_tokens}x{width}: {e}") from None
    for t, a in zip(parts, stored, strict=True):
        t.numpy()[:] = a[:m]


def dequantize(parts: tuple[torch.Tensor, ...], codec: str) -> torch.Tensor:
    """bf16 (..., width) of a quantized codec's stored arrays (`stored_parts`' order) on
    whatever device holds them, bit for bit what `decode` gives; fp4's group size is read off
    the shapes."""
    if codec == "fp8-zstd":
        return dequantize_fp8(*parts)
    if codec == "fp4-zstd":
        packed, inner, outer, where, kept = parts
        n_layers = outer.shape[-1]
        grid = torch.tensor(code_values(E2M1_LEVELS), device=packed.device)
        codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)  # (..., width)
        x = grid[codes.long()].unflatten(-1, (inner.shape[-1], -1))  # (..., groups, G)
        per_layer = inner.shape[-1] // n_layers
        scale = inner.view(torch.float8_e4m3fn).float() * outer.repeat_interleave(per_layer, -1)
        x = (x * scale[..., None]).unflatten(-2, (n_layers, -1)).flatten(-2)  # (..., L, H)
        x = x.scatter(-1, where.long().unflatten(-1, (n_layers, -1)),
                      kept.view(torch.bfloat16).float().unflatten(-1, (n_layers, -1)))  # fmt: skip
        return x.flatten(-2).to(torch.bfloat16)
    raise ValueError(f"codec {codec!r} has no stored form to dequantize; {QUANTIZED} have")


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


def code_values(levels: tuple[float, ...]) -> list[float]:
    """The value of each 4-bit code 0..15 of quantize_4bit on `levels` (code 8: never written)."""
    mid = len(levels) // 2
    return [levels[(c + mid) % 16] if (c + mid) % 16 < len(levels) else 0.0 for c in range(16)]


@functools.cache
def _nibble_table(levels: tuple[float, ...]) -> np.ndarray:
    """float32 values of both codes of every byte (256, 2): low nibble, then high."""
    grid = np.array(code_values(levels), np.float32)
    pairs = np.arange(256)
    return np.stack([grid[pairs & 0xF], grid[pairs >> 4]], axis=1)


def dequantize_4bit(
    packed: np.ndarray,
    inner: np.ndarray,
    outer: np.ndarray,
    where: np.ndarray,
    kept: np.ndarray,
    group: int,
    levels: tuple[float, ...] = E2M1_LEVELS,
) -> np.ndarray:
    """float32 (rows, n_layers * H) of quantize_4bit's parts as numpy arrays: packed (rows,
    n_layers * H / 2) uint8, inner (rows, n_layers * H / group) e4m3 bytes, outer (rows,
    n_layers) float32, the outliers' channels (rows, n_layers * k) int16 and bf16 values (rows,
    n_layers * k, as int16 bits); a table lookup per byte, one multiply per value, the outliers
    put back."""
    rows, n_layers = outer.shape
    x = np.take(_nibble_table(levels), packed.reshape(-1), axis=0).reshape(rows, -1, group)
    scale = _fp8_tables()[0][inner].reshape(rows, n_layers, -1) * outer[..., None]
    np.multiply(x, scale.reshape(rows, -1, 1), out=x)
    values = (kept.view(np.uint16).astype(np.uint32) << 16).view(np.float32)  # bf16 -> float32
    x = x.reshape(rows, n_layers, -1)
    np.put_along_axis(x, where.reshape(rows, n_layers, -1).astype(np.intp),
                      values.reshape(rows, n_layers, -1), axis=-1)  # fmt: skip
    return x.reshape(rows, -1)


def _fp4_parts(
    enc: Encoded, num_tokens: int, width: int, n_layers: int, group: int
) -> tuple[np.ndarray, ...]:
    """An fp4-zstd block's packed codes (num_tokens, width / 2), group scale bytes (num_tokens,
    width / group), layer scales (num_tokens, n_layers) and outliers' channels and values
    (num_tokens, n_layers * k) int16 each, checked for size (ValueError)."""
    if enc.split is None or enc.scales is None:
        raise ValueError("the row has no group-scale frame or layer scales (not an fp4 block)")
    codes = np.frombuffer(_decompressor().decompress(enc.hidden[: enc.split]), np.uint8)
    inner = np.frombuffer(_decompressor().decompress(enc.hidden[enc.split :]), np.uint8)
    n_outer = num_tokens * n_layers * 4
    outer = np.frombuffer(enc.scales[:n_outer], np.float32)
    outliers = np.frombuffer(_decompressor().decompress(enc.scales[n_outer:]), np.int16)
    n_kept = num_tokens * n_layers * _outliers(width // n_layers)
    for name, got, want in (("codes", codes.size, num_tokens * width // 2),
                            ("group scales", inner.size, num_tokens * width // group),
                            ("layer scales", outer.size, num_tokens * n_layers),
                            ("outliers", outliers.size, 2 * n_kept)):  # fmt: skip
        if got != want:
            raise ValueError(f"{got} values of {name}, expected {want} (group size {group})")
    where, kept = outliers[:n_kept], outliers[n_kept:]
    return tuple(a.reshape(num_tokens, -1) for a in (codes, inner, outer, where, kept))


def decode(
    enc: Encoded,
    codec: str,
    num_tokens: int,
    width: int,
    n_layers: int,
    out: torch.Tensor | None = None,
    group_size: int | None = None,
) -> torch.Tensor:
    """The (num_tokens, width) bf16 tensor of an encoded block. With `out`, a contiguous
    (m, width) bf16 CPU tensor with m <= num_tokens (a slice of a packed batch, say), the first m
    tokens are written there, with no intermediate copy of the block, and `out` is returned.
    `group_size`: fp4-zstd's, as encoded (None: FP4_GROUP)."""
    n = num_tokens * width
    group = group_of(codec, group_size) if codec in CODECS else None
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
        if codec == "fp4-zstd":
            parts = _fp4_parts(enc, num_tokens, width, n_layers, group)
            rows = out.shape[0]
            x = dequantize_4bit(*(a[:rows] for a in parts), group)
            out.copy_(torch.from_numpy(x))  # float32 -> bf16, rounded
            return out
    # IndexError: a corrupt fp4 outlier channel
    except (zstandard.ZstdError, ValueError, TypeError, IndexError) as e:
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
