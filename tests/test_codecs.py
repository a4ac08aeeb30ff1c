import pytest
import torch

from dflashpipe.codecs import (
    CODECS,
    E2M1_LEVELS,
    INT4_LEVELS,
    check_group,
    decode,
    decode_topk,
    dequantize,
    dequantize_4bit,
    encode,
    pack,
    pack_topk,
    quantize_4bit,
)
from dflashpipe.errors import ConfigError, DataError


def _block(T=37, L=3, H=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, L, H, generator=g) * torch.logspace(-2, 2, L)[None, :, None]
    x[0] = 0  # an all-zero token
    x[1, 0, :4] = torch.tensor([1e4, -1e4, 1e-8, -0.0])
    return x.reshape(T, L * H).to(torch.bfloat16)


@pytest.mark.parametrize("codec", ["raw", "bf16-zstd"])
def test_lossless_codecs_are_bit_exact(codec):
    block = _block()
    enc = encode(block, codec, n_layers=3)
    out = decode(enc, codec, block.shape[0], block.shape[1], 3)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out.view(torch.int16), block.view(torch.int16))


def test_bf16_zstd_compresses_real_looking_states():
    block = _block(T=256)
    enc = encode(block, "bf16-zstd", n_layers=3)
    assert len(enc.hidden) < 0.9 * block.numel() * 2
    assert 0 < enc.split < len(enc.hidden)


def test_fp8_error_is_bounded_per_token_and_layer():
    block = _block()
    enc = encode(block, "fp8-zstd", n_layers=3)
    out = decode(enc, "fp8-zstd", block.shape[0], block.shape[1], 3).float().view(37, 3, 64)
    ref = block.float().view(37, 3, 64)
    amax = ref.abs().amax(-1, keepdim=True)
    # e4m3 keeps 3 mantissa bits: error <= 1/16 of the value, plus bf16 rounding of the result
    assert ((out - ref).abs() <= ref.abs() / 16 + amax * 2**-9 + 1e-30).all()
    assert torch.equal(out[0], torch.zeros(3, 64))
    rel = (out - ref).norm() / ref.norm()
    assert rel < 0.05
    assert len(enc.scales) == 37 * 3 * 4


def test_corrupt_payload_is_a_data_error():
    block = _block()
    enc = encode(block, "bf16-zstd", n_layers=3)
    data = bytes(enc.hidden)
    enc.hidden = data[:10] + b"\x00" * 20 + data[30:]
    with pytest.raises(DataError, match="cannot decode a bf16-zstd block of 37x192"):
        decode(enc, "bf16-zstd", 37, 192, 3)


def test_wrong_input_and_codec():
    with pytest.raises(ValueError, match="bfloat16"):
        encode(torch.zeros(2, 4), "raw", 1)
    with pytest.raises(ValueError, match="unknown codec"):
        encode(torch.zeros(2, 4, dtype=torch.bfloat16), "gzip", 1)
    assert set(CODECS) == {"raw", "bf16-zstd", "fp8-zstd", "fp4-zstd"}


@pytest.mark.parametrize("codec", CODECS)
def test_decode_into_a_slice_writes_only_its_tokens(codec):
    block = _block()
    enc = encode(block, codec, n_layers=3)
    whole = decode(enc, codec, 37, 192, 3)
    batch = torch.full((50, 192), 7.0, dtype=torch.bfloat16)  # a packed batch: rows 5..24
    got = decode(enc, codec, 37, 192, 3, out=batch[5:25])
    assert got.data_ptr() == batch[5].data_ptr()
    assert torch.equal(batch[5:25].view(torch.int16), whole[:20].view(torch.int16))
    assert (batch[:5] == 7).all() and (batch[25:] == 7).all()  # nothing outside the slice
    with pytest.raises(ValueError, match="contiguous bfloat16"):
        decode(enc, codec, 37, 192, 3, out=torch.empty(40, 192, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous bfloat16"):
        decode(enc, codec, 37, 192, 3, out=torch.empty(192, 20, dtype=torch.bfloat16).t())


def test_a_plane_longer_than_the_block_is_a_data_error():
    enc = encode(_block(), "bf16-zstd", n_layers=3)  # 37 tokens, read as if it held 36
    with pytest.raises(DataError, match="more than the expected 6912 bytes"):
        decode(enc, "bf16-zstd", 36, 192, 3)


def test_topk_soft_targets_round_trip_bit_exact():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 151_936, (37, 8), generator=g, dtype=torch.int32)
    logprobs = -torch.rand(37, 8, generator=g).mul(30).sort(-1).values.half()
    logprobs[0, 7] = torch.finfo(torch.float16).min  # the floor extract clamps to
    frames = pack_topk(ids, logprobs)
    got_ids, got_lp = decode_topk(*frames, 37, 8)
    assert (got_ids.dtype, got_lp.dtype) == (torch.int32, torch.float16)
    assert torch.equal(got_ids, ids) and torch.equal(
        got_lp.view(torch.int16), logprobs.view(torch.int16)
    )
    with pytest.raises(DataError, match="top-k ids hold 1184 bytes, expected 1280"):
        decode_topk(*frames, 40, 8)
    with pytest.raises(DataError, match="cannot decode the top-k log-probs of 37x8"):
        decode_topk(frames[0], frames[1][:-6], 37, 8)
    with pytest.raises(ValueError, match="int32 ids and float16 log-probs"):
        pack_topk(ids.long(), logprobs)


@pytest.mark.parametrize("width", [64, 15])  # even: two bytes per lookup; odd: one
def test_fp8_decode_equals_torchs_cast_bit_for_bit(width):
    """The table-lookup dequantization gives exactly torch's float8 -> float32 cast times the
    scale, rounded to bf16, for every byte value (NaN bytes included) and for a slice."""
    g = torch.Generator().manual_seed(1)
    T, n_layers = 300, 1  # 300 x 15 bytes cover all 256 values
    q = torch.arange(T * width, dtype=torch.int64).remainder(256).to(torch.uint8)
    q = q[torch.randperm(q.numel(), generator=g)].view(T, width)
    scales = torch.rand(T, n_layers, generator=g) + 0.5
    enc = pack((q, scales), "fp8-zstd")
    want = (q.view(torch.float8_e4m3fn).float() * scales).to(torch.bfloat16)
    got = decode(enc, "fp8-zstd", T, width, n_layers)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # NaNs compare as bits
    part = torch.empty(7, width, dtype=torch.bfloat16)
    decode(enc, "fp8-zstd", T, width, n_layers, out=part)
    assert torch.equal(part.view(torch.int16), want[:7].view(torch.int16))


def _massive(T=24, L=2, H=128, G=32, seed=0):
    """States with a massive-activation channel (500x the others) in layer 0, every token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, L, H, generator=g)
    x[:, 0, 5] = 500.0
    x[0] = 0  # an all-zero token
    return x.reshape(T, L * H).to(torch.bfloat16)


@pytest.mark.parametrize("group", [16, 32, 64])
def test_fp4_error_is_bounded_per_group_and_an_outlier_stays_in_its_group(group):
    block = _massive(G=group)
    enc = encode(block, "fp4-zstd", n_layers=2, group_size=group)
    out = decode(enc, "fp4-zstd", 24, 256, 2, group_size=group).float()
    ref = block.float()
    err = (out - ref).abs().view(24, -1, group)
    amax = ref.abs().view(24, -1, group).amax(-1, keepdim=True)
    # e2m1 on a step of s = amax / 6: half a gap, <= |x| / 4 above s and <= s / 4 below it; a
    # scale rounded to e4m3 (<= 1/16 of it) clips at most amax / 16; the result's bf16 rounding
    x = ref.abs().view_as(err)
    assert (err <= x / 4 + amax * (1.07 / 24 + 1 / 16) + x * 2**-8 + 1e-30).all()
    assert torch.equal(out[0], torch.zeros(256))
    # the other groups of layer 0 keep their own step: a per-token scale (500 / 6 a step) would
    # round them all to 0, an error as large as the states
    others = (out - ref).view(24, 2, 128)[:, 0, group:]
    assert others.norm() < 0.2 * ref.view(24, 2, 128)[:, 0, group:].norm()
    # 4-bit codes + one scale byte per group + a float32 per token and layer + 4 outliers per
    # token and layer (channel and bf16 value), before zstd
    assert len(enc.hidden) + len(enc.scales) <= 24 * (128 + 256 // group + 8 + 32) + 64


def test_fp4_decode_equals_the_grid_times_the_scales():
    """Every code decodes to its grid value times its group's scale (low nibble first), on the
    device as on the CPU: code c is level (c + 7) mod 16 of the ascending grid, so a zero byte is
    two zeros; on the integer grid that is 4-bit two's complement."""
    T, L, H, G = 4, 1, 32, 16
    codes = torch.arange(T * L * H).remainder(16).to(torch.uint8).view(T, L * H)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    inner = torch.tensor([[1.0, 2.0]] * T).to(torch.float8_e4m3fn).view(torch.uint8)
    outer = torch.full((T, L), 0.5)
    scale = torch.tensor([0.5] * 16 + [1.0] * 16)
    e2m1 = torch.tensor([E2M1_LEVELS[(c + 7) % 16] if c != 8 else 0.0 for c in range(16)])
    want = e2m1[codes.long()] * scale
    assert e2m1[0] == 0 and e2m1[1] == 0.5 and e2m1[7] == 6 and e2m1[9] == -6 and e2m1[15] == -0.5
    # the outliers: 4 channels a token keep their bf16 values, whatever their codes say
    where = torch.tensor([[3, 10, 17, 31]] * T, dtype=torch.int16)
    kept = torch.tensor([[100.0, -2.5, 0.0, 1e-3]] * T).bfloat16()
    want[:, [3, 10, 17, 31]] = kept.float()
    stored = (packed, inner, outer, where, kept.view(torch.int16))
    got = dequantize_4bit(*(t.numpy() for t in stored), G)
    assert torch.equal(torch.from_numpy(got), want)
    assert torch.equal(
        dequantize(stored, "fp4-zstd").view(torch.int16), want.bfloat16().view(torch.int16)
    )
    ints = dequantize_4bit(*(t.numpy() for t in stored), G, INT4_LEVELS)
    signed = torch.where(codes >= 8, codes.float() - 16, codes.float())
    signed[codes == 8] = 0  # never written
    signed = signed * scale
    signed[:, [3, 10, 17, 31]] = kept.float()
    assert torch.equal(torch.from_numpy(ints), signed)


@pytest.mark.parametrize("levels", [E2M1_LEVELS, INT4_LEVELS])
def test_stochastic_rounding_is_unbiased_and_nearest_is_not_worse(levels):
    block = _massive(T=64)
    ref = block.float().numpy()
    n = 400
    g = torch.Generator().manual_seed(0)
    mean = 0

    def once(**kw):
        return dequantize_4bit(
            *(p.numpy() for p in quantize_4bit(block, 2, 32, levels, **kw)), 32, levels
        )

    for _ in range(n):
        mean = mean + once(stochastic=True, generator=g) / n
    nearest, sampled = once(), once(stochastic=True, generator=g)
    step = abs(ref[1:]).reshape(63, -1, 32).max(-1, keepdims=True) / levels[-1]  # token 0 is 0
    ref, mean, nearest, sampled = ref[1:], mean[1:], nearest[1:], sampled[1:]
    bias = abs(mean - ref).reshape(63, -1, 32) / step
    off = abs(nearest - ref).reshape(63, -1, 32) / step
    assert bias.mean() < 0.4 * off.mean()  # averages to the value; nearest stays off by its error
    assert ((nearest - ref) ** 2).sum() < ((sampled - ref) ** 2).sum()


def test_fp4_group_size_must_match_and_divide():
    block = _massive()
    enc = encode(block, "fp4-zstd", n_layers=2, group_size=32)
    with pytest.raises(
        DataError, match=r"192 values of group scales, expected 384 \(group size 16\)"
    ):
        decode(enc, "fp4-zstd", 24, 256, 2, group_size=16)
    with pytest.raises(DataError, match="cannot decode a fp8-zstd block"):
        decode(enc, "fp8-zstd", 24, 256, 2)  # an fp4 block read as fp8
    with pytest.raises(ValueError, match="codec fp8-zstd has no scale groups"):
        encode(block, "fp8-zstd", n_layers=2, group_size=32)
    with pytest.raises(
        ConfigError, match="extract.group_size is 48, which must be even and divide"
    ):
        check_group(48, 128)
    check_group(64, 128)
